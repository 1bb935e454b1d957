#!/usr/bin/env bash
# NVMe over Fabrics between ferroce peers on one host (shared memory): `ferroce nvmf-perf`
# against `ferroce nvmf-target` serving memory, 4 KiB random reads at queue depth 32 and 1 MiB
# sequential reads at queue depth 4, beside the backing memory's own copy speed (memcpy of
# 1 MiB blocks, the ceiling of any transport's throughput) measured in the same run, in
# interleaved repetitions. Prints each repetition, then the median and range.
#
#   scripts/bench_nvmf.sh [REPS] [SECONDS]
#
# Needs the release build (cargo build --release -p ferroce-cli).
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-5}
secs=${2:-3}
F=$PWD/target/release/ferroce
[ -x "$F" ] || { echo "build first: cargo build --release -p ferroce-cli" >&2; exit 1; }
nqn=nqn.2026-11.io.ferroce:bench
port=$((44000 + RANDOM % 1000))
"$F" nvmf-target --nqn $nqn --listen 127.0.0.1 --port $port --memory 256M > /tmp/bench_nvmf_target.log 2>&1 &
tp=$!
trap 'kill -INT $tp 2>/dev/null; wait $tp 2>/dev/null || true' EXIT
for _ in $(seq 1 50); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.1; done

# memcpy_mbs: MB/s of copying 1 MiB blocks within a 256 MiB buffer, for SECONDS.
memcpy_mbs() {
  python3 - "$secs" <<'PY'
import sys, time
secs = float(sys.argv[1]); blk = 1 << 20; n = 256
src = bytearray(blk * n); dst = bytearray(blk * n)
s, d = memoryview(src), memoryview(dst)
moved = 0; t0 = time.perf_counter(); i = 0
while time.perf_counter() - t0 < secs:
    a = (i * 7919 % n) * blk; b = (i % n) * blk
    d[b:b + blk] = s[a:a + blk]; moved += blk; i += 1
print(round(moved / (time.perf_counter() - t0) / 1e6, 1))
PY
}
perf_field() { # perf_field RW BS QD FIELD(iops|mbs)
  local out
  out=$("$F" nvmf-perf --target 127.0.0.1 --port $port --nqn $nqn --rw "$1" --bs "$2" --qd "$3" --time "$secs" --size 256M)
  echo "$out" | awk -v f="$4" '/IOPS/ { for (i=1;i<NF;i++) { if (f=="iops" && $i=="IOPS") print $(i+1); if (f=="mbs" && $i=="throughput") print $(i+1) } }'
}
iops=(); mbs=(); cp=()
for r in $(seq 1 "$reps"); do
  i=$(perf_field randread 4k 32 iops); m=$(perf_field read 1M 4 mbs); c=$(memcpy_mbs)
  iops+=("$i"); mbs+=("$m"); cp+=("$c")
  echo "rep $r: 4 KiB randread qd32 $i IOPS; 1 MiB read qd4 $m MB/s; memcpy 1 MiB $c MB/s; ratio $(python3 -c "print(round($m/$c,3))")"
done
python3 - "${iops[*]}" "${mbs[*]}" "${cp[*]}" <<'PY'
import sys, statistics as st
iops, mbs, cp = ([float(x) for x in a.split()] for a in sys.argv[1:])
ratio = [m / c for m, c in zip(mbs, cp)]
f = lambda v, d=0: f"median {round(st.median(v), d)} (range {round(min(v), d)}-{round(max(v), d)})"
print(f"4 KiB random read, qd 32:      {f(iops)} IOPS")
print(f"1 MiB sequential read, qd 4:   {f(mbs, 1)} MB/s")
print(f"memcpy of 1 MiB blocks:        {f(cp, 1)} MB/s")
print(f"1 MiB read / memcpy:           {f(ratio, 3)}")
PY
