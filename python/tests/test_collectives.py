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


def lone_communicator():
    """A job of one rank, in this process (its endpoint exchange is the identity)."""
    from ferroce.collectives import Communicator

    return Communicator(timeout=5, rank=0, size=1, exchange=lambda card: [card])


def test_the_extension_takes_no_addresses():
    """The extension's collectives take objects with the buffer protocol and nothing else:
    an address (an int), an (address, length) pair or an object without a buffer is refused
    with an exception before anything is read or written (it once took raw addresses, so any
    Python code could have it read or write anywhere)."""
    import numpy as np

    comm = lone_communicator()
    raw = comm._c
    wild = 0xDEAD0000
    victim = np.arange(8, dtype=np.float32)
    attempts = [
        lambda: raw._allreduce(wild, "float", "sum"),
        lambda: raw._allreduce(victim.ctypes.data, "float", "sum"),
        lambda: raw._broadcast(wild, 0),
        lambda: raw._send(wild, 0),
        lambda: raw._recv(wild, 0),
        lambda: raw._allgather((wild, 64), (wild + 64, 64)),
        lambda: raw._allgather(victim, (victim.ctypes.data, victim.nbytes)),
        lambda: raw._reduce_scatter((wild, 64), victim, "float", "sum"),
        lambda: raw._alltoall(object(), victim),
    ]
    for attempt in attempts:
        with pytest.raises(BufferError, match="must be a C-contiguous") as err:
            attempt()
        assert isinstance(err.value.__cause__, TypeError)
    # The old signatures, (address, length, ...), are gone.
    with pytest.raises(TypeError):
        raw._send(victim.ctypes.data, victim.nbytes, 0)
    assert np.array_equal(victim, np.arange(8, dtype=np.float32))


def test_overlapping_input_and_output_are_refused():
    """An input and an output sharing memory (the same array, or two slices of one) are
    refused with ValueError before the collective runs: ferroce-coll would read bytes it is
    writing, and Rust may not hold both views. Nothing is written."""
    import numpy as np

    comm = lone_communicator()
    base = np.arange(12, dtype=np.float32)
    keep = base.copy()
    cases = [
        ("allgather, same array", lambda: comm.allgather(base, base)),
        ("allgather, slices", lambda: comm.allgather(base[0:8], base[4:12])),
        ("allgather, one byte", lambda: comm.allgather(base[0:6], base[5:11])),
        ("reduce_scatter", lambda: comm.reduce_scatter(base[2:10], base[0:8])),
        ("alltoall", lambda: comm.alltoall(base[4:12], base[0:8])),
        ("alltoall, via memoryview", lambda: comm.alltoall(memoryview(base)[1:5], base[0:4])),
    ]
    for what, case in cases:
        with pytest.raises(ValueError, match="overlap"):
            case()
        assert np.array_equal(base, keep), what
    # Adjacent but disjoint is fine: allgather of one rank copies the input over.
    comm.allgather(base[0:6], base[6:12])
    assert np.array_equal(base[6:12], keep[0:6])


def test_unfit_buffers_are_refused():
    """A read-only output, and a buffer that is not C-contiguous, are refused with BufferError
    (the exporter is asked for a writable, C-contiguous buffer and its answer checked)."""
    import numpy as np

    comm = lone_communicator()
    with pytest.raises(BufferError, match="writable"):
        comm.allreduce(b"\x01\x02\x03\x04", dtype="uint8")
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(BufferError, match="writable"):
        comm.recv(ro, 0)
    with pytest.raises(BufferError, match="C-contiguous"):
        comm.allreduce(np.zeros((4, 4), np.float32)[:, 1])
    with pytest.raises(BufferError, match="C-contiguous"):
        comm.allgather(np.zeros(8, np.float32)[::2], np.zeros(4, np.float32))
    # A read-only input is fine, read in place.
    out = bytearray(4)
    comm.allgather(b"abcd", out)
    assert out == b"abcd"
