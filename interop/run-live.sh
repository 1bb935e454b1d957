#!/usr/bin/env bash
# Live interop: ferroce on the host side of a bridge, Linux Soft-RoCE (rxe) in a QEMU guest, on a
# real (virtual) wire. Everything runs inside the network namespace `in-netns.sh` makes, so no
# packet leaves this machine's own test network (bridge br-rxe 192.168.77.1/24, guest .10).
#
#   interop/run-live.sh              # set-up if needed, then every live test; exit 1 on a failure
#   KEEP_OUT=1 interop/run-live.sh   # keep the captures and logs (printed at the end)
#
# Set-up (root, Debian 12): installs qemu-system-x86, debootstrap and friends, builds the guest
# image once into $WORK (default /var/tmp/ferroce-interop; later runs reuse it), and builds
# ferroce in release mode. Without root, or on a machine whose kernel cannot create network
# namespaces or tap devices, it prints one "skipped" line and exits 0.
#
# What it checks, each with the real tools in the guest as the independent peer:
# - ibv_rc_pingpong <-> ferroce pingpong, ferroce as client and as server, 64 B, 4 KiB and
#   64 KiB messages (1, 4 and 64 packets each at path MTU 1024), data checked both ways (rxe's
#   -c page check; ferroce's --verify checks every echoed byte), and once in events mode (-e);
# - a capture of the whole run on the bridge in which every RoCE packet, ferroce's and rxe's,
#   verifies in `ferroce decode` and in scripts/verify_icrc.py;
# - rxe's hw_counters before and after: its error counters unchanged; ferroce's counters: no
#   ICRC error, rxe's packets (numbered IPv4 Identification) accepted by solving for it.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
export WORK=${WORK:-/var/tmp/ferroce-interop}
export FERROCE=${FERROCE:-$ROOT/target/release/ferroce}

if [ "${1:-}" != --inside ]; then
  if [ "$(id -u)" -ne 0 ]; then echo "interop: skipped (needs root for namespaces and taps)"; exit 0; fi
  if ! ip netns add ferroce-probe-$$ 2>/dev/null; then
    echo "interop: skipped (this kernel cannot create network namespaces)"; exit 0
  fi
  if ! ip -n ferroce-probe-$$ tuntap add dev tap-probe mode tap 2>/dev/null; then
    ip netns del ferroce-probe-$$
    echo "interop: skipped (no tap devices here: /dev/net/tun)"; exit 0
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
  if [ ! -f "$WORK/rootfs.img" ] || [ ! -f "$WORK/boot/vmlinuz" ]; then
    echo "== interop: building the rxe guest image into $WORK (once per machine)"
    "$HERE/build-rootfs.sh" > "$WORK.build.log" 2>&1 || { tail -20 "$WORK.build.log"; exit 1; }
  fi
  (cd "$ROOT" && cargo build --release -q -p ferroce-cli) || exit 1
  exec "$HERE/in-netns.sh" "$0" --inside
fi

# ---- inside the namespace -------------------------------------------------------------------
. "$HERE/common.sh"
OUT=$(mktemp -d /tmp/ferroce-interop.XXXXXX)
export CAPDIR=$OUT
F=$FERROCE
G=192.168.77.10
t_start=$(date +%s.%N)
pass=0; failed=()

cleanup() {
  stop_vms >/dev/null 2>&1
  "$HERE/net-setup.sh" down >/dev/null 2>&1
  if [ -n "${KEEP_OUT:-}" ]; then echo "interop: captures and logs kept in $OUT"; else rm -rf "$OUT"; fi
}
trap cleanup EXIT

"$HERE/net-setup.sh" >/dev/null
"$HERE/vm.sh" 0 $G/24 1500 >/dev/null || exit 1
i=0
while [ ! -f "$RUN/vm0/ready" ]; do
  sleep 0.2; i=$((i+1))
  kill -0 "$(cat "$RUN/vm0.pid")" 2>/dev/null || { echo "interop: the guest died"; cat "$RUN/vm0.qemu.log"; exit 1; }
  [ $i -gt 1500 ] && { echo "interop: the guest did not come up in 300 s"; exit 1; }
done
log "guest up (its uptime at ready: $(cat "$RUN/vm0/ready") s)"

counters_rxe() { gexec 0 'cd /sys/class/infiniband/rxe0/ports/1/hw_counters && for f in *; do echo "$f $(cat $f)"; done'; }
counters_rxe > "$OUT/rxe_before.txt"
start_capture "$OUT/live.pcap" "udp port 4791 or tcp port 18515"

# check NAME COMMAND...: runs a check, records it.
check() {
  local name=$1; shift
  if "$@" > "$OUT/$name.log" 2>&1; then
    echo "ok    $name"; pass=$((pass+1))
  else
    echo "FAIL  $name"; sed 's/^/      /' "$OUT/$name.log" | tail -15; failed+=("$name")
  fi
}

