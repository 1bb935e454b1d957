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
#   sudo scripts/bench_coll.sh            # root: network namespaces; Open MPI installed
set -euo pipefail
cd "$(dirname "$0")/.."
MTU=${MTU:-9000}
cargo build --release -q -p ferroce-cli -p shm-baseline
F=$PWD/target/release/ferroce
tmp=$(mktemp -d)
A=fcoll-$$-a
B=fcoll-$$-b
cleanup() { ip netns del "$A" 2>/dev/null || true; ip netns del "$B" 2>/dev/null || true; rm -rf "$tmp"; }
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
  RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.213.0.1 MASTER_PORT=$port \
    ip netns exec "$A" "$F" all_reduce_perf "$@"
  wait
}
local_ferroce() { "$F" all_reduce_perf --ranks "$NP" "$@"; }

echo "== memcpy (64 MiB, one thread)"
target/release/shm-baseline memcpy --size 67108864 --iters 20 | tee "$tmp/memcpy"

for NP in 2 4; do
  echo "== $NP ranks, one host: ferroce (shared memory)"
  ferroce_sweep local_ferroce | tee "$tmp/ferroce-$NP"
  echo "== $NP ranks, one host: Open MPI (vader)"
  "${MPIRUN[@]}" --mca oob_tcp_if_include lo --mca btl self,vader -np "$NP" \
    "$tmp/mpi_allreduce" | tee "$tmp/mpi-$NP"
done

ip netns add "$A"
ip netns add "$B"
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip link add veth0 netns "$A" mtu "$MTU" type veth peer name veth0 netns "$B" mtu "$MTU"
ip -n "$A" addr add 10.213.0.1 peer 10.213.0.2 dev veth0
ip -n "$B" addr add 10.213.0.2 peer 10.213.0.1 dev veth0
for ns in "$A" "$B"; do ip -n "$ns" link set veth0 up; done
echo "== 2 ranks, two hosts (veth, MTU $MTU): ferroce (RoCE v2/UDP)"
ferroce_sweep two_hosts_ferroce | tee "$tmp/ferroce-hosts"
echo "== 2 ranks, two hosts (veth, MTU $MTU): Open MPI (TCP)"
# Open MPI's launcher talks to its ranks over loopback TCP by default, which a rank in another
# namespace cannot reach: mpirun runs in host A and listens on the veth.
PMIX_MCA_ptl_tcp_remote_connections=1 PMIX_MCA_ptl_tcp_if_include=veth0 \
  ip netns exec "$A" "${MPIRUN[@]}" --mca oob_tcp_if_include veth0 --mca btl self,tcp \
  --mca btl_tcp_if_include veth0 -np 1 "$tmp/mpi_allreduce" : \
  -np 1 ip netns exec "$B" "$tmp/mpi_allreduce" | tee "$tmp/mpi-hosts"

python3 - "$tmp" <<'PY'
import sys, os
d = sys.argv[1]
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
memcpy = open(os.path.join(d, 'memcpy')).read().split(':')[1].split()[0]
print(f"\nmemcpy 64 MiB in this run: {memcpy} GB/s")
for case, label in [('2', '2 ranks, one host (ferroce shm / MPI vader)'),
                    ('4', '4 ranks, one host (ferroce shm / MPI vader)'),
                    ('hosts', '2 ranks, two namespace hosts (ferroce UDP / MPI TCP)')]:
    fr, wrong = ferroce(os.path.join(d, f'ferroce-{case}'))
    mp = mpi(os.path.join(d, f'mpi-{case}'))
    print(f"\n{label}; ferroce #wrong over all sizes: {wrong}")
    print(f"{'':>10} {'out of place':^53} {'in place':^30}")
    print(f"{'bytes':>10} {'ferroce us':>11} {'MPI us':>9} {'MPI/ferroce':>11} "
          f"{'ferroce busbw':>14} {'MPI busbw':>10} {'ratio':>6} "
          f"{'ferroce busbw':>14} {'MPI busbw':>10} {'ratio':>6}")
    def r(a, b):
        return f"{a / b:6.2f}" if b > 0 else "     -"
    for size in sorted(set(fr) & set(mp)):
        ft, fb, fi = fr[size]
        mt, mb, mi = mp[size]
        print(f"{size:>10} {ft:>11.2f} {mt:>9.2f} {mt / ft:>11.2f} {fb:>14.2f} {mb:>10.2f} {r(fb, mb)} "
              f"{fi:>14.2f} {mi:>10.2f} {r(fi, mi)}")
PY
