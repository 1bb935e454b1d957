#!/usr/bin/env bash
# Same-host figures for ferroce's shared-memory provider (issue #5), beside the floors and UCX's
# shared-memory transport measured in the same run:
#   - shm-baseline: cache-line ping-pong between two processes, memcpy 4 KiB..4 MiB
#   - UCX (Debian's ucx-utils, ucx_perftest server + client on 127.0.0.1, UCX_TLS=posix,self):
#     put latency, get, fetch-and-add and add per operation at 8 B, put bandwidth 4 KiB..4 MiB
#   - ferroce: perf write_lat / read_lat / atomic_lat 8 B and write_bw 4 KiB..4 MiB with
#     --loopback --provider shm (rows skipped, with a line saying so, while that flag is missing)
# Goals of issue #5: 8 B WRITE latency no worse than UCX's put latency; 1 MiB WRITE bandwidth at
# least 80% of single-thread memcpy. Compare ratios across machines, not absolute figures.
#
# usage:  scripts/bench_shm.sh
# env:    UCX_TLS   (default posix,self; e.g. sysv,self or posix,cma,self)
#         LAT_ITERS (default 200000)  timed iterations of every 8 B latency test
#         REPS      (default 3)       repetitions of the whole set (medians are reported)
#         LAT_PAIRS (default 3)       runs of each 8 B latency test per repetition, each beside
#                                     the run it is compared with
#         RAW_DIR   keep every raw output (JSON lines, UCX CSV, logs) in this directory
# Installs ucx-utils with apt-get when ucx_perftest is missing (needs root). Nothing is pinned.
#
# What each figure is (ucx_perftest as in UCX 1.13.1, src/tools/perf/lib/ucp_tests.cc and
# libperf.c; the client is the measuring side and prints the figures):
#   shm-baseline pingpong  Two processes share a memfd page; A stores a sequence number in line 1,
#                          B spins on line 1 and copies it into line 2, A spins on line 2. Timed per
#                          round trip with the TSC, reported halved: ONE-WAY (half round trip).
#   UCX ucp_put_lat        PINGPONG test: each side ucp_put_nbx()es a sequence number into the
#                          peer's buffer (over posix/sysv: a store into the peer's segment, which
#                          is mapped into this process) and spins on its own buffer for the peer's
#                          answer. libperf divides the time by 2 for ping-pong tests: ONE-WAY (half
#                          round trip), the same definition as perftest's write_lat and the
#                          cache-line ping-pong above.
#   UCX ucp_get            STREAM_UNI test: only the client works, one ucp_get_nbx() per iteration
#                          (-O 1: at most one outstanding). Over posix/sysv, uct_sm_ep_get_bcopy()
#                          memcpy()s straight out of the peer's segment mapped into the client and
#                          the get completes inside the call; the server only runs its progress
#                          loop. Figure: time PER OPERATION, not halved. No round trip happens and
#                          the peer never writes that buffer, so the cache line stays in the
#                          client's own cache: an 8 B get is a local load plus UCP's call overhead.
#                          That is why get (~20 ns on the anchors' machine) is BELOW put (~50 ns
#                          one-way): put_lat pays for the line crossing between cores twice per
#                          round trip, get never moves a line. (The anchors README calls it "full
#                          round trip": perftest's term for read_lat's whole operation; on shared
#                          memory the whole operation involves no peer at all.)
#   UCX ucp_fadd / ucp_add Same shape as get: one ucp_atomic_op_nbx() per iteration, -O 1. The mm
#                          transports advertise CPU atomics, so UCP does a locked add (fetching the
#                          old value for fadd) on the peer's mapped segment inside the call; the
#                          word stays in the client's cache. PER OPERATION. ferroce's atomic_lat is
#                          FETCH_ADD, so its ratio is taken against ucp_fadd.
#   UCX ucp_put_bw         STREAM_UNI: the client ucp_put_nbx()es SIZE bytes into the same remote
#                          buffer every iteration (over posix: memcpy into the mapped segment; with
#                          cma in UCX_TLS large puts may go through process_vm_writev), the last
#                          put carries a flag the server waits for. Bytes / time, in MiB/s (2^20,
#                          like perftest's and ferroce's MB). The remote buffer is reused, so small
#                          sizes stay cache-resident, as memcpy's do.
#   UCX "p50" column       The 50th percentile of per-iteration times over the last <= 2048
#                          iterations (TIMING_QUEUE_SIZE); "avg" is total time / iterations. The
#                          clock is the TSC, which on AMD Zen advances in 10 ns steps, so p50 comes
#                          in 5 ns steps for put_lat (halved) and 10 ns steps for the others.
#   ferroce write_lat      perftest's write_lat: ONE-WAY (half round trip of a WRITE ping-pong).
#   ferroce read_lat       perftest's read_lat: post to completion of one READ, PER OPERATION.
#   ferroce atomic_lat     FETCH_ADD, post to completion, PER OPERATION.
#   ferroce write_bw       bw_avg_mb_s, MB = 2^20 B.
#   shm-baseline memcpy    Single-thread copy of SIZE bytes between two page-aligned buffers, over
#                          and over; MB/s with MB = 2^20 B (GB/s, 10^9, in the raw JSON).
# Latency figures are the median ("typical"); the mean is shown beside it because the machine is
# noisy (2 cores shared with other work): preempted iterations move the mean, not the median.
set -uo pipefail
cd "$(dirname "$0")/.."

