#!/usr/bin/env bash
# ferroce's allreduce beside Open MPI's, float32 sum from 8 B to 64 MiB, in the same run:
#   - 2 and 4 ranks on this host: `ferroce all_reduce_perf --ranks N` (shared memory) against
#     `mpirun -np N` over Open MPI's shared-memory transport (vader);
#   - 2 ranks on two hosts made of network namespaces joined by a veth pair (MTU 9000, as RoCE
#     fabrics run; MTU=1500 to change it): ferroce over RoCE v2/UDP against Open MPI over TCP;
#   - memcpy of 64 MiB on this machine (shm-baseline), the bound of same-host collectives.
# Both sides time the operation the same way: out of place, the maximum over ranks
# (all_reduce_perf -a 3; bench/mpi_allreduce.c), busbw = algbw * 2(n-1)/n, GB/s = 1e9 B/s.
# Out of place and in place (MPI_IN_PLACE) are compared separately. Every ferroce result is
# checked element by element (#wrong must be 0), and MPI's by bench/mpi_allreduce.c.
# The cases run interleaved, REPS times (default 5): each repetition runs ferroce and Open MPI
# for every case back to back, so a ratio is taken between runs made next to each other, and
# the tables print the median ratio with its range (min..max over repetitions). At the top:
# the core count and memcpy speed of this machine; per repetition, the floors of the same run:
# memcpy of 64 MiB, one TCP stream over the veth (iperf3, the cross-host case's bound), two TCP
# streams over it at once, one each way (separate iperf3 processes): what TCP carries each way
# while both directions are busy, as in a 2-rank allreduce, where each rank sends and receives
# busbw bytes per second at once; and a raw UDP stream on loopback (udp-baseline, GSO).
#   sudo scripts/bench_coll.sh            # root: network namespaces; Open MPI installed
#   sudo REPS=3 CASES="2 hosts" scripts/bench_coll.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MTU=${MTU:-9000}
REPS=${REPS:-5}
CASES=${CASES:-"2 4 hosts"}
cargo build --release -q -p ferroce-cli -p shm-baseline -p udp-baseline
F=$PWD/target/release/ferroce
tmp=$(mktemp -d)
A=fcoll-$$-a
B=fcoll-$$-b
cleanup() {
  # shellcheck disable=SC2086 # two PIDs
  [ -n "${IPERF_PID:-}" ] && kill $IPERF_PID 2>/dev/null || true
  ip netns del "$A" 2>/dev/null || true; ip netns del "$B" 2>/dev/null || true; rm -rf "$tmp"
}
trap cleanup EXIT
mpicc.openmpi -O2 -o "$tmp/mpi_allreduce" bench/mpi_allreduce.c
MPIRUN=(mpirun.openmpi --allow-run-as-root --oversubscribe --bind-to none --mca plm isolated
        --mca pml ob1)

# ferroce's two runs (many iterations for the latency-bound sizes, fewer for the large ones).
ferroce_sweep() { # LAUNCH...: a command that runs all_reduce_perf with the arguments that follow
  "$@" -b 8 -e 64K -f 2 -n 1000 -w 50 -a 3 -c 1
  "$@" -b 128K -e 64M -f 2 -n 20 -w 3 -a 3 -c 1
}
two_hosts_ferroce() { # ARGS...: rank 0 in A, rank 1 in B
  local port=$((29000 + RANDOM % 1000))
  RANK=1 WORLD_SIZE=2 MASTER_ADDR=10.213.0.1 MASTER_PORT=$port \
    ip netns exec "$B" "$F" all_reduce_perf "$@" >/dev/null &
  local rank1=$!
  RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.213.0.1 MASTER_PORT=$port \
    ip netns exec "$A" "$F" all_reduce_perf "$@"
  wait "$rank1" # not the iperf3 server's
}
local_ferroce() { "$F" all_reduce_perf --ranks "$NP" "$@"; }
mpi_local() {
  "${MPIRUN[@]}" --mca oob_tcp_if_include lo --mca btl self,vader -np "$NP" "$tmp/mpi_allreduce"
}
mpi_hosts() {
  # Open MPI's launcher talks to its ranks over loopback TCP by default, which a rank in another
  # namespace cannot reach: mpirun runs in host A and listens on the veth.
  PMIX_MCA_ptl_tcp_remote_connections=1 PMIX_MCA_ptl_tcp_if_include=veth0 \
    ip netns exec "$A" "${MPIRUN[@]}" --mca oob_tcp_if_include veth0 --mca btl self,tcp \
    --mca btl_tcp_if_include veth0 -np 1 "$tmp/mpi_allreduce" : \
    -np 1 ip netns exec "$B" "$tmp/mpi_allreduce"
}

