#!/usr/bin/env bash
# ferroce's figures beside raw UDP floors measured in the same run, on loopback.
#   scripts/bench.sh            # all figures
#   ITERS=20000 scripts/bench.sh
# Prints one table; ratios are what to compare across machines, not absolute figures.
# Every ferroce figure is over UDP (--provider udp): on loopback the automatic choice would be
# the shared-memory provider, which scripts/bench_shm.sh measures.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p ferroce-cli -p udp-baseline
F=target/release/ferroce
U=target/release/udp-baseline
ITERS=${ITERS:-10000}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

$U pingpong --size 8 --iters "$ITERS" --json > "$tmp/udp_pp.json"
$U stream --size 4096 --bytes $((1 << 30)) --mode sendmmsg --json > "$tmp/udp_mmsg.json"
$U stream --size 4096 --bytes $((1 << 30)) --mode gso --json > "$tmp/udp_gso.json"
for t in write_lat read_lat send_lat atomic_lat; do
  $F perf $t --loopback --provider udp --size 8 --iters "$ITERS" --json > "$tmp/$t.json" 2>/dev/null ||
    $F perf $t --loopback --provider udp --iters "$ITERS" --json > "$tmp/$t.json"
done
$F perf write_bw --loopback --provider udp --size 65536 --iters 20000 --json > "$tmp/write_bw_64k.json"
$F perf write_bw --loopback --provider udp --size 1048576 --iters 2000 --json > "$tmp/write_bw_1m.json"
$F perf read_bw --loopback --provider udp --size 1048576 --iters 2000 --json > "$tmp/read_bw_1m.json"

python3 - "$tmp" <<'PY'
import json, sys, os
d = sys.argv[1]
j = lambda n: json.loads(open(os.path.join(d, n)).read().splitlines()[0])
pp = j("udp_pp.json")["t_typical_us"]
mmsg = j("udp_mmsg.json")["mb_s"] * 1e6 / 2**20   # to perftest's MB (2^20)
gso = j("udp_gso.json")["mb_s"] * 1e6 / 2**20
print(f"raw UDP 8 B ping-pong (busy poll), one way: {pp:.2f} us")
print(f"raw UDP 4 KiB stream: sendmmsg {mmsg:.0f} MB/s, GSO {gso:.0f} MB/s (MB = 2^20 B)")
print()
print(f"{'ferroce figure':<34}{'value':>12}  {'vs raw UDP':>22}")
for t, how in [("write_lat", "half round trip"), ("send_lat", "half round trip"),
               ("read_lat", "full operation"), ("atomic_lat", "full operation")]:
    v = j(f"{t}.json")["t_typical_us"]
    ref = pp if "half" in how else 2 * pp
    print(f"{t + ' 8 B (' + how + ')':<34}{v:>9.2f} us  {v / ref:>8.2f}x {'ping-pong' if 'half' in how else 'round trip'}")
for n, label in [("write_bw_64k.json", "write_bw 64 KiB"), ("write_bw_1m.json", "write_bw 1 MiB"), ("read_bw_1m.json", "read_bw 1 MiB")]:
    v = j(n)["bw_avg_mb_s"]
    print(f"{label:<34}{v:>7.0f} MB/s  {100 * v / mmsg:>7.0f}% of sendmmsg, {100 * v / gso:.0f}% of GSO")
PY