TLS=${UCX_TLS:-posix,self}
LAT_ITERS=${LAT_ITERS:-200000}
REPS=${REPS:-3}
LAT_PAIRS=${LAT_PAIRS:-3}
SIZES="4096 8192 16384 32768 65536 131072 262144 524288 1048576 2097152 4194304"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
OUT=${RAW_DIR:-$tmp}
mkdir -p "$OUT"
note() { echo "bench_shm: $*" >&2; }

# Iterations for a bandwidth run of $1 bytes: about 2 GiB, between 500 and 100000.
bw_iters() { local n=$(((2 << 30) / $1)); ((n < 500)) && n=500; ((n > 100000)) && n=100000; echo $n; }

# cargo runs under the shared lock when flock exists (several sessions build in this tree).
cargo_build() {
  if command -v flock >/dev/null; then flock /tmp/ferroce-cargo.lock cargo build --release -q "$@"
  else cargo build --release -q "$@"; fi
}

########## build ##########
cargo_build -p shm-baseline || { note "cannot build shm-baseline"; exit 1; }
S=target/release/shm-baseline
F=target/release/ferroce
if ! cargo_build -p ferroce-cli 2>"$OUT/ferroce_build.log"; then
  note "ferroce-cli does not build ($(grep -m1 '^error' "$OUT/ferroce_build.log")); ferroce rows skipped"
  F=""
fi

if ! command -v ucx_perftest >/dev/null; then
  note "ucx_perftest missing: installing ucx-utils"
  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y ucx-utils; } >"$OUT/apt.log" 2>&1 ||
    note "could not install ucx-utils (see apt-get output); UCX rows skipped"
fi

echo "# $(nproc) CPUs, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), kernel $(uname -r)" \
  "| $(ucx_info -v 2>/dev/null | sed -n 's/# Version /UCX /p' | head -1) UCX_TLS=$TLS | loadavg $(cut -d' ' -f1-3 /proc/loadavg)"

