"""``init_process_group("cpu:ferroce,cuda:nccl")`` on a machine with a CUDA GPU: ferroce takes
the CPU tensors, NCCL the CUDA ones, in one job.

    python3 python/device/mixed_backends.py [--ranks 2]      # needs CUDA and NCCL

This is the check the test command cannot make: CI has no GPU (its tests route
``"cpu:ferroce,cuda:gloo"`` instead). Every rank shares GPU 0 (the machines lent here have
one): NCCL refuses two ranks on one GPU of one host, so each rank gets an ``NCCL_HOSTID`` of
its own and NCCL joins them as if on hosts of their own (``run.sh`` keeps it on its socket
transport over loopback: ``NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo``). Each rank
checks, and rank 0 prints one line per check and ``ALL PASSED`` or the failures (exit 1):

1. torch routes the group's CPU tensors to ``ProcessGroupFerroce`` and its CUDA tensors to
   ``ProcessGroupNCCL``, in the world group and in a ``new_group``;
2. all_reduce of a CPU tensor and of a CUDA tensor give the exact sums, also both in flight
   at once (``async_op=True``);
3. the shape of a GPU job: DDP trains a CUDA model (its gradients through NCCL) while each
   step's loss is summed on the CPU through ferroce, asynchronously, and waited at the step's
   end, as a job logs. The logged losses and the final weights must equal (within float32
   rounding: the sums are taken in another order) one process training the same model on all
   ranks' data at once, and every rank's weights must equal rank 0's bit for bit;
4. DDP of a CPU model in the same group (its gradients through ferroce), against the same
   reference;
5. a CUDA tensor given to a group of ferroce alone (``"ferroce"``, registered for CPU) is
   refused (by torch: "No backend type associated with device type cuda"), and the group
   still works.
"""

import argparse
import json
import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from _launch import run_ranks  # noqa: E402

STEPS, BATCH, WIDTH = 6, 16, 256


def train(model, batches, device, step_hook=None):
    """SGD over ``batches`` (one list of per-rank inputs per step, or the whole batch); returns
    the per-step losses. ``step_hook(loss)`` may return a value to collect instead."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    got = []
    for x in batches:
        loss = model(x.to(device)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        got.append(step_hook(loss) if step_hook else loss.detach())
    return got


def make_model(device):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                               torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                               torch.nn.Linear(WIDTH, 8)).to(device)


def data(size):
    """Each step's inputs, per rank (``[step][rank]``)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    return [[torch.randn(BATCH, WIDTH, generator=g) for _ in range(size)] for _ in range(STEPS)]


def reference(size, device):
    """One process, all ranks' data at once: DDP's averaged gradient is the gradient of the
    mean over ranks of each rank's mean loss, which over equal batches is the mean loss of
    the whole batch."""
    import torch

    model = make_model(device)
    losses = train(model, [torch.cat(step) for step in data(size)], device)
    return [float(v) for v in losses], [p.detach().cpu().clone() for p in model.parameters()]


