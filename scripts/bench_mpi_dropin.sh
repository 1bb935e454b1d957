#!/usr/bin/env bash
# Open MPI over UCX over ferroce's drop-in libibverbs, beside Open MPI's own transports, in the
# same run: the anchors' mpi_bench.c (8 B ping-pong latency, 1 MiB ping-pong bandwidth, and
# MPI_Allreduce float32 SUM at 4 KiB .. 64 MiB) with 2 ranks on this host.
#   scripts/bench_mpi_dropin.sh          # as root (UCX needs /dev/infiniband/uverbsN)
# Rows: ferroce/shm (ranks on one host reach each other through ferroce's shared memory),
# ferroce/udp (FERROCE_PROVIDER=udp: RoCE v2 over loopback), Open MPI vader (shared memory) and
# Open MPI tcp (loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build-libibverbs.sh >/dev/null
mkdir -p /dev/infiniband
for i in 0 1 2 3; do [ -e /dev/infiniband/uverbs$i ] || ln -s /dev/null /dev/infiniband/uverbs$i; done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mpicc.openmpi -O2 -o "$tmp/mpi_bench" ../shared/anchors/bench/mpi_bench.c
MPIRUN=(mpirun.openmpi --allow-run-as-root --oversubscribe --bind-to none --mca plm isolated
        --mca oob_tcp_if_include lo -np 2)
FERROCE=(--mca pml ucx --mca pml_ucx_devices any -x LD_LIBRARY_PATH="$PWD/target/ibverbs"
         -x UCX_TLS=rc_verbs,ud_verbs,self -x UCX_NET_DEVICES=ferroce_lo:1 -x FERROCE_PCAP=)
run() { # NAME MPI-ARGS...
  local name=$1; shift
  for mode in pingpong allreduce; do
    "${MPIRUN[@]}" "$@" "$tmp/mpi_bench" $mode | sed -n "s|^RESULT |$name |p"
  done
}
{
  run ferroce/shm "${FERROCE[@]}" -x FERROCE_PROVIDER=auto
  run ferroce/udp "${FERROCE[@]}" -x FERROCE_PROVIDER=udp
  run ompi/vader --mca pml ob1 --mca btl self,vader
  run ompi/tcp --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include lo
} | tee "$tmp/all"
python3 - "$tmp/all" <<'PY'
import sys, collections
rows = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    who, name, value, unit = line.split()
    rows[name + " (" + unit + ")"][who] = float(value)
cols = ["ferroce/shm", "ferroce/udp", "ompi/vader", "ompi/tcp"]
print(f"\n{'figure':<38}" + "".join(f"{c:>14}" for c in cols))
for name, v in rows.items():
    if "algbw" in name:
        continue
    print(f"{name:<38}" + "".join(f"{v.get(c, float('nan')):>14.3f}" for c in cols))
PY
