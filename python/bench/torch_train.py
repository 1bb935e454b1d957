"""Training steps per second through torch.distributed on "ferroce" and on "gloo", same run.

    python3 python/bench/torch_train.py                    # every setup, 3 repetitions
    python3 python/bench/torch_train.py --setups 2 --modes ddp --reps 5 --params-mb 128

A CPU model large enough that communication matters (an MLP of ``--layers`` square linear
layers, ``--params-mb`` MB of float32 parameters in all), trained with DistributedDataParallel
(``ddp``: one all_reduce of every gradient per step, in buckets) and with FSDP2 (``fsdp``:
``fully_shard`` per layer: all_gather of each layer's parameters forward and backward, and
reduce_scatter of its gradients). Setups: ``2`` and ``4`` ranks on this host, and ``hosts``:
2 ranks on two network-namespace hosts joined by a veth pair (MTU 9000; root needed), where
ferroce runs over RoCE v2/UDP and gloo over TCP. Each repetition runs every (setup, mode)
on ferroce and on gloo back to back, so each ratio is taken between neighbouring runs; the
table prints the median steps/s of each and the median ratio ferroce/gloo with its range
(min..max over repetitions). Every rank checks that its weights equal rank 0's at the end.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

from _launch import run_ranks

A, B = "ftrain-a", "ftrain-b"
ADDR_A, ADDR_B = "10.214.0.1", "10.214.0.2"


def rank_main():
    """One rank: trains, times, checks; rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist

    import ferroce.torch  # noqa: F401

    backend, mode = os.environ["BENCH_BACKEND"], os.environ["BENCH_MODE"]
    layers, width = int(os.environ["BENCH_LAYERS"]), int(os.environ["BENCH_WIDTH"])
    steps, warmup, batch = (int(os.environ[k]) for k in ("BENCH_STEPS", "BENCH_WARMUP",
                                                         "BENCH_BATCH"))
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width),
                                                      torch.nn.ReLU()) for _ in range(layers)])
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # A CPU mesh, named: the default one is on CUDA wherever a GPU is present.
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g)

    def step():
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    # Every rank must end with rank 0's weights.
    flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    same = torch.tensor([1.0 if torch.equal(flat, ref) else 0.0])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(json.dumps({"steps_per_s": steps / elapsed, "same_weights": same.item() == 1.0}),
              flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(args, setup, mode, backend):
    """Runs one training job; returns steps/s (None if it failed or weights differed)."""
    width = args.width
    layers = max(1, int(args.params_mb * 1e6 / 4 / (width * width + width)))
    env = dict(os.environ, BENCH_RANK_MAIN="1", BENCH_BACKEND=backend, BENCH_MODE=mode,
               BENCH_LAYERS=str(layers), BENCH_WIDTH=str(width), BENCH_STEPS=str(args.steps),
               BENCH_WARMUP=str(args.warmup), BENCH_BATCH=str(args.batch),
               BENCH_THREADS=str(args.threads))
    env.pop("CI", None)
    port = free_port()
    if setup == "hosts":
        size, master = 2, ADDR_A
        prefixes = [["ip", "netns", "exec", A], ["ip", "netns", "exec", B]]
        # gloo picks its interface from the host name, which resolves to loopback here.
        env["GLOO_SOCKET_IFNAME"] = "veth0"
    else:
        size, master = int(setup), "127.0.0.1"
        prefixes = [[] for _ in range(size)]
    envs = [dict(env, RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR=master,
                 MASTER_PORT=str(port), LOCAL_RANK=str(rank)) for rank in range(size)]
    ranks = run_ranks([prefixes[rank] + [sys.executable, __file__] for rank in range(size)],
                      envs, args.timeout)
    if any(code for code, _, _ in ranks):
        sys.stderr.write(f"{setup} {mode} {backend} failed (exit codes "
                         f"{[code for code, _, _ in ranks]}):\n" +
                         "\n".join(err[-2000:] for _, _, err in ranks))
        return None
    outs = [(out, err) for _, out, err in ranks]
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    if not got["same_weights"]:
        sys.stderr.write(f"{setup} {mode} {backend}: ranks ended with different weights\n")
        return None
    return got["steps_per_s"]


def make_hosts(mtu):
    subprocess.run(["ip", "netns", "del", A], stderr=subprocess.DEVNULL)
    subprocess.run(["ip", "netns", "del", B], stderr=subprocess.DEVNULL)
    for cmd in (f"ip netns add {A}", f"ip netns add {B}",
                f"ip -n {A} link set lo up", f"ip -n {B} link set lo up",
                f"ip link add veth0 netns {A} mtu {mtu} type veth peer name veth0 netns {B} "
                f"mtu {mtu}",
                f"ip -n {A} addr add {ADDR_A} peer {ADDR_B} dev veth0",
                f"ip -n {B} addr add {ADDR_B} peer {ADDR_A} dev veth0",
                f"ip -n {A} link set veth0 up", f"ip -n {B} link set veth0 up"):
        subprocess.run(cmd.split(), check=True)


def drop_hosts():
    for ns in (A, B):
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", nargs="+", default=["2", "4", "hosts"])
    ap.add_argument("--modes", nargs="+", default=["ddp", "fsdp"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--params-mb", type=float, default=256.0,
                    help="float32 parameters in all, MB (default 256: 64 M parameters)")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's intra-op threads per rank (default 1); more make the compute "
                         "shorter, so communication weighs more in a step")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    if "hosts" in args.setups:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            sys.exit("the 'hosts' setup makes network namespaces: run as root (or leave it out)")
        make_hosts(9000)
    print(f"# {os.cpu_count()} CPUs; {args.params_mb:.0f} MB of float32 parameters "
          f"(width {args.width}), batch {args.batch}, {args.threads} intra-op thread(s) per rank, "
          f"{args.steps} timed steps after {args.warmup}; {args.reps} repetitions", flush=True)
    results = {}
    try:
        for rep in range(args.reps):
            for setup in args.setups:
                for mode in args.modes:
                    for backend in ("ferroce", "gloo"):
                        v = run_once(args, setup, mode, backend)
                        results.setdefault((setup, mode, backend), []).append(v)
                        print(f"rep {rep + 1}: {setup} {mode} {backend} "
                              f"{'failed' if v is None else f'{v:.2f} steps/s'}", flush=True)
    finally:
        if "hosts" in args.setups:
            drop_hosts()
    names = {"2": "2 ranks, one host", "4": "4 ranks, one host",
             "hosts": "2 ranks, two namespace hosts"}
    print(f"\n{'setup':<30} {'mode':<5} {'ferroce steps/s':>16} {'gloo steps/s':>13} "
          f"{'ferroce/gloo median (range)':>30}")
    for setup in args.setups:
        for mode in args.modes:
            f, g = results[(setup, mode, "ferroce")], results[(setup, mode, "gloo")]
            pairs = [(a, b) for a, b in zip(f, g) if a and b]
            if not pairs:
                print(f"{names[setup]:<30} {mode:<5} failed")
                continue
            ratios = [a / b for a, b in pairs]
            print(f"{names[setup]:<30} {mode:<5} "
                  f"{statistics.median(a for a, _ in pairs):>16.3f} "
                  f"{statistics.median(b for _, b in pairs):>13.3f} "
                  f"{statistics.median(ratios):>12.2f} ({min(ratios):.2f}..{max(ratios):.2f})")


if __name__ == "__main__":
    if os.environ.get("BENCH_RANK_MAIN") == "1":
        rank_main()
    else:
        main()
