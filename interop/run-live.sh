#!/usr/bin/env bash
# Live interop: ferroce on the host side of a bridge, Linux Soft-RoCE (rxe) in a QEMU guest, on a
# real (virtual) wire. Everything runs inside the network namespace `in-netns.sh` makes, so no
# packet leaves this machine's own test network (bridge br-rxe 192.168.77.1/24, guest .10).
#
#   interop/run-live.sh              # set-up if needed, then every live test; exit 1 on a failure
#   KEEP_OUT=1 interop/run-live.sh   # keep the captures and logs (printed at the end)
#   LIVE_ONLY=rdmacm interop/run-live.sh   # only the checks whose names match
#   interop/run-live.sh --self-check # checks the summary's rule on made-up results (no root)
#
# Set-up (root, Debian 12): installs qemu-system-x86, debootstrap and friends, builds the guest
# image once into $WORK (default /var/tmp/ferroce-interop; later runs reuse it), and builds
# ferroce in release mode. Without root, or on a machine whose kernel cannot create network
# namespaces or tap devices, it prints one "skipped" line and exits 0; under CI (CI=true or
# CI=1) it fails instead, naming what is missing: there the suite must run.
#
# A check that fails is tried once more (see `check`); the summary counts the checks that passed
# only on their second try, and more than MAX_SECOND_TRIES of them fail the run.
#
# What it checks, each with the real tools in the guest as the independent peer (ferroce in
# both roles every time):
# - ibv_rc_pingpong <-> ferroce pingpong at 64 B, 4 KiB and 64 KiB (1, 4 and 64 packets at path
#   MTU 1024) and in events mode, data checked both ways (rxe's -c page check; ferroce's --verify
#   checks every echoed byte);
# - perftest 4.5 <-> ferroce perf --perftest: write/read/send/atomic lat and bw (atomic_bw with
#   CMP_AND_SWAP);
# - SEND and WRITE with immediate (the harness's rdma_imm.c <-> ferroce's examples/rdma_imm.rs,
#   immediates, lengths and bytes checked), and the same with the server's receives posted late:
#   an RNR NAK each way;
# - Debian's unmodified ibv_rc_pingpong, ibv_uc_pingpong, ibv_ud_pingpong and perftest (RC, UC and UD) on the host over ferroce's drop-in
#   libibverbs.so.1 (target/ibverbs) <-> the same tools on rxe, both roles;
# - libfabric's fi_pingpong over its verbs provider (MSG and RDM endpoints) on the host over the drop-in
#   libraries <-> the same on rxe and the kernel's rdma_cm, both roles;
# - rsockets (librdmacm's over rxe <-> ferroce's drop-in): rstream, riostream, rcopy, and iperf3
#   under librspreload.so on both sides (ferroce serving: rdma-core's rsockets cannot serve iperf3);
# - 5% loss in both directions inside the guest (netem on its egress, and on its ingress through
#   an ifb): WRITE go-back-N, READ retry and atomic replay across the wire, both roles;
# - rxe's hw_counters: its error counters unchanged over the loss-free part; ferroce's counters:
#   no ICRC error, rxe's packets accepted by solving their IPv4 Identification;
# - a capture of the whole run on the bridge in which every RoCE packet, ferroce's and rxe's,
#   verifies in `ferroce decode` and in scripts/verify_icrc.py;
# - figures: 8 B WRITE latency and 64 KiB WRITE bandwidth, ferroce<->rxe beside rxe<->rxe between
#   two guests, measured in the same run (both bound by the guests' software CPU: the ratio is
#   the figure).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
export WORK=${WORK:-/var/tmp/ferroce-interop}
export FERROCE=${FERROCE:-$ROOT/target/release/ferroce}

# A second try covers a rare stall of the guests' rxe (see `check`); more than this many checks
# passing only on their second try is no longer rare, and fails the run.
MAX_SECOND_TRIES=2

# cannot_run REASON: this machine lacks what the suite needs. A skip (exit 0) on a developer's
# machine; under CI, where scripts/test.sh runs this as root on a machine that has it all, a
# failure (exit 1), so that a run which checked nothing never reports green.
cannot_run() {
  case "${CI:-}" in
    [Tt][Rr][Uu][Ee] | 1)
      echo "interop: FAILED: cannot run: $1; under CI (CI=true) that is a failure, not a skip" >&2
      exit 1 ;;
  esac
  echo "interop: skipped ($1)"; exit 0
}

