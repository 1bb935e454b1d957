#!/bin/bash
# The checks of the torch backend that need the GPU machine (the `device` tool), in one run:
#   python/device/run.sh [mixed] [allreduce] [train]   # from the repository root, with the
#                                                      # built wheel in .whl/ (default: all)
# 1. the mixed device string "cpu:ferroce,cuda:nccl" (mixed_backends.py), over shared memory,
#    then over UDP; 2. all_reduce busbw through torch, ferroce beside gloo; 3. training steps/s,
#    ferroce beside gloo, 2 and 4 ranks. Logs go to $OUT (or /tmp/device-out). Exits non-zero
#    if any section failed. The sections' timeouts (and the build, ~35 s there) add up to under
#    10 minutes, one call's limit.
set -u -o pipefail
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ferroce-ext
# NCCL between the ranks on its socket transport over loopback (see mixed_backends.py).
export NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo
export PATH="$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
{
  echo "cores: $(nproc)"; uname -r
  python3 -c 'import torch, sysconfig, os; inc = sysconfig.get_paths()["include"]; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-"); print("Python.h", os.path.exists(os.path.join(inc, "Python.h")), inc)'
  command -v c++ ninja
} 2>&1 | tee "$OUT/env.log"
section() { echo; echo "=== $1 ($(date +%T))"; }
want() { [[ " $WANT " == *" $1 "* ]]; }
WANT="${*:-mixed allreduce train}"
rc=0
{
  section "build the C++ backend"
  time python3 -c 'import ferroce.torch; print("built:", ferroce.torch.ProcessGroupFerroce)'
} 2>&1 | tee "$OUT/build.log" || exit 1
if want mixed; then
  {
    section "cpu:ferroce,cuda:nccl (provider auto: shared memory)"
    timeout 120 python3 python/device/mixed_backends.py --timeout 100; r=$?
    section "cpu:ferroce,cuda:nccl (FERROCE_PROVIDER=udp)"
    FERROCE_PROVIDER=udp timeout 120 python3 python/device/mixed_backends.py --timeout 100
    exit $((r | $?))
  } 2>&1 | tee "$OUT/mixed.log" || rc=1
fi
if want allreduce; then
  {
    section "all_reduce busbw through torch, 2 ranks"
    timeout 80 python3 python/bench/torch_allreduce.py --reps 3 1 16 64
  } 2>&1 | tee "$OUT/allreduce.log" || rc=1
fi
if want train; then
  {
    section "training, 2 ranks, 6 threads each"
    timeout 140 python3 python/bench/torch_train.py --setups 2 --modes ddp fsdp \
      --reps "${TRAIN_REPS2:-2}" --threads 6 --timeout 60; r=$?
    section "training, 4 ranks, 3 threads each"
    timeout 100 python3 python/bench/torch_train.py --setups 4 --modes ddp fsdp \
      --reps "${TRAIN_REPS4:-1}" --threads 3 --timeout 60
    exit $((r | $?))
  } 2>&1 | tee "$OUT/train.log" || rc=1
fi
section "done (exit $rc)"
exit $rc
