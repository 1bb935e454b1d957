#!/usr/bin/env bash
# Unmodified perftest over ferroce's drop-in libibverbs.so.1 beside `ferroce perf` (the same
# transport through ferroce's own API), two processes on loopback, in the same run:
#   scripts/bench_dropin.sh           # REPS=3 pairs of runs per figure by default
# Prints perftest's t_typical (latency) or average bandwidth, ferroce perf's, and their ratio
# (median and range over REPS interleaved pairs), for each provider (udp, and auto = shared
# memory between the two processes). The ratio is the price of the C ABI and of perftest's
# own way of waiting (ib_write_lat spins on memory and never calls the library); for write_lat
# a second line compares perftest with `ferroce perf --wait-like-perftest`, which waits the
# same way, so that the ratio is the C ABI's alone.
#
# `ibv_rc_pingpong -s 64` (rdma-core's own round trips: a signaled SEND and a re-posted RECV per
# iteration), polling and with completion events (-e), is printed beside `ferroce perf
# send_lat`'s one-way figure at 64 B: its ratio is how many one-way trips an iteration costs.
#
# FERROCE_BIN and IBVERBS_LIB point at another build (a before/after comparison: run the script
# once per build, or interleave by hand); TESTS picks rows (default: all).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${FERROCE_BIN:-}" ]; then
  scripts/build-libibverbs.sh >/dev/null
  cargo build --release -q -p ferroce-cli
fi
F=${FERROCE_BIN:-$PWD/target/release/ferroce}
LIB=${IBVERBS_LIB:-$PWD/target/ibverbs}
REPS=${REPS:-5}
TESTS=${TESTS:-"write_lat send_lat read_lat atomic_lat write_bw read_bw rc_pingpong"}
echo "# $(nproc) CPUs, $(uname -r), $(date -u +%FT%TZ), REPS=$REPS; ferroce: $F; libibverbs: $LIB"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
port=19500

listening() { grep -q ":$(printf '%04X' "$1") 00000000:0000 0A" /proc/net/tcp /proc/net/tcp6 2>/dev/null; }
# pair OUT SERVER-CMD... -- CLIENT-EXTRA...: server in the background, client once it listens.
pair() {
  local out=$1; shift
  local srv=() ; while [ "$1" != -- ]; do srv+=("$1"); shift; done; shift
  port=$((port + 1))
  "${srv[@]}" -p $port > "$out.srv" 2>&1 &
  local pid=$! i=0
  while ! listening $port; do sleep 0.01; i=$((i+1)); [ $i -gt 1000 ] && break; done
  "${srv[@]}" -p $port "$@" > "$out" 2>&1 || true
  wait $pid || true
}

