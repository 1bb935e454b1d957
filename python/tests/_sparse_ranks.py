"""The sparse rank functions of test_torch.py: all_reduce of sparse COO tensors on "ferroce"
(as gloo's: SUM, the result coalesced in place), and DDP of a model with sparse gradients
(an ``nn.Embedding(sparse=True)``) on "ferroce" and "gloo"."""

import os


def _init(rank, size, port, backend):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist

    import ferroce.torch  # noqa: F401

    dist.init_process_group(backend, rank=rank, world_size=size)


def rank_tensor(rank, size, dtype, dense_cols=0, empty_rank=None):
    """Rank ``rank``'s uncoalesced sparse tensor of shape (6, 5[, dense_cols]): indices shared
    with other ranks and its own, one index given twice; none at all on ``empty_rank``."""
    import torch

    shape = (6, 5) + ((dense_cols,) if dense_cols else ())
    if rank == empty_rank:
        idx = torch.zeros((2, 0), dtype=torch.long)
    else:
        idx = torch.tensor([[0, rank % 6, 5, 0], [1, (2 * rank) % 5, 4, 1]])
    n = idx.shape[1]
    vals = (torch.arange(n * max(dense_cols, 1)) + 10 * rank + 1).to(dtype)
    vals = vals.reshape((n, dense_cols) if dense_cols else (n,))
    return torch.sparse_coo_tensor(idx, vals, shape)


def uneven_tensor(rank, size):
    """No entries on rank 0, three on the last rank, four on the others."""
    import torch

    if rank == size - 1:
        return torch.sparse_coo_tensor(torch.tensor([[2, 3, 4], [0, 0, 0]]),
                                       torch.tensor([1.0, 2.0, 3.0]), (6, 5))
    return rank_tensor(rank, size, torch.float32, empty_rank=0)


def all_reduce(rank, size, port, results):
    """Each case's result must be coalesced and equal the dense sum of every rank's tensor,
    exactly (the values are integers), on every rank; a call with async_op gives the same
    through its future; no entries anywhere give an empty tensor; other reductions, and dtypes
    or shapes that differ between ranks, are refused on every rank."""
    import torch
    import torch.distributed as dist

    bad = []
    try:
        _init(rank, size, port, "ferroce")
        cases = [("float32", torch.float32, 0, None), ("int64", torch.int64, 0, None),
                 ("float64 hybrid (a dense dimension)", torch.float64, 3, None),
                 ("float32, rank 1 with no entries", torch.float32, 0, 1)]
        for name, dtype, cols, empty in cases:
            t = rank_tensor(rank, size, dtype, cols, empty)
            want = sum(rank_tensor(r, size, dtype, cols, empty).to_dense() for r in range(size))
            dist.all_reduce(t)
            if not t.is_sparse or not t.is_coalesced():
                bad.append(f"{name}: the result is not a coalesced sparse tensor")
            elif t.dtype != dtype or not torch.equal(t.to_dense(), want):
                bad.append(f"{name}: {t.to_dense().tolist()} != {want.tolist()}")
        t = rank_tensor(rank, size, torch.float32)
        work = dist.all_reduce(t, async_op=True)
        got = work.get_future().wait()[0]
        want = sum(rank_tensor(r, size, torch.float32).to_dense() for r in range(size))
        if not torch.equal(got.to_dense(), want) or not torch.equal(t.to_dense(), want):
            bad.append("async_op: the future's tensor or the input is not the sum")
        # Counts that differ by rank (0, 4, 3 entries): the padding to the largest is no entry.
        mixed = uneven_tensor(rank, size)
        want = sum(uneven_tensor(r, size).to_dense() for r in range(size))
        dist.all_reduce(mixed)
        if not torch.equal(mixed.to_dense(), want) or mixed._nnz() != (want != 0).sum():
            bad.append(f"counts differing by rank: {mixed.to_dense().tolist()}")
        def refused(what, said, *args, **kwargs):
            try:
                dist.all_reduce(*args, **kwargs)
                bad.append(f"{what} was accepted")
            except ValueError as err:
                if said not in str(err):
                    bad.append(f"{what} refused with {err}")

        refused("MAX of sparse tensors", "SUM only", rank_tensor(rank, size, torch.float32),
                op=dist.ReduceOp.MAX)
        # No entries on any rank: an empty sum, and nothing gathered beyond the counts.
        none = torch.sparse_coo_tensor(torch.zeros((2, 0), dtype=torch.long), torch.zeros(0),
                                       (6, 5))
        dist.all_reduce(none)
        if not none.is_sparse or none._nnz() != 0 or none.shape != (6, 5):
            bad.append(f"no entries anywhere: {none}")
        # A dtype or a shape that differs between ranks fails every rank alike; the group goes on.
        refused("dtypes differing between ranks", "differ in dimensions or dtype",
                rank_tensor(rank, size, torch.float64 if rank == 0 else torch.float32))
        refused("shapes differing between ranks", "differ in shape",
                torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([1.0]),
                                        (6, 5 + rank)))
        d = torch.full((4,), float(rank))
        dist.all_reduce(d)
        if not torch.equal(d, torch.full((4,), float(sum(range(size))))):
            bad.append("a dense all_reduce after the refusals")
        dist.destroy_process_group()
    except Exception as err:
        bad.append(f"{type(err).__name__}: {err}")
    results.put((rank, bad))


def ddp_embedding(rank, size, port, backend, steps, results):
    """DDP of an nn.Embedding(sparse=True) and a linear layer, from seed 0, each rank its own
    token ids; puts (rank, backend, the final weights, error or None)."""
    import torch

    state, err = {}, None
    try:
        _init(rank, size, port, backend)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True),
                                    torch.nn.Linear(8, 2))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            ids = torch.randint(0, 50, (4, 6), generator=g)
            ddp(ids).pow(2).mean().backward()
            if not model[0].weight.grad.is_sparse:
                raise AssertionError("the embedding's gradient is not sparse")
            opt.step()
            opt.zero_grad()
        state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        import torch.distributed as dist

        dist.destroy_process_group()
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    results.put((rank, backend, state, err))
