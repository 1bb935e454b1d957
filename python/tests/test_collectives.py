"""Collectives from Python between ranks that are separate processes joined from torchrun's
environment: every operation against numpy's result, every type, sizes 0, 1, odd and several
slots, 1 to 4 ranks; bytes-like objects of every kind; errors raised as CollectiveError."""

import multiprocessing as mp
import os
import socket
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import _ranks  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_collective_matches_numpy(size):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ranks.run, args=(r, size, port, results)) for r in range(size)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(30)
    for rank in range(size):
        assert got[rank] == [], f"rank {rank}: {got[rank]}"


def test_a_communicator_without_a_job_is_an_error():
    from ferroce.collectives import CollectiveError, Communicator

    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           if k in os.environ}
    try:
        with pytest.raises(CollectiveError, match="RANK"):
            Communicator(timeout=1)
    finally:
        os.environ.update(env)
