"""The body of one rank for test_torch.py's point-to-point test (spawned processes): torch's
isend/irecv in flight together, as gloo's are."""

import os

# More than ferroce-coll's slots to a peer (4 MiB): a send of this many bytes cannot finish
# until the peer receives.
BIG = 6 << 20


def _values(seed, n):
    import torch

    return torch.arange(n, dtype=torch.float32) * 3 + seed


def point_to_point(rank, size, port, results):
    """isend and irecv started in any order and left in flight together: every rank receives
    first and then sends (a blocking send/recv pair would wait for ever), both ways beyond the
    peer's slots, around a ring, into a column view, several to one peer in order, a send
    not complete before its peer receives, a collective queued behind them, tags, and the
    waiting dist.send/dist.recv meeting them. Every element is checked."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import time

    import torch
    import torch.distributed as dist

    import ferroce.torch  # noqa: F401

    bad = []
    n = BIG // 4
    right, left = (rank + 1) % size, (rank - 1) % size
    try:
        dist.init_process_group("ferroce", rank=rank, world_size=size)

        # Receive first, then send, around the ring (with 2 ranks: both ways between them).
        got = torch.zeros(n)
        r = dist.irecv(got, src=left)
        s = dist.isend(_values(rank, n), dst=right)
        s.wait()
        r.wait()
        if not torch.equal(got, _values(left, n)):
            bad.append("receive-first ring: wrong values")

        # Sends first, both ways, each beyond the peer's slots.
        got = torch.zeros(n)
        s = dist.isend(_values(10 + rank, n), dst=right)
        r = dist.irecv(got, src=left)
        r.wait()
        s.wait()
        if not torch.equal(got, _values(10 + left, n)):
            bad.append("send-first ring: wrong values")

        # Into a column of a matrix (not contiguous), and three sends of different lengths to
        # one peer, received in the order they were sent.
        grid = torch.full((n // 64, 2), -1.0)
        lens = [n // 64, 5, 1 << 20]
        outs = [_values(20 + i + rank, k) for i, k in enumerate(lens)]
        ins = [grid[:, 1]] + [torch.zeros(k) for k in lens[1:]]
        reqs = [dist.irecv(t, src=left) for t in ins]
        reqs += [dist.isend(t, dst=right) for t in outs]
        for q in reqs:
            q.wait()
        for i, k in enumerate(lens):
            if not torch.equal(ins[i], _values(20 + i + left, k)):
                bad.append(f"message {i} of three in order: wrong values")
        if not torch.equal(grid[:, 0], torch.full((n // 64,), -1.0)):
            bad.append("the column's neighbour was written")

        # A send beyond the slots is not complete before its peer receives; an all_reduce
        # queued behind it runs once it is.
        if rank == 0:
            s = dist.isend(_values(30, n), dst=1)
            time.sleep(0.3)
            if s.is_completed():
                bad.append("a 6 MiB isend completed before its receive was posted")
        elif rank == 1:
            time.sleep(0.6)
            got = torch.zeros(n)
            dist.recv(got, src=0)
            if not torch.equal(got, _values(30, n)):
                bad.append("dist.recv of an isend: wrong values")
        x = torch.ones(4)
        dist.all_reduce(x)
        if rank == 0:
            s.wait()
            if not s.is_completed():
                bad.append("the isend is not completed after wait()")
        if not torch.equal(x, torch.full((4,), float(size))):
            bad.append("all_reduce after the sends")

        # Tags: two sends to one peer with tags 5 and 7, received by tag (in order), and a
        # receive from any source that takes only its tag (rank 0's tag-2 send comes first;
        # the tag-3 receive waits for the last rank's).
        a, b = torch.zeros(100), torch.zeros(n)
        reqs = [dist.irecv(a, src=left, tag=5), dist.irecv(b, src=left, tag=7)]
        reqs += [dist.isend(_values(50 + rank, 100), dst=right, tag=5),
                 dist.isend(_values(60 + rank, n), dst=right, tag=7)]
        for q in reqs:
            q.wait()
        if not (torch.equal(a, _values(50 + left, 100)) and torch.equal(b, _values(60 + left, n))):
            bad.append("tagged sends: wrong values")
        if size > 2:
            if rank == 1:
                got2, got3 = torch.zeros(10), torch.zeros(10)
                src3 = dist.recv(got3, tag=3)
                src2 = dist.recv(got2, tag=2)
                if (src3, src2) != (size - 1, 0):
                    bad.append(f"receives from any source by tag came from {src3}, {src2}")
                if not (torch.equal(got3, _values(3, 10)) and torch.equal(got2, _values(2, 10))):
                    bad.append("receives from any source by tag: wrong values")
            elif rank == 0:
                dist.send(_values(2, 10), dst=1, tag=2)
            elif rank == size - 1:
                time.sleep(0.3)
                dist.send(_values(3, 10), dst=1, tag=3)

        # dist.send (which waits) meets irecv.
        if rank == 0:
            dist.send(_values(40, 1000), dst=1)
        elif rank == 1:
            got = torch.zeros(1000)
            dist.irecv(got, src=0).wait()
            if not torch.equal(got, _values(40, 1000)):
                bad.append("irecv of a dist.send: wrong values")
        dist.barrier()
        dist.destroy_process_group()
    except Exception as err:
        bad.append(f"{type(err).__name__}: {err}")
    results.put((rank, bad))