PORT=$((20000 + RANDOM % 20000))
# ucx_run NAME ARGS...: one ucx_perftest server + client pair on 127.0.0.1; the client's final CSV
# line (iterations,p50_lat_us,avg_lat_us,overall_lat_us,avg_bw_MiB/s,overall_bw_MiB/s,avg_mr,
# overall_mr) goes to $OUT/ucx_NAME.csv, logs beside it.
ucx_run() {
  local name=$1; shift
  PORT=$((PORT + 1))
  UCX_TLS=$TLS UCX_WARN_UNUSED_ENV_VARS=n ucx_perftest -p "$PORT" >"$OUT/ucx_$name.server.log" 2>&1 &
  local spid=$!
  sleep 0.3
  UCX_TLS=$TLS UCX_WARN_UNUSED_ENV_VARS=n timeout 120 ucx_perftest 127.0.0.1 -p "$PORT" -f -v "$@" \
    >"$OUT/ucx_$name.log" 2>&1
  local rc=$?
  for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 $spid 2>/dev/null || break; sleep 0.2; done
  kill $spid 2>/dev/null; wait $spid 2>/dev/null
  local line
  line=$(grep -E '^ *[0-9]+,' "$OUT/ucx_$name.log" | tail -1 | tr -d ' ')
  if [ $rc -ne 0 ] || [ -z "$line" ]; then
    note "ucx_perftest $* failed (rc=$rc): $(grep -m1 -iE 'error|unsupport|fail' "$OUT/ucx_$name.log")"
  else
    echo "$line" >"$OUT/ucx_$name.csv"
  fi
}
# fer NAME TEST ARGS...: one ferroce perf run over the shm provider into $OUT/ferroce_NAME.json.
fer() {
  local name=$1 t=$2; shift 2
  $F perf "$t" --loopback --provider shm "$@" --json >"$OUT/ferroce_$name.json" 2>"$OUT/ferroce_$name.err" ||
    { note "ferroce perf $t $* failed: $(head -1 "$OUT/ferroce_$name.err")"; rm -f "$OUT/ferroce_$name.json"; }
}
HAVE_UCX=$(command -v ucx_perftest >/dev/null && echo 1)
if [ -n "$F" ] && ! $F perf write_lat --loopback --provider shm --size 8 --iters 1000 --json \
    >/dev/null 2>"$OUT/ferroce_probe.err"; then
  echo "ferroce --provider shm not available: $(head -1 "$OUT/ferroce_probe.err")"
  F=""
fi

# One 8 B latency run of UCX test $u / ferroce test $f (- for none) of repetition $r, pair $k.
# put_lat is a ping-pong; the others stream with at most one operation outstanding.
run_ucx() {
  [ -n "$HAVE_UCX" ] && ucx_run "${u}_r${r}_$k" -t "ucp_$u" -s 8 -n "$LAT_ITERS" -w 10000 \
    $([ "$u" = put_lat ] || echo -O 1)
}
run_fer() { [ -n "$F" ] && [ "$f" != - ] && fer "${f}_r${r}_$k" "$f" --size 8 --iters "$LAT_ITERS"; }

# The host moves the two vCPUs around: the same cache-line round trip takes ~50 ns in one run and
# ~230 ns in the next (SMT siblings or not), so every figure is measured REPS times, interleaved,
# and the table gives medians over the repetitions and medians of ratios taken within one
# (for 8 B latency: of two runs side by side).
for r in $(seq "$REPS"); do
  note "repetition $r/$REPS: latency"
  # Each ferroce test runs beside the UCX test it is compared with, LAT_PAIRS times, the order
  # turned round each time: the host moves the vCPUs while a repetition runs, and a ratio only
  # means something when both of its runs saw the same placement.
  for pair in "put_lat write_lat" "get read_lat" "fadd atomic_lat" "add -"; do
    read -r u f <<<"$pair"
    for k in $(seq "$LAT_PAIRS"); do
      # The floor beside the WRITE/put pair, for the ratios to it.
      [ "$u" = put_lat ] && { $S pingpong --iters 300000 --json >"$OUT/pingpong_r${r}_$k.json" ||
        note "shm-baseline pingpong failed"; }
      if ((k % 2)); then run_ucx; run_fer; else run_fer; run_ucx; fi
    done
  done
  note "repetition $r/$REPS: bandwidth"
  $S memcpy --all --json >"$OUT/memcpy_r$r.json" || note "shm-baseline memcpy failed"
  for s in $SIZES; do
    [ -n "$HAVE_UCX" ] && ucx_run "put_bw_${s}_r$r" -t ucp_put_bw -s "$s" -n "$(bw_iters "$s")" -w 100
    [ -n "$F" ] && fer "write_bw_${s}_r$r" write_bw --size "$s" --iters "$(bw_iters "$s")"
  done