memcpy() { target/release/shm-baseline memcpy --size 67108864 --iters 20 | sed -n 's/.*: *\([0-9.]*\) GB\/s.*/\1/p' | head -1; }
echo "# $(nproc) CPUs, $(uname -r), $(date -u +%FT%TZ); memcpy 64 MiB: $(memcpy) GB/s; REPS=$REPS, cases: $CASES"

ip netns add "$A"
ip netns add "$B"
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip link add veth0 netns "$A" mtu "$MTU" type veth peer name veth0 netns "$B" mtu "$MTU"
ip -n "$A" addr add 10.213.0.1 peer 10.213.0.2 dev veth0
ip -n "$B" addr add 10.213.0.2 peer 10.213.0.1 dev veth0
for ns in "$A" "$B"; do ip -n "$ns" link set veth0 up; done
ip netns exec "$A" iperf3 -s -B 10.213.0.1 -p 5299 >/dev/null 2>&1 &
IPERF_PID=$!
ip netns exec "$B" iperf3 -s -B 10.213.0.2 -p 5300 >/dev/null 2>&1 &
IPERF_PID="$IPERF_PID $!"
sleep 0.5

for r in $(seq "$REPS"); do
  echo "== repetition $r of $REPS"
  memcpy > "$tmp/memcpy-$r"
  ip netns exec "$B" iperf3 -c 10.213.0.1 -p 5299 -t 3 -J > "$tmp/iperf-$r" 2>&1 || true
  ip netns exec "$B" iperf3 -c 10.213.0.1 -p 5299 -t 3 -J > "$tmp/iperf-ba-$r" 2>&1 &
  ip netns exec "$A" iperf3 -c 10.213.0.2 -p 5300 -t 3 -J > "$tmp/iperf-ab-$r" 2>&1 || true
  wait $! || true
  target/release/udp-baseline stream --size 4096 --bytes $((1 << 30)) --mode gso --json \
    > "$tmp/udp-$r" 2>&1 || true
  for c in $CASES; do
    if [ "$c" = hosts ]; then
      ferroce_sweep two_hosts_ferroce > "$tmp/ferroce-hosts-$r"
      mpi_hosts > "$tmp/mpi-hosts-$r"
    else
      NP=$c
      ferroce_sweep local_ferroce > "$tmp/ferroce-$c-$r"
      mpi_local > "$tmp/mpi-$c-$r"
    fi
  done
done

python3 - "$tmp" "$REPS" "$CASES" <<'PY'
import json, os, statistics, sys
d, reps, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
def ferroce(path):
    rows, wrong = {}, 0
    for line in open(path):
        f = line.split()
        if line.startswith('#') or len(f) != 13:
            continue
        rows[int(f[0])] = (float(f[5]), float(f[7]), float(f[11]))
        wrong += int(f[8]) + int(f[12])
    return rows, wrong
def mpi(path):
    return {int(f[1]): (float(f[2]), float(f[3]), float(f[5])) for f in (l.split() for l in open(path)) if f and f[0] == 'RESULT'}
def med(v):
    return f"{statistics.median(v):.2f} ({min(v):.2f}..{max(v):.2f})"