# summarize EXPECTED SECONDS: the run's last line from pass, failed and retried (set by
# `check`); returns 1 when a check failed, when fewer or more than EXPECTED checks ran (bash
# dropped one: a syntax error in its arithmetic, say), or when more than MAX_SECOND_TRIES
# passed only on their second try.
summarize() {
  local expected=$1 secs=$2 ok=0
  local again="${#retried[@]} of them only on a second try"
  [ ${#retried[@]} -gt 0 ] && again+=": ${retried[*]}"
  echo "interop: ${#failed[@]} failed, $pass passed ($again) in $secs s (guests under TCG)"
  [ ${#failed[@]} -eq 0 ] || ok=1
  if [ $((pass + ${#failed[@]})) -ne "$expected" ]; then
    echo "interop: FAILED: $((pass + ${#failed[@]})) checks ran, $expected expected"; ok=1
  fi
  if [ ${#retried[@]} -gt $MAX_SECOND_TRIES ]; then
    echo "interop: FAILED: ${#retried[@]} checks passed only on a second try," \
      "more than $MAX_SECOND_TRIES"
    ok=1
  fi
  return $ok
}

# self_check: summarize on made-up results, each with the status and line it must give.
self_check() {
  local bad=0
  # expect STATUS PATTERN PASSED FAILED RETRIED: summarize over 10 expected checks.
  expect() {
    local out rc
    out=$(pass=$3; failed=(); retried=()
          local i; for ((i = 0; i < $4; i++)); do failed+=("f$i"); done
          for ((i = 0; i < $5; i++)); do retried+=("r$i"); done
          summarize 10 0.1); rc=$?
    if [ $rc -ne "$1" ] || ! grep -qE -- "$2" <<< "$out"; then
      echo "self-check FAILED: passed $3, failed $4, second tries $5: status $rc (want $1), output:"
      sed 's/^/    /' <<< "$out"; bad=1
    fi
  }
  expect 0 '^interop: 0 failed, 10 passed \(0 of them only on a second try\) in 0.1 s' 10 0 0
  expect 0 '\(1 of them only on a second try: r0\)' 10 0 1
  expect 0 '\(2 of them only on a second try: r0 r1\)' 10 0 2
  expect 1 'FAILED: 3 checks passed only on a second try, more than 2' 10 0 3
  expect 1 '^interop: 1 failed, 9 passed' 9 1 0
  expect 1 'FAILED: 9 checks ran, 10 expected' 9 0 0
  expect 1 'FAILED: 11 checks ran, 10 expected' 11 0 0
  [ $bad -eq 0 ] && echo "interop: self-check: the summary's rule holds on 7 made-up runs"
  return $bad
}

if [ "${1:-}" = --self-check ]; then self_check; exit; fi

if [ "${1:-}" != --inside ]; then
  [ "$(id -u)" -eq 0 ] ||
    cannot_run "needs root for namespaces and taps (run scripts/test.sh as root, as CI does)"
  if ! ip netns add ferroce-probe-$$ 2>/dev/null; then
    cannot_run "this kernel cannot create network namespaces"
  fi
  if ! ip -n ferroce-probe-$$ tuntap add dev tap-probe mode tap 2>/dev/null; then
    ip netns del ferroce-probe-$$
    cannot_run "no tap devices here: /dev/net/tun"
  fi
  ip netns del ferroce-probe-$$
  need=()
  for c in qemu-system-x86_64:qemu-system-x86 debootstrap:debootstrap tcpdump:tcpdump \
           mke2fs:e2fsprogs python3:python3 gcc:gcc; do
    command -v "${c%%:*}" >/dev/null || need+=("${c#*:}")
  done
  [ -f /usr/include/infiniband/verbs.h ] || need+=(libibverbs-dev)
  if [ ${#need[@]} -gt 0 ]; then
    echo "== interop: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; } >/dev/null ||
      { echo "interop: could not install ${need[*]}" >&2; exit 1; }
  fi
  # An image from before libfabric-bin, iperf3 and /etc/hosts were in the guest is brought up to date.
  if [ ! -f "$WORK/rootfs.img" ] || [ ! -f "$WORK/boot/vmlinuz" ] || [ ! -x "$WORK/rootfs/usr/bin/fi_pingpong" ] || [ ! -x "$WORK/rootfs/usr/bin/iperf3" ] || [ ! -f "$WORK/rootfs/etc/hosts" ]; then
    echo "== interop: building the rxe guest image into $WORK (once per machine)"
    "$HERE/build-rootfs.sh" > "$WORK.build.log" 2>&1 || { tail -20 "$WORK.build.log"; exit 1; }
  fi
  (cd "$ROOT" && cargo build --release -q -p ferroce-cli && cargo build --release -q -p ferroce --example rdma_imm &&
     scripts/build-libibverbs.sh >/dev/null) || exit 1
  exec "$HERE/in-netns.sh" "$0" --inside
fi

# ---- inside the namespace -------------------------------------------------------------------
. "$HERE/common.sh"
OUT=$(mktemp -d /tmp/ferroce-interop.XXXXXX)
export CAPDIR=$OUT
F=$FERROCE
IMM=$(dirname "$FERROCE")/examples/rdma_imm
G=$VM0_IP
H=$HOST_IP
t_start=$(date +%s.%N)
pass=0; failed=()

cleanup() {
  [ -n "${CAP_PID:-}" ] && kill -INT "$CAP_PID" 2>/dev/null
  stop_vms >/dev/null 2>&1
  "$HERE/net-setup.sh" down >/dev/null 2>&1
  if [ -n "${KEEP_OUT:-}" ]; then echo "interop: captures and logs kept in $OUT"; else rm -rf "$OUT"; fi
}
trap cleanup EXIT

boot_vms || exit 1

counters_rxe() { gexec 0 'cd /sys/class/infiniband/rxe0/ports/1/hw_counters && for f in *; do echo "$f $(cat $f)"; done'; }
start_capture "$OUT/live.pcap" "udp port 4791 or tcp port 18515"
counters_rxe > "$OUT/rxe_before.txt"

# check NAME COMMAND...: runs a check, records it. A check that fails is run once more and
# reported as passing on its second try: the kernel rxe of these guests sometimes stops sending
# in the middle of a message for good (seen once in ~60 runs of a 64 KiB ibv_rc_pingpong: rxe's
# SEND stopped after 60 of its 64 packets, every one of them acknowledged by ferroce, and nothing
# more left the guest), which no peer can recover from. Both tries' logs are kept. The summary
# counts these second tries; more than MAX_SECOND_TRIES fail the run, since a stall that rare
# does not explain them (a flaky ferroce would).
retried=()
check() {
  local name=$1; shift
  # LIVE_ONLY=REGEX runs only the checks it matches (a development aid; the count then is
  # what ran).
  if [ -n "${LIVE_ONLY:-}" ] && ! [[ $name =~ $LIVE_ONLY ]]; then return 0; fi
  if "$@" > "$OUT/$name.log" 2>&1; then
    echo "ok    $name"; pass=$((pass+1))
  elif mv "$OUT/$name.log" "$OUT/$name.first-try.log" && "$@" > "$OUT/$name.log" 2>&1; then
    echo "ok    $name (on its second try; the first:)"
    grep -v '^   [a-z_]* *[0-9]*$' "$OUT/$name.first-try.log" | sed 's/^/      /' | tail -6
    pass=$((pass+1)); retried+=("$name")
  else
    echo "FAIL  $name"; grep -v '^   [a-z_]* *[0-9]*$' "$OUT/$name.log" | sed 's/^/      /' | tail -25
    failed+=("$name")
  fi
}
# counter FILE NAME: a counter's value in ferroce's --counters output.
counter() { awk -v c="$2" '$1==c{print $2; exit}' "$1"; }
# wait_listen: until something listens on TCP 18515 in the namespace (at most 10 s).
# wait_listen [PORT]: the same for another port (ferroce's librdmacm listens on TCP too).
wait_listen() { local i=0; while ! ss -ltn | grep -q ":${1:-18515} " && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; }

# The guest runs one submitted command at a time, so a tool left waiting for a peer that failed
# would hold up every test after it: a server tool runs in the background of its command, and a
# failed test kills what it left in the guest.
# gstart TAG TOOLCMD: starts the tool in the guest; its output goes to out/TAG.log, its exit
# status to out/TAG.rc. gfinish TAG [SECONDS]: waits for it (killing it when ferroce failed).
gstart() {
  rm -f "$RUN/vm0/out/$1.rc"
  gexec 0 "(timeout 120 $2 > /share/out/$1.log 2>&1; echo \$? > /share/out/$1.rc.tmp; mv /share/out/$1.rc.tmp /share/out/$1.rc) &" 10 >/dev/null
}
gfinish() {
  local i=0 limit=$((${2:-150} * 5))
  while [ ! -f "$RUN/vm0/out/$1.rc" ]; do
    sleep 0.2; i=$((i+1))
    [ $i -gt $limit ] && { gexec 0 "pkill -f 'ib_|ibv_rc_pingpong|ibv_uc_pingpong|ibv_ud_pingpong|rdma_imm|fi_pingpong|rstream|riostream|rcopy|iperf3'; true" 10 >/dev/null; sleep 1; break; }
  done
  cat "$RUN/vm0/out/$1.rc" 2>/dev/null || echo 124
}
# guest_server TAG TOOLCMD / ferroce client ARGS...: the real tool serves in the guest, ferroce
# connects; both must succeed. The ferroce output lands in $OUT/$TAG.out, the tool's in .rxe.
guest_server() {
  local tag=$1 tool=$2; shift 2
  gstart "$tag" "$tool"
  # Unmodified tools on the host connect once and give up: the drop-in checks wait for the
  # guest's listener first (ferroce's own tools retry on their own).
  [ -n "${WAIT_GUEST_LISTEN:-}" ] &&
    gexec 0 "i=0; while ! ss -ltn | grep -q ':${GUEST_LISTEN_PORT:-18515} '; do i=\$((i+1)); [ \$i -gt 60 ] && break; sleep 0.25; done" 30 >/dev/null
  # An rdma_cm listener in the guest is the kernel's: it shows in `rdma res`, not in ss.
  [ -n "${WAIT_GUEST_CM:-}" ] &&
    gexec 0 "i=0; while ! rdma res show cm_id | grep -q LISTEN; do i=\$((i+1)); [ \$i -gt 60 ] && break; sleep 0.25; done" 30 >/dev/null
  timeout 150 "$@" > "$OUT/$tag.out" 2>&1; local rc=$?
  # A ferroce that failed leaves the tool waiting for it: give the tool a moment, not minutes.
  local rs; if [ $rc -eq 0 ]; then rs=$(gfinish "$tag" 150); else rs=$(gfinish "$tag" 3); fi
  cp "$RUN/vm0/out/$tag.log" "$OUT/$tag.rxe" 2>/dev/null
  # ferroce's part last: a failure's tail then shows its own message and exit status.
  echo "--- rxe (exit $rs): $tool"; cat "$OUT/$tag.rxe"; echo "--- ferroce (exit $rc): $*"; cat "$OUT/$tag.out"
  [ $rc -eq 0 ] && [ "$rs" -eq 0 ]
}
# guest_client TAG TOOLCMD / ferroce server ARGS...: ferroce serves, the real tool connects.
guest_client() {
  local tag=$1 tool=$2; shift 2
  timeout 150 "$@" > "$OUT/$tag.out" 2>&1 &
  local p=$!
  wait_listen "${LISTEN_PORT:-18515}"
  gexec 0 "timeout 120 $tool" 150 > "$OUT/$tag.rxe"; local rc=$?
  # A tool that failed leaves ferroce waiting for it: a moment, not minutes.
  if [ $rc -ne 0 ]; then sleep 3; kill $p 2>/dev/null; fi
  wait $p; local rs=$?
  echo "--- rxe (exit $rc): $tool"; cat "$OUT/$tag.rxe"; echo "--- ferroce (exit $rs): $*"; cat "$OUT/$tag.out"
  [ $rc -eq 0 ] && [ $rs -eq 0 ]
}

# ---- 1. SEND/RECV with ibv_rc_pingpong ----------------------------------------------------------
pp_client() {
  local size=$1 iters=$2 extra=${3:-} tag=pp_c_$1${3:-}
  guest_server "$tag" "ibv_rc_pingpong -g 1 -s $size -n $iters -c $extra" \
    "$F" pingpong $G -s "$size" -n "$iters" --verify --counters $extra &&
    grep -q "^$((size * iters * 2)) bytes in" "$OUT/$tag.out" &&
    grep -q "^$((size * iters * 2)) bytes in" "$OUT/$tag.rxe" && ! grep -q "invalid data" "$OUT/$tag.rxe"
}
pp_server() {
  local size=$1 iters=$2 extra=${3:-} tag=pp_s_$1${3:-}
  guest_client "$tag" "ibv_rc_pingpong -g 1 -s $size -n $iters -c $extra $H" \
    "$F" pingpong -s "$size" -n "$iters" -c --counters $extra &&
    grep -q "^$((size * iters * 2)) bytes in" "$OUT/$tag.out" &&
    grep -q "^$((size * iters * 2)) bytes in" "$OUT/$tag.rxe"
}
for size in 64 4096 65536; do
  iters=200; [ "$size" -ge 65536 ] && iters=50
  check "rc_pingpong_${size}_ferroce_client" pp_client $size $iters
  check "rc_pingpong_${size}_ferroce_server" pp_server $size $iters
done
check "rc_pingpong_4096_events_ferroce_client" pp_client 4096 100 -e
check "rc_pingpong_4096_events_ferroce_server" pp_server 4096 100 -e

# ---- 2. perftest ------------------------------------------------------------------------------
# pt_client/pt_server TEST OPTS: perftest's result line must appear on both sides.
result_line() { grep -qE "^ *$1 +[0-9]+ " "$2"; }
pt_client() {
  local t=$1 opts=$2 tag=pt_c_$1${3:-}
  guest_server "$tag" "ib_$t -x 1 -F $opts" "$F" perf "$t" --perftest $G $opts --counters &&
    result_line "$4" "$OUT/$tag.out" &&
    # perftest's READ and atomic latency servers print no result, only their clients do.
    { [[ $t == read_lat || $t == atomic_lat ]] || result_line "$4" "$OUT/$tag.rxe"; }
}
pt_server() {
  local t=$1 opts=$2 tag=pt_s_$1${3:-}
  guest_client "$tag" "ib_$t -x 1 -F $opts $H" "$F" perf "$t" --perftest --bind $H $opts --counters &&
    result_line "$4" "$OUT/$tag.rxe"
}
# Bandwidth at -t 8: ferroce has no congestion control (nor has rxe), and a guest under TCG
# takes packets ~100 times slower than ferroce sends them; 128 messages of 64 KiB in flight
# overflow the tap and virtio queues on the way in (seen: rxe NAKed a gap in a SEND stream).
for spec in "write_lat|-s 8 -n 500|8" "write_bw|-s 65536 -n 200 -t 8|65536" "read_lat|-s 64 -n 300|64" \
            "read_bw|-s 65536 -n 200|65536" "send_lat|-s 64 -n 300|64" "send_bw|-s 65536 -n 200 -t 8|65536" \
            "atomic_lat|-n 300|8" "atomic_bw|-n 300 -A CMP_AND_SWAP|8"; do
  IFS='|' read -r t opts bytes <<< "$spec"
  check "perftest_${t}_ferroce_client" pt_client "$t" "$opts" "" "$bytes"
  check "perftest_${t}_ferroce_server" pt_server "$t" "$opts" "" "$bytes"
done

# ---- 3. SEND and WRITE with immediate ---------------------------------------------------------
imm_client() {
  guest_server "imm_c$1" "rdma_imm -g 1 $1" "$IMM" $G || return 1
  local f=$OUT/imm_c$1.rxe line
  # Each receive with its opcode (128 RECV, 129 RECV_RDMA_WITH_IMM), length and immediate.
  for line in "opcode 128 len 64 imm_data 0x11223344" "opcode 128 len 4096 imm_data 0x55667788" \
              "opcode 129 len 64 imm_data 0x99aabbcc" "opcode 129 len 4096 imm_data 0xddeeff00"; do
    grep -q "recv: wc $line" "$f" || { echo "missing: $line"; return 1; }
  done
  grep -q "^ok" "$f" && grep -q "\[8192\]=0x40 \[12288+4095\]=0x7f" "$f"
}
imm_server() {
  guest_client "imm_s$1" "rdma_imm -g 1 $H" "$IMM" $1 --bind $H &&
    grep -q "^ok" "$OUT/imm_s$1.out" && grep -q "^ok" "$OUT/imm_s$1.rxe"
}
check "imm_send_write_ferroce_client" imm_client ""
check "imm_send_write_ferroce_server" imm_server ""

counters_rxe > "$OUT/rxe_clean.txt"

# ---- 3b. Unmodified rdma-core tools on the host, over ferroce's libibverbs.so.1 ---------------
# Debian's own ibv_rc_pingpong and perftest binaries on the host load ferroce's drop-in library
# (scripts/build-libibverbs.sh) and meet the same binaries on the guest's kernel rxe. They run
# after the loss-free counter snapshot: their bursts are perftest's own, and a TCG guest under
# a loaded host sometimes drops a few (rxe then counts duplicates, which that part forbids).
DROPIN="env LD_LIBRARY_PATH=$ROOT/target/ibverbs FERROCE_PCAP="
DEV=ferroce_$BR
dropin_pp_client() {
  local WAIT_GUEST_LISTEN=1
  local size=$1 iters=$2 extra=${3:-} tag=dpp_c_$1${3:-}
  guest_server "$tag" "ibv_rc_pingpong -g 1 -s $size -n $iters -c $extra" \
    $DROPIN ibv_rc_pingpong -d $DEV -g 0 -s "$size" -n "$iters" -c $extra $G &&
    grep -q "^$((size * iters * 2)) bytes in" "$OUT/$tag.out" &&
    grep -q "^$((size * iters * 2)) bytes in" "$OUT/$tag.rxe"
}
dropin_pp_server() {
  local size=$1 iters=$2 extra=${3:-} tag=dpp_s_$1${3:-}
  guest_client "$tag" "ibv_rc_pingpong -g 1 -s $size -n $iters -c $extra $H" \
    $DROPIN ibv_rc_pingpong -d $DEV -g 0 -s "$size" -n "$iters" -c $extra &&
    grep -q "^$((size * iters * 2)) bytes in" "$OUT/$tag.out" &&
    grep -q "^$((size * iters * 2)) bytes in" "$OUT/$tag.rxe"
}
# UD: rdma-core's ibv_ud_pingpong, datagrams through address handles each way.
dropin_ud_client() {
  local WAIT_GUEST_LISTEN=1
  local tag=dud_c
  guest_server "$tag" "ibv_ud_pingpong -g 1 -s 1024 -n 200" \
    $DROPIN ibv_ud_pingpong -d $DEV -g 0 -s 1024 -n 200 $G &&
    grep -q "^200 iters in" "$OUT/$tag.out" && grep -q "^200 iters in" "$OUT/$tag.rxe"
}
dropin_ud_server() {
  local tag=dud_s
  guest_client "$tag" "ibv_ud_pingpong -g 1 -s 1024 -n 200 $H" \
    $DROPIN ibv_ud_pingpong -d $DEV -g 0 -s 1024 -n 200 &&
    grep -q "^200 iters in" "$OUT/$tag.out" && grep -q "^200 iters in" "$OUT/$tag.rxe"
}
# UC: rdma-core's ibv_uc_pingpong (-c checks the bytes): SEND without ACKs each way. One
# message is in flight at a time, so nothing is lost on this path and every one must arrive.
dropin_uc_client() {
  local WAIT_GUEST_LISTEN=1
  local tag=duc_c
  guest_server "$tag" "ibv_uc_pingpong -g 1 -s 4096 -n 200 -c" \
    $DROPIN ibv_uc_pingpong -d $DEV -g 0 -s 4096 -n 200 -c $G &&
    grep -q "^$((4096 * 200 * 2)) bytes in" "$OUT/$tag.out" && grep -q "^$((4096 * 200 * 2)) bytes in" "$OUT/$tag.rxe"
}
dropin_uc_server() {
  local tag=duc_s
  guest_client "$tag" "ibv_uc_pingpong -g 1 -s 4096 -n 200 -c $H" \
    $DROPIN ibv_uc_pingpong -d $DEV -g 0 -s 4096 -n 200 -c &&
    grep -q "^$((4096 * 200 * 2)) bytes in" "$OUT/$tag.out" && grep -q "^$((4096 * 200 * 2)) bytes in" "$OUT/$tag.rxe"
}
dropin_pt_client() {
  local WAIT_GUEST_LISTEN=1
  local t=$1 opts=$2 tag=dpt_c_$1
  guest_server "$tag" "ib_$t -x 1 -F $opts" $DROPIN ib_$t -d $DEV -x 0 -F $opts $G &&
    result_line "$3" "$OUT/$tag.out"
}
dropin_pt_server() {
  local t=$1 opts=$2 tag=dpt_s_$1
  guest_client "$tag" "ib_$t -x 1 -F $opts $H" $DROPIN ib_$t -d $DEV -x 0 -F $opts &&
    result_line "$3" "$OUT/$tag.rxe"
}
if [ -x "$(command -v ibv_rc_pingpong)" ] && [ -f "$ROOT/target/ibverbs/libibverbs.so.1" ]; then
  check "dropin_rc_pingpong_4096_host_client" dropin_pp_client 4096 200
  check "dropin_rc_pingpong_65536_host_server" dropin_pp_server 65536 50
  check "dropin_rc_pingpong_4096_events_host_server" dropin_pp_server 4096 100 -e
  check "dropin_ud_pingpong_host_client" dropin_ud_client
  check "dropin_ud_pingpong_host_server" dropin_ud_server
  check "dropin_uc_pingpong_host_client" dropin_uc_client
  check "dropin_uc_pingpong_host_server" dropin_uc_server
  # Bandwidth at -t 2: at -t 8 and -t 4 perftest's posts left 450 and 256 packets in one burst,
  # past what the TCG guest's tap and virtio queues hold (rxe ACKed up to the gap and ferroce
  # recovered by timeout and go-back-N: correct, but rxe counts duplicates where this part
  # wants none). ferroce has no congestion control; the CLI's own -t 8 run above passes.
  for spec in "write_lat|-s 8 -n 300|8" "write_bw|-s 65536 -n 200 -t 2|65536" "read_lat|-s 64 -n 300|64" \
              "send_bw|-s 65536 -n 200 -t 2|65536" "atomic_lat|-n 300|8" "send_lat|-c UD -s 1024 -n 300|1024" \
              "write_lat|-c UC -s 8 -n 300|8|_uc"; do
    IFS='|' read -r t opts bytes suffix <<< "$spec"
    check "dropin_perftest_${t}${suffix}_host_client" dropin_pt_client "$t" "$opts" "$bytes"
    check "dropin_perftest_${t}${suffix}_host_server" dropin_pt_server "$t" "$opts" "$bytes"
  done
else
  echo "FAIL  dropin: ibv_rc_pingpong (ibverbs-utils) or target/ibverbs/libibverbs.so.1 is missing"
  failed+=("dropin_missing")
fi

# ---- 3b'. libfabric over verbs: fi_pingpong ---------------------------------------------------
# Debian's libfabric 1.17 fi_pingpong with its verbs provider: on the host over ferroce's drop-in
# libibverbs and librdmacm, in the guest over rxe and the kernel's rdma_cm. MSG endpoints are
# rdma_cm connections with RC QPs; RDM endpoints are libfabric's rxm over them. 64 KiB messages,
# each checked (-c); both sides print the row. rxm sizes its CQ for 256 peers by default, past
# rxe's largest CQ (fi_enable fails with EINVAL between two rxe guests too): FI_UNIVERSE_SIZE=64
# on both sides.
fi_rows() { grep -qE '^64k +100 +=100 ' "$1"; }
FI_ENV="env FI_UNIVERSE_SIZE=64"
fi_client() {
  local WAIT_GUEST_LISTEN=1 GUEST_LISTEN_PORT=47592
  local ep=$1 tag=fi_c_$1
  guest_server "$tag" "$FI_ENV fi_pingpong -p verbs -e $ep -S 65536 -I 100 -c" \
    $DROPIN FI_UNIVERSE_SIZE=64 fi_pingpong -p verbs -e "$ep" -S 65536 -I 100 -c $G &&
    fi_rows "$OUT/$tag.out" && fi_rows "$OUT/$tag.rxe"
}
fi_server() {
  local LISTEN_PORT=47592
  local ep=$1 tag=fi_s_$1
  guest_client "$tag" "$FI_ENV fi_pingpong -p verbs -e $ep -S 65536 -I 100 -c $H" \
    $DROPIN FI_UNIVERSE_SIZE=64 fi_pingpong -p verbs -e "$ep" -S 65536 -I 100 -c &&
    fi_rows "$OUT/$tag.out" && fi_rows "$OUT/$tag.rxe"
}
for ep in msg rdm; do
  check "libfabric_fi_pingpong_${ep}_host_client" fi_client $ep
  check "libfabric_fi_pingpong_${ep}_host_server" fi_server $ep
done

# ---- 3c. rdma_cm on the wire: the guest's kernel rdma_cm and ferroce's librdmacm -------------
# Debian's rdmacm-utils and perftest -R on the host over ferroce's librdmacm.so.1 connect with
# the same tools on the guest's kernel through IB CM MADs on QP1 (REQ, REP, RTU, DREQ, DREP),
# in both roles; the data moves on the QPs they connected. The capture's CM messages are
# counted at the end (tshark's decoder names them).
CM="$DROPIN FERROCE_RDMA_CM=auto"
# cm_client TAG GUESTCMD HOSTCMD...: the kernel serves, ferroce connects.
cm_client() { local WAIT_GUEST_CM=1; guest_server "$@"; }
# cm_server TAG PORT GUESTCMD HOSTCMD...: ferroce serves, the kernel connects.
cm_server() { local tag=$1 LISTEN_PORT=$2; shift 2; guest_client "$tag" "$@"; }
# rping validates every ping (-V): a byte wrong fails it.
check "rdmacm_rping_host_client" cm_client cm_rping_c "rping -s -a $G -C 20 -S 2000 -V" \
  $CM rping -c -a $G -C 20 -S 2000 -V
check "rdmacm_rping_host_server" cm_server cm_rping_s 7174 "rping -c -a $H -C 20 -S 2000 -V" \
  $CM rping -s -a $H -C 20 -S 2000 -V
check "rdmacm_ucmatose_host_client" cm_client cm_uc_c "ucmatose -b $G -c 2 -C 20" \
  $CM ucmatose -s $G -c 2 -C 20
check "rdmacm_ucmatose_host_server" cm_server cm_uc_s 7471 "ucmatose -s $H -c 2 -C 20" \
  $CM ucmatose -b $H -c 2 -C 20
check "rdmacm_rdma_server_rdma_client_host_client" cm_client cm_rsc_c "rdma_server -s $G" \
  $CM rdma_client -s $G
check "rdmacm_rdma_server_rdma_client_host_server" cm_server cm_rsc_s 7471 "rdma_client -s $H" \
  $CM rdma_server -s $H
# udaddy: UD QPs resolved by SIDR (SIDR_REQ, SIDR_REP), then datagrams each way.
udaddy_ok() { grep -q "return status 0" "$OUT/$1.out" && grep -q "return status 0" "$OUT/$1.rxe"; }
check "rdmacm_udaddy_sidr_host_client" eval 'cm_client cm_ud_c "udaddy -b $G" $CM udaddy -s $G && udaddy_ok cm_ud_c'
check "rdmacm_udaddy_sidr_host_server" eval 'cm_server cm_ud_s 7174 "udaddy -s $H" $CM udaddy -b $H && udaddy_ok cm_ud_s'
# perftest -R: after its own TCP exchange the server makes its rdma_cm listener while the
# client already sends its REQ; a guest under TCG loses that race often, and the kernel rejects
# the REQ (no listener: status 8). Debian's perftest 4.5 then retries on ids it has freed and
# dies of SIGSEGV (fixed upstream later). So the host-client pair runs again, at most five
# times, on that failure alone (the client's REJECTED with error 8); any other failure fails.
dropin_cm_pt() {
  local role=$1 t=$2 opts=$3 tag=cm_pt_$1_$2 run
  if [ "$role" = client ]; then
    for run in 1 2 3 4 5; do
      WAIT_GUEST_LISTEN=1 guest_server "$tag" "ib_$t -R -x 1 -F $opts" $CM ib_$t -R -d $DEV -x 0 -F $opts $G &&
        result_line "$4" "$OUT/$tag.out" && return 0
      grep -q "RDMA_CM_EVENT_REJECTED; error: 8" "$OUT/$tag.out" || return 1
      echo "(perftest's listener race, run $run: again)"
    done
    return 1
  else
    cm_server "$tag" 18515 "ib_$t -R -x 1 -F $opts $H" $CM ib_$t -R -d $DEV -x 0 -F $opts && result_line "$4" "$OUT/$tag.rxe"
  fi
}
# ib_write_lat -R runs with ferroce serving only: as client its second REQ came 10 to 30 ms
# after the first connection, before the guest's perftest listened again, in 3 of 3 runs of
# 3 tries (the capture shows the REJ), and Debian's perftest cannot retry (above).
check "rdmacm_perftest_send_bw_host_client" dropin_cm_pt client send_bw "-s 65536 -n 200 -t 2" 65536
check "rdmacm_perftest_send_bw_host_server" dropin_cm_pt server send_bw "-s 65536 -n 200 -t 2" 65536
check "rdmacm_perftest_write_lat_host_server" dropin_cm_pt server write_lat "-s 8 -n 300" 8

# ---- 3d. rsockets over the wire CM: rstream, riostream, rcopy ----------------------------------
# librdmacm's rsockets in the guest (rdma-core's, over rxe) and ferroce's on the host speak one
# protocol: rs_conn_data in the CM private data, data by RDMA WRITE with immediate into the
# peer's ring, credits by WRITEs into its target SGL, direct writes into riomap'ed buffers.
# Data checked (-T v), 64 KiB transfers; rcopy's file compared by checksum on the other side.
rs_rows() { grep -qE '^custom +64k +' "$OUT/$1.out" && grep -qE '^custom +64k +' "$OUT/$1.rxe"; }
rs_check() {
  local tool=$1 role=$2 tag=rs_$1_$2 opts="-S 65536 -C 100 -I 1 -T v -p 7471"
  if [ "$role" = client ]; then
    cm_client "$tag" "$tool -b $G $opts" $CM $tool -s $G $opts && rs_rows "$tag"
  else
    cm_server "$tag" 7471 "$tool -s $H $opts" $CM $tool -b $H $opts && rs_rows "$tag"
  fi
}
for tool in rstream riostream; do
  check "rsocket_${tool}_host_client" rs_check $tool client
  check "rsocket_${tool}_host_server" rs_check $tool server
done
# rcopy: 4 MiB of random bytes each way, compared by SHA-256 on the receiving side.
rcopy_to_guest() {
  head -c 4194304 /dev/urandom > "$OUT/rcopy.src"
  cp "$OUT/rcopy.src" "$RUN/vm0/out/rcopy.src"
  gstart rc_c "rcopy -p 7471"
  gexec 0 "i=0; while ! rdma res show cm_id | grep -q LISTEN; do i=\$((i+1)); [ \$i -gt 60 ] && break; sleep 0.25; done" 30 >/dev/null
  timeout 120 $CM rcopy "$OUT/rcopy.src" "$G:/tmp/rcopy.dst" -p 7471 > "$OUT/rc_c.out" 2>&1; local rc=$?
  gexec 0 "pkill -f 'rcopy -p 7471'; true" 10 >/dev/null
  local want got; want=$(sha256sum < "$OUT/rcopy.src" | cut -d' ' -f1)
  got=$(gexec 0 "sha256sum < /tmp/rcopy.dst" 30 | cut -d' ' -f1)
  echo "--- ferroce (exit $rc):"; cat "$OUT/rc_c.out"; echo "sent $want, guest has $got"
  [ $rc -eq 0 ] && [ "$want" = "$got" ]
}
rcopy_from_guest() {
  gexec 0 "head -c 4194304 /dev/urandom > /tmp/rcopy.src" 30 >/dev/null
  local want; want=$(gexec 0 "sha256sum < /tmp/rcopy.src" 30 | cut -d' ' -f1)
  rm -f "$OUT/rcopy.dst"
  # The server serves forever: it is stopped here, and must be (a ferroce process left running
  # holds host slot 0, port 4791, which the guests' kernels send to).
  timeout 120 $CM rcopy -p 7471 > "$OUT/rc_s.out" 2>&1 &
  local p=$!
  wait_listen 7471
  gexec 0 "timeout 120 rcopy /tmp/rcopy.src $H:$OUT/rcopy.dst -p 7471" 150 > "$OUT/rc_s.rxe"; local rc=$?
  sleep 1; kill $p 2>/dev/null; wait $p 2>/dev/null; pkill -f 'rcopy -p 7471'; true
  local got; got=$(sha256sum < "$OUT/rcopy.dst" 2>/dev/null | cut -d' ' -f1)
  echo "--- rxe (exit $rc):"; cat "$OUT/rc_s.rxe"; echo "--- ferroce:"; cat "$OUT/rc_s.out"; echo "guest sent $want, host has $got"
  [ $rc -eq 0 ] && [ -n "$want" ] && [ "$want" = "$got" ]
}
check "rsocket_rcopy_host_client" rcopy_to_guest
check "rsocket_rcopy_host_server" rcopy_from_guest
# iperf3, unmodified, over rsockets through rdma-core's librspreload.so on both sides (the
# guest's rsockets over rxe, the host's over ferroce), ferroce serving: 2 s of stream from the
# guest and 2 s into it (-R). The other role is left out: rdma-core 44's rsockets cannot serve
# iperf3 3.12 (between two rxe guests, rdma-core on both sides, the stream stalls after its first
# second, either way, and never finishes), so a guest server is no peer to check against.
# librspreload.so falls back to the kernel's TCP where an rsocket cannot be made, so the guest's
# rxe must have carried the stream: at least one RoCE packet per 4 KiB (the largest path MTU) of
# what iperf3 says arrived, counted the way it went.
RSPRELOAD=/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so
rxe_count() { gexec 0 "cat /sys/class/infiniband/rxe0/ports/1/hw_counters/$1" 10 | tr -dc 0-9; }
iperf_received_mb() {
  awk '/receiver$/ { for (i = 2; i <= NF; i++) {
    if ($i == "KBytes") print $(i-1) * 1024 / 1e6; if ($i == "MBytes") print $(i-1) * 1048576 / 1e6
    if ($i == "GBytes") print $(i-1) * 1073741824 / 1e6 } }' "$1" | tail -1
}
rs_iperf3() {
  local dir=$1 tag=rs_iperf3_$1 counter=sent_pkts opt="" before after mb
  [ "$dir" = into_guest ] && { counter=rcvd_pkts; opt=-R; }
  before=$(rxe_count $counter)
  cm_server "$tag" 7471 "env LD_PRELOAD=$RSPRELOAD iperf3 -c $H -p 7471 -t 2 -f m $opt" \
    $CM LD_PRELOAD=$RSPRELOAD iperf3 -s -1 -p 7471 || return 1
  after=$(rxe_count $counter); mb=$(iperf_received_mb "$OUT/$tag.rxe")
  echo "iperf3 says $mb MB arrived; the guest's rxe counted $((after - before)) $counter"
  [ -n "$mb" ] && [ -n "$before" ] && [ -n "$after" ] &&
    awk -v mb="$mb" -v pkts=$((after - before)) 'BEGIN { exit !(mb > 1 && pkts >= mb * 1000000 / 4096) }'
}
check "rsocket_iperf3_librspreload_host_server_from_guest" rs_iperf3 from_guest
check "rsocket_iperf3_librspreload_host_server_into_guest" rs_iperf3 into_guest

# Lost CM messages, recovered by the CM's retries: nftables on the host drops the first REQ
# and RTU ferroce sends and the first REP it receives (UD SENDs to QP1: BTH opcode 0x64, QPN
# 1, the MAD's attribute ID 36 bytes into the UDP payload), then the first REP it sends.
cm_drop_rule() { echo "udp dport 4791 @th,64,8 0x64 @th,104,24 1 @th,352,16 $1 numgen inc mod 1000000 0 counter drop"; }
cm_loss() {
  local role=$1; shift
  nft -f - <<NFT || return 1
table inet cmloss {
  chain out { type filter hook output priority 0; $(for a in "$@"; do [[ $a == out:* ]] && cm_drop_rule "${a#out:}"; done | sed 's/$/;/' | tr -d '\n') }
  chain in { type filter hook input priority 0; $(for a in "$@"; do [[ $a == in:* ]] && cm_drop_rule "${a#in:}"; done | sed 's/$/;/' | tr -d '\n') }
}
NFT
  local rc t0=$(date +%s.%N)
  if [ "$role" = client ]; then
    cm_client cm_loss_c "rping -s -a $G -C 5 -V" $CM rping -c -a $G -C 5 -V; rc=$?
  else
    cm_server cm_loss_s 7174 "rping -c -a $H -C 5 -V" $CM rping -s -a $H -C 5 -V; rc=$?
  fi
  echo "connected and done in $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
  local table drops; table=$(nft list table inet cmloss); nft delete table inet cmloss
  echo "$table" | grep counter
  drops=$(echo "$table" | grep -c "counter packets 1 ")
  [ $rc -eq 0 ] && [ "$drops" -eq $# ]
}
check "rdmacm_lost_req_rep_rtu_host_client" cm_loss client out:0x0010 in:0x0013 out:0x0014
check "rdmacm_lost_rep_host_server" cm_loss server out:0x0013

# ---- 3e. NVMe over Fabrics: the guest's kernel host against ferroce's target, ferroce's host
# against the kernel's target (nvmet-rdma in the other guest) ------------------------------------
NQN_F=nqn.2026-11.io.ferroce:live
NQN_K=nqn.2026-11.io.ferroce:kernel
# nvdev NQN (in a guest): the block device of the namespace 1 of the subsystem NQN connects to.
NVDEV='nvdev() { local b; for b in /sys/block/nvme*n1; do case ${b##*/} in *c*) continue ;; esac; [ "$(cat $b/device/subsysnqn 2>/dev/null)" = "$1" ] && { echo /dev/${b##*/}; return; }; done; }'
# nvmf_target_start FILE: ferroce's target on the host, serving FILE; nvmf_target_stop: SIGINT,
# and every queue it opened must be closed.
nvmf_target_start() {
  "$F" nvmf-target --nqn $NQN_F --listen $H --port 4420 "$1" > "$OUT/nvmf_target.log" 2>&1 &
  NVMF_TP=$!; wait_listen 4420
}
nvmf_target_stop() {
  kill -INT "$NVMF_TP" 2>/dev/null
  local i=0; while kill -0 "$NVMF_TP" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
  kill -0 "$NVMF_TP" 2>/dev/null && { echo "nvmf-target did not end on SIGINT"; kill -9 "$NVMF_TP"; }
  wait "$NVMF_TP"; local rc=$?
  cat "$OUT/nvmf_target.log"
  local line; line=$(grep "queues opened" "$OUT/nvmf_target.log")
  [ $rc -eq 0 ] && [ -n "$line" ] &&
    awk '{for (i=1;i<NF;i++) { if ($i=="opened") o=$(i+1); if ($i=="closed") c=$(i+1) }} END { exit !(o > 0 && o == c+0) }' <<< "${line//,/ }"
}
# The guest connects (after `nvme discover` lists the subsystem), fio writes and verifies
# (random 4 KiB, then sequential 1 MiB; crc32c), a known 4 MiB goes to 56 MiB, and it
# disconnects; the host then reads those bytes from the backing file.
nvmf_guest_fio() {
  local img=$OUT/nvmf.img sizes=${1:-full}
  rm -f "$img"; truncate -s 64M "$img"
  nvmf_target_start "$img"
  local fio_seq="fio --name=seq --filename=\$d --rw=write --bs=1M --offset=16M --size=32M --direct=1 --ioengine=libaio --iodepth=4 --verify=crc32c --do_verify=1"
  local fio_rand="fio --name=rand --filename=\$d --rw=randwrite --bs=4k --size=16M --direct=1 --ioengine=libaio --iodepth=8 --verify=crc32c --do_verify=1"
  # Under loss every SEND whose ACK is lost, when nothing follows it, waits for the kernel
  # host's retransmission timer (about 2 s: rdma_cm's packet life time for RoCE), so the lossy
  # run moves less.
  [ "$sizes" = small ] && { fio_rand=${fio_rand/--size=16M/--size=64K}; fio_seq=${fio_seq/--size=32M/--size=2M}; }
  gexec 0 "$NVDEV
modprobe nvme-rdma || exit 1
nvme disconnect -n $NQN_F > /dev/null 2>&1
nvme discover -t rdma -a $H -s 4420 | tee /tmp/disc | grep -q 'subnqn: *$NQN_F' || { cat /tmp/disc; exit 1; }
nvme connect -t rdma -a $H -s 4420 -n $NQN_F || exit 1
# Under loss the namespace's block device comes only after Identify and friends, each of
# which may wait out the host's 2 s retransmission timer: up to 60 s.
i=0; while [ -z \"\$(nvdev $NQN_F)\" ] && [ \$i -lt 300 ]; do sleep 0.2; i=\$((i+1)); done
d=\$(nvdev $NQN_F); echo \"device \$d\"
rc=0; [ -n \"\$d\" ] || { ls -l /sys/block; nvme disconnect -n $NQN_F; exit 1; }
$fio_rand > /tmp/fio_rand.log 2>&1 || rc=1; grep -E 'err=|IOPS=|verify' /tmp/fio_rand.log | head -6
$fio_seq > /tmp/fio_seq.log 2>&1 || rc=1; grep -E 'err=|IOPS=|verify' /tmp/fio_seq.log | head -6
head -c 4194304 /dev/urandom > /tmp/pat && dd if=/tmp/pat of=\$d bs=1M seek=56 oflag=direct status=none || rc=1
sha256sum < /tmp/pat | cut -d' ' -f1 > /share/out/nvmf_pat.sha
nvme disconnect -n $NQN_F | grep -q 'disconnected 1' || rc=1
exit \$rc" 600 || { nvmf_target_stop; return 1; }
  nvmf_target_stop || return 1
  local want got
  want=$(cat "$RUN/vm0/out/nvmf_pat.sha"); got=$(dd if="$img" bs=1M skip=56 count=4 status=none | sha256sum | cut -d' ' -f1)
  echo "the guest wrote $want at 56 MiB; the host's backing file holds $got"
  [ -n "$want" ] && [ "$want" = "$got" ]
}
check "nvmf_kernel_host_discover_connect_fio_verify_ferroce_target" nvmf_guest_fio
# A kernel host that vanishes: it connects asking for a 5 s keep-alive timeout, writes, then
# drops off the network (nftables on this side drops everything between it and the target,
# both ways: not even its transport answers). The target must end its controller and queues
# for silence, and say so; the guest then comes back and disconnects, and every queue opened
# is closed. (A blackhole route in the guest did not silence it: rxe kept sending.)
nvmf_kernel_host_vanishes() {
  local img=$OUT/nvmf_ka.img
  rm -f "$img"; truncate -s 16M "$img"
  nvmf_target_start "$img"
  # The kernel host's own recovery waits for its unanswered Keep Alive to time out as an
  # admin command (60 s by default) before it lets the controller go: 10 s here.
  gexec 0 "$NVDEV
modprobe nvme-rdma || exit 1
nvme disconnect -n $NQN_F > /dev/null 2>&1
echo 10 > /sys/module/nvme_core/parameters/admin_timeout || exit 1
nvme connect -t rdma -a $H -s 4420 -n $NQN_F --keep-alive-tmo=5 || exit 1
i=0; while [ -z \"\$(nvdev $NQN_F)\" ] && [ \$i -lt 300 ]; do sleep 0.2; i=\$((i+1)); done
d=\$(nvdev $NQN_F); [ -n \"\$d\" ] || exit 1
dd if=/dev/urandom of=\$d bs=4k count=16 oflag=direct status=none" 120 || { nvmf_target_stop; return 1; }
  nft delete table inet ferroce_vanish 2>/dev/null
  nft -f - <<< "table inet ferroce_vanish {
 chain in { type filter hook input priority 0; policy accept; ip saddr $G ip daddr $H drop; }
 chain out { type filter hook output priority 0; policy accept; ip saddr $H ip daddr $G drop; }
}" || { nvmf_target_stop; return 1; }
  echo "the host vanished"
  local t0=$SECONDS seen=0
  while [ $((SECONDS - t0)) -lt 40 ]; do
    grep -q "keep-alive timeout" "$OUT/nvmf_target.log" && { seen=1; break; }
    sleep 0.2
  done
  echo "the target ended the silent host's controller: $seen, after $((SECONDS - t0)) s"
  nft delete table inet ferroce_vanish
  gexec 0 "nvme disconnect -n $NQN_F; echo 60 > /sys/module/nvme_core/parameters/admin_timeout" 60
  nvmf_target_stop || return 1
  [ $seen = 1 ]
}
check "nvmf_kernel_host_vanishes_keep_alive_timeout_ends_its_queues" nvmf_kernel_host_vanishes
# nvmet-rdma in vm1 over a RAM disk (brd), configured through configfs, once.
NVMET_UP="modprobe brd rd_nr=1 rd_size=65536 && modprobe nvmet-rdma || exit 1
mountpoint -q /sys/kernel/config || mount -t configfs none /sys/kernel/config
cd /sys/kernel/config/nvmet || exit 1
[ -L ports/1/subsystems/$NQN_K ] && exit 0
mkdir -p subsystems/$NQN_K && echo 1 > subsystems/$NQN_K/attr_allow_any_host &&
mkdir -p subsystems/$NQN_K/namespaces/1 && echo -n /dev/ram0 > subsystems/$NQN_K/namespaces/1/device_path &&
echo 1 > subsystems/$NQN_K/namespaces/1/enable && mkdir -p ports/1 && echo rdma > ports/1/addr_trtype &&
echo ipv4 > ports/1/addr_adrfam && echo $VM1_IP > ports/1/addr_traddr && echo 4420 > ports/1/addr_trsvcid &&
ln -s /sys/kernel/config/nvmet/subsystems/$NQN_K ports/1/subsystems/$NQN_K"
nvmf_perf_kernel_target() {
  gexec 1 "$NVMET_UP" 60 || return 1
  "$F" nvmf-perf --cm ib --target $VM1_IP --nqn $NQN_K --rw randrw --bs 4k --qd 8 --time 2 --size 16M --verify || return 1
  "$F" nvmf-perf --cm ib --target $VM1_IP --nqn $NQN_K --rw read --bs 1M --qd 2 --time 2 --size 32M --verify
}
check "nvmf_ferroce_host_perf_verify_kernel_nvmet_rdma_target" nvmf_perf_kernel_target

# ---- 4. RNR NAK, each way ----------------------------------------------------------------------
# The server posts its receives 300 ms late: the first SEND draws an RNR NAK and is retried.
rnr_client() { imm_client -r && [ "$(counter "$OUT/imm_c-r.out" rcvd_rnr_err)" -ge 1 ]; }
rnr_server() { imm_server -r && [ "$(counter "$OUT/imm_s-r.out" send_rnr_err)" -ge 1 ]; }
check "rnr_nak_from_rxe_ferroce_retries" rnr_client
check "rnr_nak_from_ferroce_rxe_retries" rnr_server

# ---- 5. 5% loss both ways, inside the guest -----------------------------------------------------
NETEM_ON='modprobe -q sch_netem; modprobe -q ifb numifbs=1; modprobe -q act_mirred; modprobe -q cls_matchall
ip link set ifb0 up
tc qdisc replace dev eth0 root netem loss 5%
tc qdisc add dev eth0 handle ffff: ingress
tc filter add dev eth0 parent ffff: matchall action mirred egress redirect dev ifb0
tc qdisc replace dev ifb0 root netem loss 5%
tc qdisc show dev eth0; tc qdisc show dev ifb0'
NETEM_OFF='tc -s qdisc show dev eth0 | head -3; tc -s qdisc show dev ifb0 | head -3
tc qdisc del dev eth0 root; tc qdisc del dev eth0 ingress; tc qdisc del dev ifb0 root'
gexec 0 "$NETEM_ON" > "$OUT/netem_on.log" 2>&1 || { echo "FAIL  netem: $(cat "$OUT/netem_on.log")"; failed+=(netem); }
# lossy TEST OPTS BYTES ROLE COUNTER...: completes despite the loss, and ferroce's recovery
# counters (summed) show the recovery crossed the wire.
lossy() {
  local t=$1 opts=$2 bytes=$3 role=$4; shift 4
  "pt_$role" "$t" "$opts" _loss "$bytes" || return 1
  local f=$OUT/pt_${role:0:1}_${t}_loss.out sum=0 c
  local v
  for c in "$@"; do v=$(counter "$f" "$c"); sum=$((sum + ${v:-0})); done
  echo "recovery counters ($*): $sum"
  [ "$sum" -gt 0 ]
}
check "loss5_write_bw_ferroce_client_go_back_n" lossy write_bw "-s 16384 -n 100" 16384 client retransmits
check "loss5_write_bw_ferroce_server_naks" lossy write_bw "-s 16384 -n 100" 16384 server send_seq_nak duplicate_request out_of_seq_request
check "loss5_read_bw_ferroce_client_read_retry" lossy read_bw "-s 16384 -n 100" 16384 client retransmits
check "loss5_read_bw_ferroce_server_reserves" lossy read_bw "-s 16384 -n 100" 16384 server duplicate_request
check "loss5_atomic_lat_ferroce_client_retries" lossy atomic_lat "-n 300" 8 client retransmits
check "loss5_atomic_lat_ferroce_server_replays" lossy atomic_lat "-n 300" 8 server duplicate_request
check "loss5_nvmf_kernel_host_fio_verify_ferroce_target" nvmf_guest_fio small
gexec 0 "$NETEM_OFF" > "$OUT/netem_off.log" 2>&1

stop_capture "$OUT/live.pcap" 2>/dev/null; CAP_PID=
counters_rxe > "$OUT/rxe_after.txt"

# ---- 6. the wire and the counters -----------------------------------------------------------------
icrc_all() {
  local summary n
  summary=$("$F" decode "$OUT/live.pcap" | tail -1) || return 1
  echo "$summary"
  n=${summary%% *}
  # The run puts well over 100,000 RoCE packets on the bridge: an empty capture proves nothing.
  [ "${n:-0}" -ge 10000 ] || { echo "only ${n:-0} RoCE packets captured"; return 1; }
  python3 "$ROOT/scripts/verify_icrc.py" "$OUT/live.pcap"
}
check "capture_every_icrc_verifies" icrc_all

counters_ok() {
  local bad=0 c b a f
  for f in rxe_before rxe_clean rxe_after; do
    grep -q '^rcvd_seq_err [0-9]' "$OUT/$f.txt" || { echo "rxe's counters were not read ($f)"; return 1; }
  done
  join "$OUT/rxe_before.txt" "$OUT/rxe_clean.txt" | while read -r name before after; do
    printf '   rxe %-24s %10s -> %-10s (+%s) over sections 1-3\n' "$name" "$before" "$after" $((after - before))
  done
  # rxe's completer_retry_err (its retransmission timer fired) is left out: rxe 6.1 arms that
  # timer only when none is pending (rxe_req.c, update_state), so a timer armed for an earlier
  # request can fire just after a later one left. Seen in a capture here: rxe's SEND, ferroce's
  # ACK 37 us later, rxe's same SEND again 0.6 ms after the first (its timeout is 67 ms);
  # ferroce acknowledged the repeat as a duplicate. Every other error counter must stay still.
  for c in rcvd_seq_err out_of_seq_request duplicate_request retry_exceeded_err \
           retry_rnr_exceeded_err send_err rcvd_rnr_err send_rnr_err; do
    b=$(awk -v c=$c '$1==c{print $2}' "$OUT/rxe_before.txt"); a=$(awk -v c=$c '$1==c{print $2}' "$OUT/rxe_clean.txt")
    [ "${b:-0}" = "${a:-0}" ] || { echo "rxe $c moved without loss: $b -> $a"; bad=1; }
  done
  join "$OUT/rxe_clean.txt" "$OUT/rxe_after.txt" | while read -r name before after; do
    printf '   rxe %-24s %10s -> %-10s (+%s) over drop-in, RNR and loss\n' "$name" "$before" "$after" $((after - before))
  done
  local errs solved
  errs=$(cat "$OUT"/*.out | awk '$1=="icrc_errors"{s+=$2} END{print s+0}')
  solved=$(cat "$OUT"/*.out | awk '$1=="icrc_ident_solved"{s+=$2} END{print s+0}')
  echo "ferroce: icrc_errors $errs, icrc_ident_solved $solved (summed over every run)"
  [ "$errs" -eq 0 ] && [ "$solved" -gt 0 ] && [ $bad -eq 0 ]
}
check "counters_rxe_errors_unchanged_ferroce_no_icrc_error" counters_ok

# ---- 7. figures: ferroce<->rxe beside rxe<->rxe, same run ---------------------------------------
if [ -z "${LIVE_ONLY:-}" ]; then
lat_of() { awk -v b="$1" '$1==b && NF>=5 {print $5; exit}' "$2"; }
bw_of() { awk -v b="$1" '$1==b && NF>=4 {print $4; exit}' "$2"; }
n=$(gsubmit 0 "timeout 150 ib_write_lat -x 1 -F -s 8 -n 1000"); sleep 0.5
gexec 1 "timeout 150 ib_write_lat -x 1 -F -s 8 -n 1000 $G" 180 > "$OUT/fig_rxe_lat.txt"; gwait 0 "$n" 30
n=$(gsubmit 0 "timeout 150 ib_write_bw -x 1 -F -s 65536 -n 1000"); sleep 0.5
gexec 1 "timeout 150 ib_write_bw -x 1 -F -s 65536 -n 1000 $G" 180 > "$OUT/fig_rxe_bw.txt"; gwait 0 "$n" 30
guest_server fig_fer_lat "ib_write_lat -x 1 -F -s 8 -n 1000" "$F" perf write_lat --perftest $G -s 8 -n 1000 > /dev/null
guest_server fig_fer_bw "ib_write_bw -x 1 -F -s 65536 -n 1000" "$F" perf write_bw --perftest $G -s 65536 -n 1000 > /dev/null
rl=$(lat_of 8 "$OUT/fig_rxe_lat.txt"); fl=$(lat_of 8 "$OUT/fig_fer_lat.out")
rb=$(bw_of 65536 "$OUT/fig_rxe_bw.txt"); fb=$(bw_of 65536 "$OUT/fig_fer_bw.out")
python3 - "$rl" "$fl" "$rb" "$fb" <<'PY'
import sys
def f(x):
    try: return float(x)
    except ValueError: return None
rl, fl, rb, fb = map(f, sys.argv[1:])
print("figures (guests under TCG; ratios are the figure):")
if rl and fl: print(f"  8 B WRITE latency, typical: rxe<->rxe {rl:.2f} us, ferroce<->rxe {fl:.2f} us, ratio {fl/rl:.2f}")
if rb and fb: print(f"  64 KiB WRITE bandwidth:     rxe<->rxe {rb:.2f} MB/s, ferroce<->rxe {fb:.2f} MB/s, ratio {fb/rb:.2f}")
PY
fi

secs=$(python3 -c "print(round($(date +%s.%N) - $t_start, 1))")
expected=86
[ -n "${LIVE_ONLY:-}" ] && expected=$((pass + ${#failed[@]}))
summarize "$expected" "$secs"