done

########## table ##########
python3 - "$OUT" "$SIZES" "$TLS" "$REPS" "$LAT_PAIRS" <<'PY'
import json, os, statistics, sys
d, sizes, tls = sys.argv[1], [int(s) for s in sys.argv[2].split()], sys.argv[3]
reps, pairs = int(sys.argv[4]), int(sys.argv[5])

def json_lines(name):
    """Every JSON object in a file of JSON lines (none if the file is missing or broken)."""
    try:
        return [json.loads(l) for l in open(os.path.join(d, name)) if l.strip().startswith("{")]
    except (OSError, ValueError):
        return []

def ucx(name):
    """(p50 ns, overall avg ns, overall bw MiB/s) of one UCX run, or None."""
    try:
        f = open(os.path.join(d, f"ucx_{name}.csv")).read().strip().split(",")
        return float(f[1]) * 1000, float(f[3]) * 1000, float(f[5])
    except (OSError, ValueError, IndexError):
        return None

def lat_of(key, run):
    """(typical ns, avg ns) of latency figure `key` in run (repetition, pair), or None; the
    ping-pong is measured next to put_lat and write_lat."""
    r, k = run
    if key == "pp":
        j = json_lines(f"pingpong_r{r}_{k}.json")
        return (j[0]["t_typical_ns"], j[0]["t_avg_ns"]) if j else None
    if key in ("put_lat", "get", "fadd", "add"):
        u = ucx(f"{key}_r{r}_{k}")
        return u[:2] if u else None
    j = json_lines(f"ferroce_{key}_r{r}_{k}.json")
    return (j[0]["t_typical_us"] * 1000, j[0]["t_avg_us"] * 1000) if j else None

def bw_of(kind, s, r):
    """MB/s (2^20) of `kind` at size s in repetition r, or None."""
    if kind == "memcpy":
        return next((j["mb_s"] for j in json_lines(f"memcpy_r{r}.json") if j["size"] == s), None)
    if kind == "ucx":
        u = ucx(f"put_bw_{s}_r{r}")
        return u[2] if u else None
    j = json_lines(f"ferroce_write_bw_{s}_r{r}.json")
    return j[0]["bw_avg_mb_s"] if j else None

R = range(1, reps + 1)
RUNS = [(r, k) for r in R for k in range(1, pairs + 1)]
med = lambda xs: statistics.median(xs) if xs else None

def ratios(f, over=R):
    """Median and range of ratios f(x) for x in `over` (None entries skipped)."""
    xs = [x for x in (f(o) for o in over) if x is not None]
    return (med(xs), min(xs), max(xs)) if xs else None

def lat_ratio(a, b, scale=1.0):
    def f(run):
        x, y = lat_of(a, run), lat_of(b, run)
        return x[0] / (scale * y[0]) if x and y else None
    return ratios(f, RUNS)

def show_ratio(label, rr, at_most=None):
    if rr is None:
        return print(f"  {label:<56}{'-':>6}")
    verdict = "" if at_most is None else \
        f"   goal <= {at_most:.2f}: " + ("met" if rr[0] <= at_most else "NOT met")
    print(f"  {label:<56}{rr[0]:6.2f}  ({rr[1]:.2f}..{rr[2]:.2f}){verdict}")

LAT = [("pp", "cache-line ping-pong 8 B (shm-baseline)", "one-way"),
       ("put_lat", f"UCX put 8 B ({tls})", "one-way"),
       ("get", f"UCX get 8 B ({tls})", "per op, local"),
       ("fadd", f"UCX fetch-add 8 B ({tls})", "per op, local"),
       ("add", f"UCX add 8 B, no fetch ({tls})", "per op, local"),
       ("write_lat", "ferroce WRITE 8 B (shm)", "one-way"),
       ("read_lat", "ferroce READ 8 B (shm)", "per op"),
       ("atomic_lat", "ferroce FETCH_ADD 8 B (shm)", "per op")]