def floats(name, get):
    out = []
    for r in range(1, reps + 1):
        try:
            out.append(get(open(os.path.join(d, f"{name}-{r}")).read()))
        except Exception:
            pass
    return out
mc = floats("memcpy", lambda t: float(t.strip()))
tcp = floats("iperf", lambda t: json.loads(t)["end"]["sum_received"]["bits_per_second"] / 8e9)
def both_ways(r):
    got = [json.load(open(os.path.join(d, f"iperf-{w}-{r}")))["end"]["sum_received"]["bits_per_second"] / 8e9
           for w in ("ab", "ba")]
    return sum(got) / 2
tcp2 = []
for r in range(1, reps + 1):
    try:
        tcp2.append(both_ways(r))
    except Exception:
        pass
udp = floats("udp", lambda t: json.loads(t.strip().splitlines()[-1])["gb_s"])
print(f"\nfloors of this run, GB/s, median (range) over {reps}: memcpy 64 MiB {med(mc) if mc else '-'}; "
      f"one TCP stream over the veth (iperf3) {med(tcp) if tcp else '-'}; "
      f"two at once, one each way, mean of the two {med(tcp2) if tcp2 else '-'}; raw UDP on loopback (GSO) {med(udp) if udp else '-'}")
labels = {'2': '2 ranks, one host (ferroce shm / MPI vader)',
          '4': '4 ranks, one host (ferroce shm / MPI vader)',
          'hosts': '2 ranks, two namespace hosts (ferroce UDP / MPI TCP)'}
for case in cases:
    runs = [(ferroce(os.path.join(d, f'ferroce-{case}-{r}')), mpi(os.path.join(d, f'mpi-{case}-{r}')))
            for r in range(1, reps + 1)]
    wrong = sum(w for (_, w), _ in runs)
    print(f"\n{labels[case]}; ferroce #wrong over all sizes and repetitions: {wrong}")
    print("medians over repetitions, ratios as median (min..max) of the per-repetition ratios")
    print(f"{'bytes':>10} {'ferroce us':>10} {'MPI us':>9} {'MPI/ferroce time':>20} "
          f"{'busbw oop':>10} {'MPI':>6} {'ferroce/MPI out of place':>26} "
          f"{'busbw ip':>9} {'MPI':>6} {'ferroce/MPI in place':>24}")
    sizes = sorted(set.intersection(*[set(fr) & set(mp) for (fr, _), mp in runs]))
    for size in sizes:
        ft = [fr[size][0] for (fr, _), _ in runs]; mt = [mp[size][0] for _, mp in runs]
        fb = [fr[size][1] for (fr, _), _ in runs]; mb = [mp[size][1] for _, mp in runs]
        fi = [fr[size][2] for (fr, _), _ in runs]; mi = [mp[size][2] for _, mp in runs]
        tr = [m / f for f, m in zip(ft, mt)]
        br = [f / m for f, m in zip(fb, mb) if m > 0]
        ir = [f / m for f, m in zip(fi, mi) if m > 0]
        print(f"{size:>10} {statistics.median(ft):>10.2f} {statistics.median(mt):>9.2f} {med(tr):>20} "
              f"{statistics.median(fb):>10.3f} {statistics.median(mb):>6.3f} {med(br) if br else '-':>26} "
              f"{statistics.median(fi):>9.3f} {statistics.median(mi):>6.3f} {med(ir) if ir else '-':>24}")
    if case == 'hosts' and tcp:
        big = [fr[max(sizes)][1] for (fr, _), _ in runs]
        share = [b / t for b, t in zip(big, tcp)]
        print(f"ferroce busbw at {max(sizes)} B against one TCP stream over the same veth: {med(share)}")
        if tcp2:
            both = [b / t for b, t in zip(big, tcp2)]
            mpi_big = [mp[max(sizes)][1] for _, mp in runs]
            mpi_both = [b / t for b, t in zip(mpi_big, tcp2)]
            print(f"against TCP's each-way rate with both directions busy: ferroce {med(both)}, "
                  f"Open MPI {med(mpi_both)}")
PY
