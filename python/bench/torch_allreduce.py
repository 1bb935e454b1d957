"""torch.distributed all_reduce of float32 through the "ferroce" and "gloo" backends, in the same
run, 2 ranks on this host (processes), nccl-tests' bus bandwidth (algbw * 2(n-1)/n, 1e9 B/s):

    python3 python/bench/torch_allreduce.py [--reps 5] [MiB ...]    # default: 1 16 64

Each size: 3 warm-up calls, then the time of 10 calls, the slower rank's; both backends' results
are checked against the expected sums first. Each repetition runs ferroce and then gloo; the
table gives the median and range over repetitions of each busbw and of their ratio."""

import multiprocessing as mp
import os
import socket
import statistics
import sys
import time


def rank_main(rank, size, port, backend, sizes, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import ferroce.torch  # noqa: F401

    dist.init_process_group(backend, rank=rank, world_size=size)
    out = []
    for mib in sizes:
        n = mib * (1 << 20) // 4
        x = torch.full((n,), float(rank + 1))
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((n,), float(sum(range(1, size + 1))))), backend
        for _ in range(3):
            dist.all_reduce(x)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(10):
            dist.all_reduce(x)
        took = torch.tensor([(time.perf_counter() - t) / 10], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        out.append((mib, took.item()))
    dist.destroy_process_group()
    results.put((rank, out))


def run(backend, sizes, size=2):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=rank_main, args=(r, size, port, backend, sizes, results))
             for r in range(size)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    return got[0]


def spread(xs):
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}..{max(xs):.2f})"


if __name__ == "__main__":
    args = sys.argv[1:]
    reps = 5
    if "--reps" in args:
        i = args.index("--reps")
        reps = int(args[i + 1])
        del args[i:i + 2]
    sizes = [int(a) for a in args] or [1, 16, 64]
    size = 2
    # Repetitions interleave the backends, so each ratio is taken between neighbouring runs.
    ratios = {m: [] for m in sizes}
    bus = {(b, m): [] for b in ("ferroce", "gloo") for m in sizes}
    for rep in range(reps):
        rows = {b: run(b, sizes, size) for b in ("ferroce", "gloo")}
        for (mib, tf), (_, tg) in zip(rows["ferroce"], rows["gloo"]):
            bf = mib * (1 << 20) / tf / 1e9 * 2 * (size - 1) / size
            bg = mib * (1 << 20) / tg / 1e9 * 2 * (size - 1) / size
            bus[("ferroce", mib)].append(bf)
            bus[("gloo", mib)].append(bg)
            ratios[mib].append(bf / bg)
            print(f"rep {rep + 1}: {mib} MiB ferroce {bf:.2f} GB/s, gloo {bg:.2f} GB/s, "
                  f"ratio {bf / bg:.2f}", flush=True)
    print(f"busbw GB/s, median (min..max) over {reps} repetitions")
    print(f"{'MiB':>5} {'ferroce':>18} {'gloo':>18} {'ferroce/gloo':>18}")
    for mib in sizes:
        print(f"{mib:>5} {spread(bus[('ferroce', mib)]):>18} {spread(bus[('gloo', mib)]):>18} "
              f"{spread(ratios[mib]):>18}")
