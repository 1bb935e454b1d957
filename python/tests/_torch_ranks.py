"""One rank of the torch tests (importable by name from a spawned process)."""

import os


def train(rank, size, port, backend, steps, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import ferroce.torch  # noqa: F401  (registers "ferroce")

    try:
        dist.init_process_group(backend, rank=rank, world_size=size)
        torch.manual_seed(1234)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(99 + rank)
        for _ in range(steps):
            x = torch.randn(16, 32, generator=g)
            y = torch.randn(16, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        # By value (numpy), not as torch storage shared with a process about to exit.
        state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        dist.destroy_process_group()
        results.put((rank, backend, state, None))
    except Exception as err:
        results.put((rank, backend, None, f"{type(err).__name__}: {err}"))


def collectives(rank, size, port, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import ferroce.torch  # noqa: F401

    bad = []
    try:
        dist.init_process_group("ferroce", rank=rank, world_size=size)
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                      torch.int64, torch.uint8):
            t = (torch.arange(1001) * 7 + rank * 3) % 4 + 1
            want = sum((torch.arange(1001) * 7 + r * 3) % 4 + 1 for r in range(size))
            x = t.to(dtype)
            dist.all_reduce(x)
            if not torch.equal(x, want.to(dtype)):
                bad.append(f"all_reduce {dtype}")
        m = torch.full((3,), float(rank))
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        if not torch.equal(m, torch.full((3,), float(size - 1))):
            bad.append("all_reduce max")
        # A non-contiguous tensor (a column) is reduced in place too.
        grid = torch.ones(5, 4) * (rank + 1)
        col = grid[:, 1]
        dist.all_reduce(col)
        if not torch.equal(grid[:, 1], torch.full((5,), float(sum(range(1, size + 1))))):
            bad.append("all_reduce of a strided view")
        outs = [torch.zeros(6) for _ in range(size)]
        dist.all_gather(outs, torch.arange(6.0) + 10 * rank)
        if not all(torch.equal(o, torch.arange(6.0) + 10 * r) for r, o in enumerate(outs)):
            bad.append("all_gather")
        b = torch.arange(9.0) if rank == 1 else torch.zeros(9)
        dist.broadcast(b, src=1)
        if not torch.equal(b, torch.arange(9.0)):
            bad.append("broadcast")
        out = torch.zeros(4)
        dist.reduce_scatter(out, [torch.arange(4.0) + 4 * b + rank for b in range(size)])
        want = sum(torch.arange(4.0) + 4 * rank + r for r in range(size))
        if not torch.equal(out, want):
            bad.append("reduce_scatter")
        if rank == 0:
            dist.send(torch.arange(5, dtype=torch.int64), 1)
        elif rank == 1:
            got = torch.zeros(5, dtype=torch.int64)
            dist.recv(got, 0)
            if not torch.equal(got, torch.arange(5)):
                bad.append("send/recv")
        dist.barrier()
        dist.destroy_process_group()
    except Exception as err:
        bad.append(f"{type(err).__name__}: {err}")
    results.put((rank, bad))
