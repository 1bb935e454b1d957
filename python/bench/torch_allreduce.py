"""torch.distributed all_reduce of float32 through the "ferroce" and "gloo" backends, in the same
run, 2 ranks on this host (processes), nccl-tests' bus bandwidth (algbw * 2(n-1)/n, 1e9 B/s):

    python3 python/bench/torch_allreduce.py [MiB ...]    # default: 1 16 64

Each size: 3 warm-up calls, then the time of 10 calls, the slower rank's; both backends' results
are checked against the expected sums first."""

import multiprocessing as mp
import os
import socket
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


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:]] or [1, 16, 64]
    size = 2
    rows = {b: run(b, sizes, size) for b in ("ferroce", "gloo")}
    print(f"{'MiB':>5} {'ferroce ms':>11} {'busbw':>7} {'gloo ms':>9} {'busbw':>7} {'ratio':>6}")
    for (mib, tf), (_, tg) in zip(rows["ferroce"], rows["gloo"]):
        bf = mib * (1 << 20) / tf / 1e9 * 2 * (size - 1) / size
        bg = mib * (1 << 20) / tg / 1e9 * 2 * (size - 1) / size
        print(f"{mib:>5} {tf * 1e3:>11.2f} {bf:>7.2f} {tg * 1e3:>9.2f} {bg:>7.2f} {bf / bg:>6.2f}")