def rank_main():
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ferroce.torch

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(0)
    cuda = torch.device("cuda", 0)
    results = []

    def check(name, ok, detail=""):
        results.append((name, bool(ok), detail))

    dist.init_process_group("cpu:ferroce,cuda:nccl")
    world = dist.group.WORLD

    # 1. Routing.
    for label, group in (("world", world), ("new_group", dist.new_group(list(range(size))))):
        cpu_be = group._get_backend(torch.device("cpu"))
        cuda_be = group._get_backend(cuda)
        check(f"{label}: CPU tensors go to ferroce",
              isinstance(cpu_be, ferroce.torch.ProcessGroupFerroce), type(cpu_be).__name__)
        check(f"{label}: CUDA tensors go to NCCL", "nccl" in type(cuda_be).__name__.lower(),
              type(cuda_be).__name__)
    check("the group's backend string", dist.get_backend() == "cpu:ferroce,cuda:nccl",
          dist.get_backend())

    # 2. all_reduce each way, then both in flight together.
    want = float(size * (size + 1) // 2)
    n = 4 << 20  # 16 MiB of float32: past ferroce's slots, so it takes many messages
    c = torch.full((n,), float(rank + 1))
    dist.all_reduce(c)
    check("all_reduce of a CPU tensor (16 MiB)", torch.equal(c, torch.full_like(c, want)))
    g = torch.full((n,), float(rank + 1), device=cuda)
    dist.all_reduce(g)
    check("all_reduce of a CUDA tensor (16 MiB)", torch.equal(g.cpu(), torch.full((n,), want)))
    c.fill_(rank + 1)
    g.fill_(rank + 1)
    works = [dist.all_reduce(c, async_op=True), dist.all_reduce(g, async_op=True)]
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    check("a CPU and a CUDA all_reduce in flight together",
          torch.equal(c, torch.full_like(c, want)) and
          torch.equal(g.cpu(), torch.full((n,), want)))

    ref_losses, ref_params = reference(size, cuda)
    steps = data(size)

    # 3. DDP on the GPU, the loss logged through ferroce.
    model = DDP(make_model(cuda), device_ids=[0])
    pending = []

    def log_loss(loss):
        # As a job logs: the loss to the CPU, summed over ranks without waiting for it here.
        t = loss.detach().cpu().reshape(1)
        pending.append((t, dist.all_reduce(t, async_op=True)))
        return None

    train(model, [step[rank] for step in steps], cuda, log_loss)
    logged = []
    for t, work in pending:
        work.wait()
        logged.append(t.item() / size)
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(logged, ref_losses))
    check("GPU DDP: losses summed through ferroce equal one process's", worst < 1e-4,
          f"worst relative difference {worst:.2e}")
    same_as_rank0(model, check, "GPU DDP")
    close_to(model, ref_params, check, "GPU DDP")

    # 4. DDP on the CPU in the same group: the gradients through ferroce.
    cpu_ref_losses, cpu_ref_params = reference(size, torch.device("cpu"))
    cpu_model = DDP(make_model(torch.device("cpu")))
    got = train(cpu_model, [step[rank] for step in steps], torch.device("cpu"))
    worst = max(abs(float(a) - b) / max(abs(b), 1e-12) for a, b in zip(
        reduce_mean(got, size), cpu_ref_losses))
    check("CPU DDP in the mixed group: losses equal one process's", worst < 1e-4,
          f"worst relative difference {worst:.2e}")
    same_as_rank0(cpu_model, check, "CPU DDP")
    close_to(cpu_model, cpu_ref_params, check, "CPU DDP")

    # 5. A CUDA tensor given to a ferroce-only group is refused, and the group goes on.
    only = dist.new_group(list(range(size)), backend="ferroce")
    try:
        dist.all_reduce(torch.ones(4, device=cuda), group=only)
        check("a CUDA tensor on a ferroce-only group is refused", False, "it was accepted")
    except Exception as err:  # torch raises its own types, by version
        # torch refuses it itself (the backend is registered for CPU alone); ferroce's own
        # check would name CPU tensors.
        said = str(err)
        check("a CUDA tensor on a ferroce-only group is refused",
              "No backend type associated with device type cuda" in said or "CPU" in said,
              f"{type(err).__name__}: {said.splitlines()[0][:160]}")
    t = torch.ones(4)
    dist.all_reduce(t, group=only)
    check("the ferroce-only group works afterwards", torch.equal(t, torch.full((4,), size)))

    # Every rank's verdicts to rank 0, through ferroce (an object collective on the CPU).
    every = [None] * size
    dist.all_gather_object(every, results, group=only)
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(every), flush=True)


def reduce_mean(losses, size):
    """Each step's loss averaged over ranks, through the group's CPU backend (ferroce)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(v) for v in losses], dtype=torch.float64)
    dist.all_reduce(t)
    return (t / size).tolist()


def flat(model):
    import torch

    return torch.cat([p.detach().cpu().reshape(-1) for p in model.parameters()])


def same_as_rank0(model, check, label):
    import torch
    import torch.distributed as dist

    mine = flat(model)
    ref = mine.clone()
    dist.broadcast(ref, 0)  # a CPU tensor: through ferroce
    check(f"{label}: this rank's weights equal rank 0's bit for bit", torch.equal(mine, ref))


def close_to(model, ref_params, check, label):
    import torch

    mine = flat(model)
    ref = torch.cat([p.reshape(-1) for p in ref_params])
    diff = (mine - ref).abs().max().item()
    check(f"{label}: final weights equal one process's within float32 rounding",
          torch.allclose(mine, ref, rtol=1e-4, atol=1e-6), f"max difference {diff:.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=150.0,
                    help="seconds before every rank is ended (default 150)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    envs = [dict(os.environ, MIXED_RANK_MAIN="1", RANK=str(rank), LOCAL_RANK=str(rank),
                 WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 NCCL_HOSTID=f"ferroce-mixed-rank-{rank}") for rank in range(args.ranks)]
    ranks = run_ranks([[sys.executable, __file__]] * args.ranks, envs, args.timeout)
    if any(code for code, _, _ in ranks):
        for rank, (code, _, err) in enumerate(ranks):
            print(f"rank {rank} exited {code}{' (killed)' if code < 0 else ''}:\n{err[-3000:]}")
        sys.exit(1)
    outs = [(out, err) for _, out, err in ranks]
    every = json.loads(outs[0][0].strip().splitlines()[-1])
    failed = 0
    for rank, results in enumerate(every):
        for name, ok, detail in results:
            failed += not ok
            print(f"rank {rank}: {'ok  ' if ok else 'FAIL'} {name}" +
                  (f" ({detail})" if detail else ""))
    print("ALL PASSED" if not failed else f"{failed} FAILED")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    if os.environ.get("MIXED_RANK_MAIN") == "1":
        rank_main()
    else:
        main()