print()
print(f"8 B latency, ns: medians over {reps} x {pairs} runs     definition      typical       avg   typical range")
for key, label, how in LAT:
    v = [x for x in (lat_of(key, run) for run in RUNS) if x]
    if not v:
        print(f"  {label:<45}{how:<14}{'-':>9}{'-':>10}")
        continue
    t = [x[0] for x in v]
    print(f"  {label:<45}{how:<14}{med(t):9.1f}{med([x[1] for x in v]):10.1f}   {min(t):.1f}..{max(t):.1f}")
print("  one-way = half a round trip; per op = post to completion on the initiator; local = UCX")
print("  does it with a load or a locked add on the peer's mapped memory: no peer, no round trip")

print()
print("latency ratios (typical / typical of two runs side by side; median and range)")
show_ratio("ferroce WRITE / UCX put (both one-way)", lat_ratio("write_lat", "put_lat"), 1.0)
show_ratio("ferroce WRITE / cache-line ping-pong (both one-way)", lat_ratio("write_lat", "pp"))
show_ratio("UCX put / cache-line ping-pong (both one-way)", lat_ratio("put_lat", "pp"))
show_ratio("ferroce READ / UCX get (both per op)", lat_ratio("read_lat", "get"))
show_ratio("ferroce FETCH_ADD / UCX fetch-add (both per op)", lat_ratio("atomic_lat", "fadd"))
show_ratio("ferroce READ / cache-line round trip (2 x one-way)", lat_ratio("read_lat", "pp", 2.0))
show_ratio("ferroce FETCH_ADD / cache-line round trip", lat_ratio("atomic_lat", "pp", 2.0))

print()
print(f"WRITE bandwidth, MB/s (MB = 2^20 B): medians over {reps} repetitions; ratios are medians of")
print("per-repetition ratios")
print(f"  {'size':>7} {'memcpy':>9} {'UCX put':>9} {'ferroce':>9}   {'UCX/memcpy':>10} {'fer/memcpy':>10} {'fer/UCX':>8}")
goal_bw = None
for s in sizes:
    m, u, f = ([x for x in (bw_of(k, s, r) for r in R) if x is not None] for k in ("memcpy", "ucx", "fer"))
    def rr(a, b):
        x = ratios(lambda r: (bw_of(a, s, r) / bw_of(b, s, r))
                   if bw_of(a, s, r) is not None and bw_of(b, s, r) else None)
        return x[0] if x else None
    cell = lambda x, w, p: f"{x:{w}.{p}f}" if x is not None else f"{'-':>{w}}"
    name = f"{s >> 20} MiB" if s >= 1 << 20 else f"{s >> 10} KiB"
    fm = rr("fer", "memcpy")
    print(f"  {name:>7} {cell(med(m), 9, 0)} {cell(med(u), 9, 0)} {cell(med(f), 9, 0)}   "
          f"{cell(rr('ucx', 'memcpy'), 10, 2)} {cell(fm, 10, 2)} {cell(rr('fer', 'ucx'), 8, 2)}")
    if s == 1 << 20:
        goal_bw = fm

print()
w = lat_ratio("write_lat", "put_lat")
print("goal 1, 8 B WRITE latency <= UCX put latency (one-way, typical): " +
      (f"{w[0]:.2f}x -> {'met' if w[0] <= 1 else 'NOT met'}" if w else "not measured"))
print("goal 2, 1 MiB WRITE bandwidth >= 80% of memcpy 1 MiB: " +
      (f"{100 * goal_bw:.0f}% -> {'met' if goal_bw >= 0.8 else 'NOT met'}" if goal_bw is not None else "not measured"))
PY
[ -n "${RAW_DIR:-}" ] && note "raw outputs in $RAW_DIR"
exit 0
