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


SENTINEL = -7


def _column(v):
    """``v`` (1-D) as column 1 of an (n, 3) tensor; the other columns hold SENTINEL."""
    import torch

    base = torch.full((v.numel(), 3), SENTINEL, dtype=v.dtype)
    base[:, 1] = v
    return base[:, 1], base


def _step(v):
    """``v`` as every second element from 1 of a (2n + 1)-element tensor."""
    import torch

    base = torch.full((2 * v.numel() + 1,), SENTINEL, dtype=v.dtype)
    base[1::2] = v
    return base[1::2], base


def _transpose(v):
    """``v`` (even length) as the transpose of an (n / 2, 2) tensor: a (2, n / 2) view whose
    logical (row-major) order is ``v``'s."""
    import torch

    base = torch.full((v.numel() // 2, 2), SENTINEL, dtype=v.dtype)
    t = base.t()
    t.copy_(v.reshape(t.shape))
    return t, base


LAYOUTS = {"column": _column, "step": _step, "transpose": _transpose}


def strided(rank, size, port, results):
    """Every operation of the backend on non-contiguous tensors (column slices, step slices,
    transposes) as inputs and outputs, checked against what the operation must produce; the
    bytes around each view (its base's other elements) must be untouched."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import ferroce.torch  # noqa: F401

    bad = []

    def vec(seed, n, dtype=torch.float32):
        return ((torch.arange(n) * 7 + seed * 13) % 23 + 1).to(dtype)

    def check(what, view, base, want, layout):
        # The view holds ``want`` in logical order, and its base is exactly the layout of
        # ``want`` (so nothing beside the view was written).
        if view.is_contiguous() and view.numel() > 1:
            bad.append(f"{what}: the {layout} view is contiguous, the test proves nothing")
        if not torch.equal(view.reshape(-1), want.reshape(-1)):
            bad.append(f"{what} ({layout}): values {view.reshape(-1)[:6].tolist()} ... "
                       f"want {want.reshape(-1)[:6].tolist()} ...")
        if not torch.equal(base, LAYOUTS[layout](want.reshape(-1))[1]):
            bad.append(f"{what} ({layout}): bytes beside the view changed")

    try:
        dist.init_process_group("ferroce", rank=rank, world_size=size)
        n = 1000
        for name, lay in LAYOUTS.items():
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                t, base = lay(vec(rank, n, dtype))
                dist.all_reduce(t)
                check(f"all_reduce {dtype}", t, base, sum(vec(r, n, dtype) for r in range(size)),
                      name)
            t, base = lay(vec(rank, n))
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            check("all_reduce max", t, base,
                  torch.stack([vec(r, n) for r in range(size)]).max(0).values, name)

            src = size - 1
            t, base = lay(vec(rank, n))
            dist.broadcast(t, src=src)
            check("broadcast", t, base, vec(src, n), name)

            inp, ibase = lay(vec(rank, n))
            outs = [lay(torch.zeros(n)) for _ in range(size)]
            dist.all_gather([o for o, _ in outs], inp)
            for r, (o, obase) in enumerate(outs):
                check(f"all_gather block {r}", o, obase, vec(r, n), name)
            check("all_gather input", inp, ibase, vec(rank, n), name)

            inp, ibase = lay(vec(rank, n))
            out, obase = lay(torch.zeros(size * n))
            dist.all_gather_into_tensor(out, inp)
            check("all_gather_into_tensor", out, obase,
                  torch.cat([vec(r, n) for r in range(size)]), name)
            check("all_gather_into_tensor input", inp, ibase, vec(rank, n), name)

            # In place: the input is this rank's block of the output (a view of its memory),
            # for the 1-D layouts, where that block is a slice of the view.
            out, obase = lay(torch.zeros(size * n))
            if out.dim() == 1:
                mine = out[rank * n:(rank + 1) * n]
                mine.copy_(vec(rank, n))
                dist.all_gather_into_tensor(out, mine)
                check("all_gather_into_tensor in place", out, obase,
                      torch.cat([vec(r, n) for r in range(size)]), name)

            ins = [lay(vec(rank * size + b, n)) for b in range(size)]
            out, obase = lay(torch.zeros(n))
            dist.reduce_scatter(out, [i for i, _ in ins])
            check("reduce_scatter", out, obase,
                  sum(vec(r * size + rank, n) for r in range(size)), name)

            inp, ibase = lay(torch.cat([vec(rank * size + b, n) for b in range(size)]))
            out, obase = lay(torch.zeros(n))
            dist.reduce_scatter_tensor(out, inp)
            check("reduce_scatter_tensor", out, obase,
                  sum(vec(r * size + rank, n) for r in range(size)), name)

            inp, ibase = lay(torch.cat([vec(10 * rank + j, n) for j in range(size)]))
            out, obase = lay(torch.zeros(size * n))
            if inp.shape[0] % size or out.shape[0] % size:
                # Even blocks are blocks of rows (as gloo's): a (2, k) transpose does not
                # split among 3 ranks, and the call says so before anything moves.
                try:
                    dist.all_to_all_single(out, inp)
                    bad.append(f"all_to_all_single of {inp.shape[0]} rows on {size} ranks")
                except ValueError as e:
                    if "rows" not in str(e):
                        bad.append(f"all_to_all_single's refusal: {e}")
            else:
                dist.all_to_all_single(out, inp)
                check("all_to_all_single", out, obase,
                      torch.cat([vec(10 * i + rank, n) for i in range(size)]), name)
                check("all_to_all_single input", inp, ibase,
                      torch.cat([vec(10 * rank + j, n) for j in range(size)]), name)

            ins = [lay(vec(10 * rank + j, n)) for j in range(size)]
            outs = [lay(torch.zeros(n)) for _ in range(size)]
            dist.all_to_all([o for o, _ in outs], [i for i, _ in ins])
            for i, (o, obase) in enumerate(outs):
                check(f"all_to_all from {i}", o, obase, vec(10 * i + rank, n), name)

            # Every ordered pair, in one global order every rank walks (no deadlock).
            for s in range(size):
                for d in range(size):
                    if s == d:
                        continue
                    if rank == s:
                        t, base = lay(vec(100 + 10 * s + d, n))
                        dist.send(t, d)
                        check(f"send {s}->{d} input", t, base, vec(100 + 10 * s + d, n), name)
                    elif rank == d:
                        t, base = lay(torch.zeros(n))
                        dist.recv(t, s)
                        check(f"recv {s}->{d}", t, base, vec(100 + 10 * s + d, n), name)
            dist.barrier()
        # In place on contiguous tensors: the input is this rank's block of the output, or
        # the output this rank's block of the input (the extension refuses overlap, so the
        # backend must copy the input first).
        out = torch.zeros(size * n)
        out[rank * n:(rank + 1) * n] = vec(rank, n)
        dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n])
        if not torch.equal(out, torch.cat([vec(r, n) for r in range(size)])):
            bad.append("all_gather_into_tensor in place (contiguous)")
        inp = torch.cat([vec(rank * size + b, n) for b in range(size)])
        dist.reduce_scatter_tensor(inp[rank * n:(rank + 1) * n], inp)
        if not torch.equal(inp[rank * n:(rank + 1) * n],
                           sum(vec(r * size + rank, n) for r in range(size))):
            bad.append("reduce_scatter_tensor in place (contiguous)")
        buf = torch.cat([vec(10 * rank + j, n) for j in range(size)])
        dist.all_to_all_single(buf, buf)
        if not torch.equal(buf, torch.cat([vec(10 * i + rank, n) for i in range(size)])):
            bad.append("all_to_all_single in place (contiguous)")
        # A tensor that requires grad (a parameter, say) is sent as its values.
        if rank == 0:
            dist.send(vec(5, n).requires_grad_()[1::3], 1)
        elif rank == 1:
            got = torch.zeros(len(range(1, n, 3)))
            dist.recv(got, 0)
            if not torch.equal(got, vec(5, n)[1::3]):
                bad.append("send of a tensor that requires grad")
        dist.destroy_process_group()
    except Exception as err:
        import traceback

        bad.append(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    results.put((rank, bad))


def routing(rank, size, port, results):
    """``"cpu:ferroce,cuda:gloo"``: torch's group holds ferroce for CPU tensors and gloo for
    CUDA ones (gloo stands in for NCCL: it builds a CUDA backend without a GPU), the group has
    a name, and CPU collectives run on ferroce, in the world group and in subgroups."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import ferroce.torch

    bad = []
    try:
        dist.init_process_group("cpu:ferroce,cuda:gloo", rank=rank, world_size=size)
        pg = dist.group.WORLD
        cpu = pg._get_backend(torch.device("cpu"))
        if not isinstance(cpu, ferroce.torch.ProcessGroupFerroce):
            bad.append(f"CPU tensors go to {type(cpu).__name__}")
        cuda = pg._get_backend(torch.device("cuda"))
        if isinstance(cuda, ferroce.torch.ProcessGroupFerroce) or "gloo" not in type(cuda).__name__.lower():
            bad.append(f"CUDA tensors go to {type(cuda).__name__}")
        if dist.get_backend() != "cpu:ferroce,cuda:gloo":
            bad.append(f"backend {dist.get_backend()}")
        if not pg.group_name:
            bad.append("the group has no name")
        t = torch.full((1000,), float(rank + 1))
        dist.all_reduce(t)
        if not torch.equal(t, torch.full((1000,), float(size * (size + 1) // 2))):
            bad.append("all_reduce")
        # A group of rank 0 alone: the others never create its backend; the next group of all
        # ranks must still meet (its keys once depended on how many groups each rank made).
        solo = dist.new_group([0])
        if rank == 0:
            v = torch.full((4,), 7.0)
            dist.all_reduce(v, group=solo)
            if not torch.equal(v, torch.full((4,), 7.0)):
                bad.append("all_reduce in a group of one")
        sub = dist.new_group(list(range(size)))
        if not isinstance(sub._get_backend(torch.device("cpu")), ferroce.torch.ProcessGroupFerroce):
            bad.append("a subgroup's CPU backend is not ferroce")
        u = torch.full((10,), float(rank))
        dist.broadcast(u, src=size - 1, group=sub)
        if not torch.equal(u, torch.full((10,), float(size - 1))):
            bad.append("broadcast in a subgroup")
        dist.destroy_process_group()
    except Exception as err:
        bad.append(f"{type(err).__name__}: {err}")
    results.put((rank, bad))


def more_ops(rank, size, port, results):
    """reduce, gather, scatter, all_reduce_coalesced, all_gather_coalesced, uneven
    all_to_all_single and all_to_all, and monitored_barrier on "ferroce": every value as the
    operation defines it, on every rank; and receives from any source naming their senders."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import ferroce.torch  # noqa: F401

    bad = []

    def check(what, got, want):
        if not torch.equal(got, want):
            bad.append(f"{what}: {got.tolist()[:8]} != {want.tolist()[:8]}")

    def val(r, n=5):
        return torch.arange(n, dtype=torch.float32) + 10 * r

    try:
        dist.init_process_group("ferroce", rank=rank, world_size=size)
        for root in range(size):
            t = val(rank)
            dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)
            check(f"reduce to {root}", t, sum(val(r) for r in range(size)) if rank == root
                  else val(rank))
            # A column (non-contiguous) reduced with MAX.
            grid = torch.stack([val(rank), val(rank)], dim=1)
            col = grid[:, 0]
            dist.reduce(col, dst=root, op=dist.ReduceOp.MAX)
            check(f"reduce max to {root}", grid[:, 0], val(size - 1) if rank == root
                  else val(rank))
            check(f"reduce max to {root} (other column)", grid[:, 1], val(rank))

            outs = [torch.empty(5) for _ in range(size)] if rank == root else None
            dist.gather(val(rank), gather_list=outs, dst=root)
            if rank == root:
                for r in range(size):
                    check(f"gather at {root} from {r}", outs[r], val(r))

            out = torch.empty(5)
            ins = [val(r) * 3 for r in range(size)] if rank == root else None
            dist.scatter(out, scatter_list=ins, src=root)
            check(f"scatter from {root}", out, val(rank) * 3)

        ts = [torch.full((3,), float(rank)), torch.full((2, 2), float(rank + 1))]
        dist.all_reduce_coalesced(ts)
        check("all_reduce_coalesced 0", ts[0], torch.full((3,), float(sum(range(size)))))
        check("all_reduce_coalesced 1", ts[1],
              torch.full((2, 2), float(sum(range(1, size + 1)))))

        ins = [torch.full((2,), float(rank)), torch.full((3,), float(-rank))]
        outs = [[torch.empty(2), torch.empty(3)] for _ in range(size)]
        dist.all_gather_coalesced(outs, ins)
        for r in range(size):
            check(f"all_gather_coalesced from {r}", torch.cat(outs[r]),
                  torch.cat([torch.full((2,), float(r)), torch.full((3,), float(-r))]))

        # Uneven all_to_all_single: rank r sends (r + j) rows of 3 to rank j, some of them
        # none; a row carries (sender, receiver, index).
        def rows(src, dst):
            k = (src + dst) % 3
            return torch.tensor([[src, dst, i] for i in range(k)], dtype=torch.float32
                                ).reshape(k, 3)

        send = torch.cat([rows(rank, j) for j in range(size)])
        in_splits = [rows(rank, j).shape[0] for j in range(size)]
        out_splits = [rows(i, rank).shape[0] for i in range(size)]
        got = torch.empty(sum(out_splits), 3)
        dist.all_to_all_single(got, send, out_splits, in_splits)
        check("all_to_all_single uneven", got, torch.cat([rows(i, rank) for i in range(size)]))

        outs = [torch.empty(rows(i, rank).shape) for i in range(size)]
        dist.all_to_all(outs, [rows(rank, j) for j in range(size)])
        for i in range(size):
            check(f"all_to_all uneven from {i}", outs[i], rows(i, rank))

        import inspect
        if "only implemented for GLOO" in inspect.getsource(dist.monitored_barrier):
            # Torch itself (2.11, say) refuses monitored_barrier for every backend but gloo,
            # in Python, before any backend is called: check that it is torch's refusal.
            try:
                dist.monitored_barrier()
                bad.append("this torch's monitored_barrier took a backend other than gloo")
            except ValueError as e:
                if "only implemented for GLOO" not in str(e):
                    bad.append(f"monitored_barrier: {e}")
        else:
            dist.monitored_barrier()
            dist.monitored_barrier(wait_all_ranks=True)

        # Receives from any source: rank 0 takes one send from every other rank, in whatever
        # order they come (the later ranks send first), and recv names each sender.
        if rank == 0:
            seen = set()
            for _ in range(size - 1):
                t = torch.empty(3)
                src = dist.recv(t)
                seen.add(src)
                check(f"recv from any source (from {src})", t, torch.full((3,), float(src)))
            if seen != set(range(1, size)):
                bad.append(f"recv from any source: senders {sorted(seen)}")
        else:
            import time
            time.sleep(0.1 * (size - rank))
            dist.send(torch.full((3,), float(rank)), 0)
        z = torch.ones(2)
        dist.all_reduce(z)
        check("all_reduce after receives from any source", z, torch.full((2,), float(size)))
        dist.destroy_process_group()
    except Exception as err:
        import traceback
        bad.append(f"{type(err).__name__}: {err}\n{traceback.format_exc()[-800:]}")
    results.put((rank, bad))


def asynchronous(rank, size, port, results):
    """Operations queued to the group's worker: an async all_reduce returns before a late rank
    joins it (not completed, then completed after wait()), several queued ones run in order, a
    bad dtype is refused at the call, and DDP with torch's allreduce comm hook (get_future) and
    with its PowerSGD hook (collectives started and waited for inside future callbacks) trains
    to the same weights on every rank."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import ferroce.torch  # noqa: F401

    bad = []
    try:
        dist.init_process_group("ferroce", rank=rank, world_size=size)
        dist.barrier()
        if rank != 0:
            time.sleep(0.5)
        t = torch.full((1000,), float(rank + 1))
        w = dist.all_reduce(t, async_op=True)
        if rank == 0 and (w.get_future().done() or w.is_completed()):
            bad.append("an all_reduce a late rank had not joined was already done")
        w.wait()
        if not torch.equal(t, torch.full((1000,), float(size * (size + 1) // 2))):
            bad.append("async all_reduce value")
        if not w.get_future().done():
            bad.append("the future is not done after wait()")
        if not w.is_completed():
            bad.append("the Work is not completed after wait()")
        if not torch.equal(w.get_future().value()[0], t):
            bad.append("the future's value is not the reduced tensor")

        # Queued in a row, waited for in reverse: each sees the one before it.
        x = torch.ones(10)
        works = [dist.all_reduce(x, async_op=True) for _ in range(4)]
        for w in reversed(works):
            w.wait()
        if not torch.equal(x, torch.full((10,), float(size ** 4))):
            bad.append(f"four queued all_reduces: {x[0].item()}")

        try:
            dist.all_reduce(torch.ones(3, dtype=torch.int16))
            bad.append("an int16 all_reduce did not fail")
        except TypeError as e:
            if "int16" not in str(e):
                bad.append(f"int16: {e}")
        # And the group still works after a refused call.
        y = torch.ones(3)
        dist.all_reduce(y)
        if not torch.equal(y, torch.full((3,), float(size))):
            bad.append("all_reduce after an error")

        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 2))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(torch.randn(8, 16, generator=g)),
                                         torch.randn(8, 2, generator=g)).backward()
            opt.step()
        w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        every = [torch.empty_like(w) for _ in range(size)]
        dist.all_gather(every, w)
        if not all(torch.equal(every[0], e) for e in every):
            bad.append("DDP with the allreduce comm hook: weights differ between ranks")

        # PowerSGD's hook starts all_reduces inside its futures' callbacks and waits for them
        # there: that must not wait on the worker that completes the callbacks' futures.
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        torch.manual_seed(8)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 2))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, min_compression_rate=0.5)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(torch.randn(8, 16, generator=g)),
                                         torch.randn(8, 2, generator=g)).backward()
            opt.step()
        w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        dist.all_gather(every := [torch.empty_like(w) for _ in range(size)], w)
        if not all(torch.equal(every[0], e) for e in every):
            bad.append("DDP with PowerSGD: weights differ between ranks")
        dist.destroy_process_group()
    except Exception as err:
        bad.append(f"{type(err).__name__}: {err}")
    results.put((rank, bad))


def dead_rank(rank, size, port, results):
    """A rank that dies after joining: the others' next collective fails within the group's
    timeout with torch's DistBackendError naming it, and a wait() on queued work raises it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import datetime
    import time

    import torch
    import torch.distributed as dist

    import ferroce.torch  # noqa: F401

    bad = []
    try:
        dist.init_process_group("ferroce", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=3))
        t = torch.ones(4)
        dist.all_reduce(t)
        if rank == size - 1:
            results.put((rank, bad))
            results.close()
            results.join_thread()  # the result is out before the process is gone
            os._exit(0)  # gone without a word: no destroy, no exit handlers
        start = time.monotonic()
        work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
        try:
            work.wait()
            bad.append("an all_reduce with a dead rank succeeded")
        except dist.DistBackendError as e:
            took = time.monotonic() - start
            if took > 30:
                bad.append(f"the failure took {took:.1f} s with a 3 s timeout")
            if "ferroce" not in str(e):
                bad.append(f"the error does not say where it came from: {e}")
        if not work.is_completed():
            bad.append("the failed Work is not completed")
    except Exception as err:
        bad.append(f"{type(err).__name__}: {err}")
    results.put((rank, bad))
    results.close()
    results.join_thread()
    os._exit(0)  # the group is broken; torch's exit handlers would wait on it