# ferroce is the client, ibv_rc_pingpong on rxe the server.
pp_ferroce_client() {
  local size=$1 iters=$2 extra=${3:-}
  local n; n=$(gsubmit 0 "timeout 120 ibv_rc_pingpong -g 1 -s $size -n $iters -c $extra")
  timeout 150 "$F" pingpong $G -s "$size" -n "$iters" --verify --counters $extra > "$OUT/pp_c_$size$extra.out"
  local rc=$?
  gwait 0 "$n" 150; local rs=$?
  echo "--- ferroce (client):"; cat "$OUT/pp_c_$size$extra.out"
  echo "--- ibv_rc_pingpong (server, rxe):"; cat "$RUN/vm0/out/$n.log"
  [ $rc -eq 0 ] && [ $rs -eq 0 ] &&
    grep -q "^$((size * iters * 2)) bytes in" "$OUT/pp_c_$size$extra.out" &&
    grep -q "^$((size * iters * 2)) bytes in" "$RUN/vm0/out/$n.log" &&
    ! grep -q "invalid data" "$RUN/vm0/out/$n.log"
}

# ibv_rc_pingpong on rxe is the client, ferroce the server.
pp_ferroce_server() {
  local size=$1 iters=$2 extra=${3:-}
  timeout 150 "$F" pingpong -s "$size" -n "$iters" -c --counters $extra > "$OUT/pp_s_$size$extra.out" 2>&1 &
  local p=$!
  i=0; while ! ss -ltn | grep -q ':18515 ' && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
  gexec 0 "timeout 120 ibv_rc_pingpong -g 1 -s $size -n $iters -c $extra 192.168.77.1" 150 > "$OUT/pp_s_$size$extra.rxe"
  local rc=$?
  wait $p; local rs=$?
  echo "--- ibv_rc_pingpong (client, rxe):"; cat "$OUT/pp_s_$size$extra.rxe"
  echo "--- ferroce (server):"; cat "$OUT/pp_s_$size$extra.out"
  [ $rc -eq 0 ] && [ $rs -eq 0 ] &&
    grep -q "^$((size * iters * 2)) bytes in" "$OUT/pp_s_$size$extra.out" &&
    grep -q "^$((size * iters * 2)) bytes in" "$OUT/pp_s_$size$extra.rxe"
}

for size in 64 4096 65536; do
  iters=200; [ "$size" -ge 65536 ] && iters=50
  check "rc_pingpong_${size}_ferroce_client" pp_ferroce_client $size $iters
  check "rc_pingpong_${size}_ferroce_server" pp_ferroce_server $size $iters
done
check "rc_pingpong_4096_events_ferroce_client" pp_ferroce_client 4096 100 -e
check "rc_pingpong_4096_events_ferroce_server" pp_ferroce_server 4096 100 -e

stop_capture "$OUT/live.pcap" 2>/dev/null
counters_rxe > "$OUT/rxe_after.txt"

# Every RoCE packet of the run verifies, for ferroce's decoder and for an independent one.
icrc_all() {
  "$F" decode "$OUT/live.pcap" | tail -1 && python3 "$ROOT/scripts/verify_icrc.py" "$OUT/live.pcap"
}
check "capture_every_icrc_verifies" icrc_all

# rxe's error counters did not move; ferroce counted no ICRC error and solved rxe's IDs.
counters_ok() {
  local bad=0
  join "$OUT/rxe_before.txt" "$OUT/rxe_after.txt" | while read -r name before after; do
    printf '   rxe %-28s %10s -> %-10s (+%s)\n' "$name" "$before" "$after" $((after - before))
  done
  for c in rcvd_seq_err out_of_seq_request duplicate_request retry_exceeded_err \
           retry_rnr_exceeded_err completer_retry_err send_err rcvd_rnr_err send_rnr_err; do
    local b a
    b=$(awk -v c=$c '$1==c{print $2}' "$OUT/rxe_before.txt"); a=$(awk -v c=$c '$1==c{print $2}' "$OUT/rxe_after.txt")
    [ "${b:-0}" = "${a:-0}" ] || { echo "rxe $c moved: $b -> $a"; bad=1; }
  done
  local errs solved
  errs=$(cat "$OUT"/pp_*.out | awk '$1=="icrc_errors"{s+=$2} END{print s+0}')
  solved=$(cat "$OUT"/pp_*.out | awk '$1=="icrc_ident_solved"{s+=$2} END{print s+0}')
  echo "ferroce: icrc_errors $errs, icrc_ident_solved $solved (over every run)"
  [ "$errs" -eq 0 ] && [ "$solved" -gt 0 ] && [ $bad -eq 0 ]
}
check "counters_rxe_errors_unchanged_ferroce_no_icrc_error" counters_ok

secs=$(python3 -c "print(round($(date +%s.%N) - $t_start, 1))")
echo "interop: ${#failed[@]} failed, $pass passed in $secs s (guest under TCG)"
[ ${#failed[@]} -eq 0 ]
