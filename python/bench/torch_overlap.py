"""How much of DDP's gradient all_reduce the "ferroce" backend hides behind the backward pass:
2 ranks on this host (processes), one intra-op thread each, the same model and data on
"ferroce" (operations queued to the group's worker), "ferroce" with FERROCE_TORCH_SYNC=1
(each operation run in the caller, as before they were queued) and "gloo":

    python3 python/bench/torch_overlap.py [--reps 5] [--steps 20] [--width 1024] [--layers 8]

Prints, per repetition (the three interleaved), the median step time of each, of the same step
without the all_reduce (DDP's no_sync: the compute alone), and of one all_reduce of all the
gradients; the share of that all_reduce hidden is 1 - (step - compute alone) / all_reduce.
Then the median and range of each over the repetitions."""

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, size, port, backend, sync, args, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), FERROCE_TORCH_SYNC="1" if sync else "0")
    import torch
    import torch.distributed as dist

    import ferroce.torch  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=size)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=4)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width)
    times = []
    for i in range(args.steps + 3):
        dist.barrier()
        t = time.perf_counter()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t)
    # The same steps without the all_reduce (DDP's no_sync): the compute alone.
    alone = []
    for i in range(args.steps + 3):
        dist.barrier()
        t = time.perf_counter()
        opt.zero_grad()
        with ddp.no_sync():
            ddp(x).square().mean().backward()
        opt.step()
        if i >= 3:
            alone.append(time.perf_counter() - t)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    comm = []
    for i in range(8):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(grads)
        if i >= 2:
            comm.append(time.perf_counter() - t)
    dist.destroy_process_group()
    results.put((rank, statistics.median(times), statistics.median(comm),
                 statistics.median(alone)))


def run(backend, sync, args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, backend, sync, args, q))
             for r in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    return tuple(max(g[i] for g in got) for i in (1, 2, 3))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    mib = args.layers * (args.width * args.width + args.width) * 4 / 2**20
    print(f"# {os.cpu_count()} CPUs; DDP, 2 ranks, {args.layers} x Linear({args.width}): "
          f"{mib:.0f} MiB of gradients, batch {args.batch}, step = forward+backward+SGD")
    rows = {"ferroce": [], "ferroce sync": [], "gloo": [], "compute alone": []}
    hidden = []
    for rep in range(args.reps):
        a, comm, alone = run("ferroce", False, args)
        s, _, _ = run("ferroce", True, args)
        g, gcomm, _ = run("gloo", False, args)
        for k, v in zip(rows, (a, s, g, alone)):
            rows[k].append(v)
        # The all_reduce's share that did not lengthen the step.
        hidden.append(1 - max(a - alone, 0) / comm)
        print(f"rep {rep + 1}: step ferroce {a * 1e3:.1f} ms, sync {s * 1e3:.1f} ms, "
              f"gloo {g * 1e3:.1f} ms, compute alone {alone * 1e3:.1f} ms; one all_reduce "
              f"of every gradient: ferroce {comm * 1e3:.1f} ms, gloo {gcomm * 1e3:.1f} ms; "
              f"hidden {100 * hidden[-1]:.0f} %")
    for k, v in rows.items():
        print(f"{k:>13}: step {statistics.median(v) * 1e3:.1f} ms "
              f"({min(v) * 1e3:.1f}..{max(v) * 1e3:.1f})")
    print(f"ferroce's all_reduce hidden behind the backward pass: "
          f"{100 * statistics.median(hidden):.0f} % ({100 * min(hidden):.0f}.."
          f"{100 * max(hidden):.0f}) = 1 - (step - compute alone) / all_reduce alone")


if __name__ == "__main__":
    main()