wanted() { case " $TESTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

for prov in udp auto; do
  for spec in "write_lat|8|20000" "send_lat|8|20000" "read_lat|8|20000" "atomic_lat|8|20000" \
              "write_bw|1048576|5000" "read_bw|1048576|1000"; do
    IFS='|' read -r t size iters <<< "$spec"
    wanted "$t" || continue
    for r in $(seq "$REPS"); do
      pair "$tmp/pt_${prov}_${t}_$r" env LD_LIBRARY_PATH="$LIB" FERROCE_PROVIDER=$prov \
        ib_$t -d ferroce_lo -x 0 -s "$size" -n "$iters" -F -- 127.0.0.1
      pair "$tmp/fp_${prov}_${t}_$r" "$F" perf "$t" --provider "$prov" -s "$size" -n "$iters" --json -- 127.0.0.1
      if [ "$t" = write_lat ]; then
        # ferroce perf waiting as perftest waits (memory only), drop-in context settings.
        pair "$tmp/fw_${prov}_${t}_$r" "$F" perf "$t" --provider "$prov" -s "$size" -n "$iters" \
          --wait-like-perftest --json -- 127.0.0.1
      fi
    done
  done
  if wanted rc_pingpong; then
    for r in $(seq "$REPS"); do
      for ev in poll events; do
        e=(); [ $ev = events ] && e=(-e)
        pair "$tmp/pp_${prov}_${ev}_$r" env LD_LIBRARY_PATH="$LIB" FERROCE_PROVIDER=$prov \
          ibv_rc_pingpong -d ferroce_lo -g 0 -s 64 -n 5000 "${e[@]}" -- 127.0.0.1
      done
      pair "$tmp/fs_${prov}_$r" "$F" perf send_lat --provider "$prov" -s 64 -n 20000 --json -- 127.0.0.1
    done
  fi
done

python3 - "$tmp" "$REPS" "$TESTS" <<'PY'
import json, os, re, statistics, sys
d, reps, tests = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
def perftest(path, lat):
    for line in open(path):
        f = line.split()
        if len(f) >= 5 and f[0].isdigit() and f[1].isdigit():
            # lat: #bytes #iters t_min t_max t_typical ...; bw: #bytes #iters peak avg msg_rate
            return float(f[4] if lat else f[3])
    raise SystemExit(f"no result in {path}: {open(path).read()[-400:]}")
def ferroce(path, lat):
    for line in open(path):
        if line.startswith("{"):
            j = json.loads(line)
            return j["t_typical_us"] if lat else j["bw_avg_mb_s"]
    raise SystemExit(f"no result in {path}: {open(path).read()[-400:]}")
print(f"{'test':<22}{'provider':<9}{'perftest+libibverbs':>21}{'ferroce perf':>14}{'ratio (median, range)':>26}")
for prov in ["udp", "auto"]:
    for t, size in [("write_lat", 8), ("send_lat", 8), ("read_lat", 8), ("atomic_lat", 8),
                    ("write_bw", 1048576), ("read_bw", 1048576)]:
        if t not in tests:
            continue
        lat = t.endswith("lat")
        a = [perftest(os.path.join(d, f"pt_{prov}_{t}_{r}"), lat) for r in range(1, reps + 1)]
        b = [ferroce(os.path.join(d, f"fp_{prov}_{t}_{r}"), lat) for r in range(1, reps + 1)]
        ratios = [x / y for x, y in zip(a, b)]
        unit = "us" if lat else "MB/s"
        print(f"{t + ' ' + str(size) + ' B':<22}{prov:<9}{statistics.median(a):>15.2f} {unit:<5}"
              f"{statistics.median(b):>9.2f} {unit:<5}{statistics.median(ratios):>9.2f}x "
              f"({min(ratios):.2f}..{max(ratios):.2f})")
        if t == "write_lat":
            w = [ferroce(os.path.join(d, f"fw_{prov}_{t}_{r}"), lat) for r in range(1, reps + 1)]
            rw = [x / y for x, y in zip(a, w)]
            print(f"{'  vs --wait-like-perftest':<31}{statistics.median(w):>15.2f} {unit:<5}"
                  f"{statistics.median(rw):>9.2f}x ({min(rw):.2f}..{max(rw):.2f})")
def pingpong(path):
    for line in open(path):
        m = re.search(r"iters in [0-9.]+ seconds = ([0-9.]+) usec/iter", line)
        if m:
            return float(m.group(1))
    raise SystemExit(f"no result in {path}: {open(path).read()[-400:]}")
if "rc_pingpong" in tests:
    print(f"{'ibv_rc_pingpong 64 B':<22}{'provider':<9}{'us/iter':>21}{'send_lat 1-way':>14}{'ratio (median, range)':>26}")
    for prov in ["udp", "auto"]:
        one_way = [ferroce(os.path.join(d, f"fs_{prov}_{r}"), True) for r in range(1, reps + 1)]
        for ev in ["poll", "events"]:
            it = [pingpong(os.path.join(d, f"pp_{prov}_{ev}_{r}")) for r in range(1, reps + 1)]
            ratios = [x / y for x, y in zip(it, one_way)]
            print(f"{'  ' + ev:<22}{prov:<9}{statistics.median(it):>15.2f} us   "
                  f"{statistics.median(one_way):>9.2f} us   {statistics.median(ratios):>9.2f}x "
                  f"({min(ratios):.2f}..{max(ratios):.2f})")
PY
