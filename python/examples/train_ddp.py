"""Trains a small model with DistributedDataParallel over ferroce.

    torchrun --nproc-per-node 2 python/examples/train_ddp.py [--backend ferroce|gloo] [--steps N]

Every rank sees its own data; DDP averages the gradients with all_reduce over the chosen
backend. Rank 0 prints the loss at each step and, at the end, a checksum of the weights (the
same on every rank, and the same for "ferroce" and "gloo" from the same seed)."""

import argparse

import torch
import torch.distributed as dist

import ferroce.torch  # noqa: F401  (registers the "ferroce" backend)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="ferroce")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1000 + rank)
    # A linear target the model can learn: the loss falls.
    w_true = torch.linspace(-1, 1, 16)
    for step in range(args.steps):
        x = torch.randn(64, 16, generator=g)
        y = (x @ w_true).unsqueeze(1)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    checksum = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().sum()
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(size)]
    dist.all_gather(sums, checksum.reshape(1))
    if rank == 0:
        same = all(torch.equal(s, sums[0]) for s in sums)
        print(f"weights checksum {checksum.item():.12f} same on all ranks: {same}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
