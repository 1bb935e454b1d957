"""The body of one rank for test_torch.py's abort test (spawned processes)."""

import os


def abort(rank, size, port, results):
    """ProcessGroup.abort() on rank 0 while an irecv is in flight and an all_reduce waits
    behind it for rank 1 (which joins a second later): both Works fail at once, naming the
    abort, and rank 1's operations fail at
    once too instead of at the 60 s timeout; destroy_process_group (the backend's shutdown)
    then returns at once on both."""
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
                                timeout=datetime.timedelta(seconds=60))
        dist.barrier()
        t = torch.ones(1000)
        if rank == 0:
            # A receive in flight (rank 1 never sends) and an all_reduce queued behind it.
            r = dist.irecv(torch.zeros(10), src=1)
            w = dist.all_reduce(t, async_op=True)
            time.sleep(0.3)
            start = time.monotonic()
            dist.group.WORLD.abort()
            for what, work in (("irecv", r), ("all_reduce", w)):
                try:
                    work.wait()
                    bad.append(f"the {what} under way completed after the abort")
                except Exception as e:  # DistBackendError
                    if "abort" not in str(e):
                        bad.append(f"the aborted {what} failed with {type(e).__name__}: {e}")
            if time.monotonic() - start > 5:
                bad.append(f"abort took {time.monotonic() - start:.1f} s")
        else:
            time.sleep(1.0)
            start = time.monotonic()
            # Rank 0's bytes of the aborted call may be here already and complete the first.
            for _ in range(2):
                try:
                    dist.all_reduce(t)
                except Exception as e:
                    if type(e).__name__ != "DistBackendError":
                        bad.append(f"rank 1 failed with {type(e).__name__}: {e}")
                    break
            else:
                bad.append("rank 1's all_reduces with an aborted peer succeeded")
            if time.monotonic() - start > 5:
                bad.append(f"rank 1 waited {time.monotonic() - start:.1f} s for its failure")
        start = time.monotonic()
        dist.destroy_process_group()
        if time.monotonic() - start > 5:
            bad.append(f"destroy_process_group took {time.monotonic() - start:.1f} s")
    except Exception as err:
        bad.append(f"{type(err).__name__}: {err}")
    results.put((rank, bad))
