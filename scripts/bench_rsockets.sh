#!/usr/bin/env bash
# iperf3 over rsockets (rdma-core's unmodified librspreload.so over ferroce's drop-in librdmacm)
# beside the same iperf3 over the kernel's TCP, in interleaved pairs: on one host (loopback;
# ferroce's shared-memory provider) and between two network-namespace hosts over a veth (UDP,
# the CM on the wire). Prints each pair's goodput and ratio, then the median and range.
#
#   scripts/bench_rsockets.sh [REPS] [SECONDS]      (as root: it makes two namespaces)
#
# Needs iperf3, librdmacm1 (librspreload.so) and the drop-in built (scripts/build-libibverbs.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-5}
secs=${2:-3}
lib=$PWD/target/ibverbs
preload=$(ls /usr/lib/*/rsocket/librspreload.so 2>/dev/null | head -1)
[ -n "$preload" ] || { echo "librspreload.so not found (apt-get install librdmacm1)" >&2; exit 1; }
[ -f "$lib/librdmacm.so.1" ] || { echo "build the drop-in first: scripts/build-libibverbs.sh" >&2; exit 1; }
command -v iperf3 >/dev/null || { echo "iperf3 is not installed" >&2; exit 1; }

A=ferroce-bench-a B=ferroce-bench-b
cleanup() { ip netns del $A 2>/dev/null || true; ip netns del $B 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add $A && ip netns add $B
ip link add fbench-a netns $A type veth peer name fbench-b netns $B
ip -n $A addr add 10.79.0.1/24 dev fbench-a && ip -n $B addr add 10.79.0.2/24 dev fbench-b
for ns in $A $B; do ip -n $ns link set lo up; done
ip -n $A link set fbench-a up && ip -n $B link set fbench-b up

# goodput WHERE MODE: the receiver's Mbit/s of one run (WHERE: lo or ns; MODE: tcp or rsocket).
goodput() {
  local where=$1 mode=$2 port=$((45100 + RANDOM % 400)) dst=127.0.0.1 srv=() cli=() env=()
  [ "$where" = ns ] && { srv=(ip netns exec $A); cli=(ip netns exec $B); dst=10.79.0.1; }
  if [ "$mode" = rsocket ]; then
    env=(env LD_LIBRARY_PATH="$lib" LD_PRELOAD="$preload" FERROCE_PCAP=)
    [ "$where" = ns ] && env+=(FERROCE_RDMA_CM=ib)
  fi
  "${srv[@]}" "${env[@]}" timeout $((secs + 20)) iperf3 -s -1 -p $port >/dev/null 2>&1 &
  local s=$!
  sleep 0.7
  local out
  out=$("${cli[@]}" "${env[@]}" timeout $((secs + 15)) iperf3 -c $dst -p $port -t "$secs" -f m 2>&1 || true)
  wait $s 2>/dev/null || true
  local mbit
  mbit=$(awk '/receiver$/ { for (i = 1; i <= NF; i++) if ($i == "Mbits/sec") print $(i - 1) }' <<< "$out")
  # A run that moved nothing says why (on stderr, beside the table).
  if [ -z "$mbit" ] || [ "$mbit" = "0.00" ]; then
    echo "!! $where $mode: iperf3 reported no goodput:" >&2
    grep -v "^\[ *[0-9]*\] *[0-9]" <<< "$out" | tail -5 | sed 's/^/   /' >&2
  fi
  echo "$mbit"
}

for where in lo ns; do
  ratios=()
  for r in $(seq "$reps"); do
    t=$(goodput $where tcp); s=$(goodput $where rsocket)
    ratio=$(awk -v s="${s:-0}" -v t="${t:-0}" 'BEGIN { printf "%.3f", (t > 0 ? s / t : 0) }')
    ratios+=("$ratio")
    echo "$where pair $r: tcp ${t:-?} Mbit/s, rsockets ${s:-?} Mbit/s, ratio $ratio"
  done
  printf '%s\n' "${ratios[@]}" | sort -g | awk -v w="$where" '
    { v[NR] = $1 } END { printf "%s: rsockets / TCP median %.3f (min %.3f, max %.3f) over %d pairs\n",
      w, (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2), v[1], v[NR], NR }'
done
