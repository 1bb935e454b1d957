"""The body of one rank for test_torch.py's split_group test (spawned processes)."""

import os


def split(rank, size, port, backend, results):
    """torch's split_group on ``backend``: the members of each split get a group of their own,
    ranked in the order the split lists them, whose collectives and sends reach only them; a
    rank in no split gets no group; the parent still works, and so does new_group. Where this
    torch cannot split a CPU group (2.11 splits only CUDA ones, for any backend), the rank
    reports torch's refusal as ("refused", message) for the test to compare with gloo's."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import ferroce.torch  # noqa: F401

    bad = []
    try:
        dist.init_process_group(backend, rank=rank, world_size=size)
        dist.barrier()
        # Ranks 3, 0 and 2 in that order (rank 3 is the split's rank 0), rank 1 alone, and
        # rank 4 (with 5 ranks) in none.
        splits = [[3, 0, 2], [1]]
        try:
            group = dist.split_group(split_ranks=splits)
        except RuntimeError as e:
            dist.destroy_process_group()
            results.put((rank, ("refused", str(e))))
            return
        mine = next((s for s in splits if rank in s), None)
        if mine is None:
            if group is not dist.GroupMember.NON_GROUP_MEMBER:
                bad.append(f"rank {rank} is in no split but got {group}")
        else:
            if dist.get_world_size(group) != len(mine):
                bad.append(f"split size {dist.get_world_size(group)}")
            if dist.get_rank(group) != mine.index(rank):
                bad.append(f"split rank {dist.get_rank(group)}, want {mine.index(rank)}")
            t = torch.full((1000,), float(rank + 1))
            dist.all_reduce(t, group=group)
            want = float(sum(r + 1 for r in mine))
            if not torch.equal(t, torch.full((1000,), want)):
                bad.append(f"split all_reduce {t[0].item()}, want {want}")
            if len(mine) > 1:
                # The split's rank 0 (global 3) sends to its rank 2 (global 2), by global rank.
                if rank == 3:
                    dist.send(torch.arange(10.0), dst=2, group=group)
                elif rank == 2:
                    got = torch.zeros(10)
                    dist.recv(got, src=3, group=group)
                    if not torch.equal(got, torch.arange(10.0)):
                        bad.append("send within the split")
            if backend == "ferroce" and not isinstance(group._get_backend(torch.device("cpu")),
                                                       ferroce.torch.ProcessGroupFerroce):
                bad.append("the split's backend is not ferroce's")
        # The parent, and a group made the other way, still work.
        t = torch.ones(3)
        dist.all_reduce(t)
        if not torch.equal(t, torch.full((3,), float(size))):
            bad.append("parent all_reduce after the split")
        evens = dist.new_group([r for r in range(size) if r % 2 == 0])
        if rank % 2 == 0:
            t = torch.ones(3)
            dist.all_reduce(t, group=evens)
            if not torch.equal(t, torch.full((3,), float((size + 1) // 2))):
                bad.append("new_group all_reduce")
        dist.barrier()
        dist.destroy_process_group()
    except Exception as err:
        bad.append(f"{type(err).__name__}: {err}")
    results.put((rank, bad))
