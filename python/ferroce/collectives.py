"""Collectives on buffers: ferroce-coll's communicator from Python.

Any C-contiguous object with the buffer protocol works (numpy arrays, ``bytearray``,
``memoryview``, ``array.array``); results land in the caller's buffers with no copy. The element
type comes from the buffer's format (float32, float64, float16, int32, int64, uint8) or the
``dtype`` argument ("float", "double", "half", "bfloat16", "int32", "int64", "uint8"; bfloat16
has no buffer format: pass its bytes, e.g. a numpy ``uint16`` view, with ``dtype="bfloat16"``).
Operators are "sum", "prod", "min", "max" and "avg". The GIL is released while a collective runs.

The objects themselves go to the extension, which takes their bytes through the buffer protocol
and holds them (exported, so neither freed nor resized) for the call: no address passes through
Python. A buffer that is not C-contiguous, an output that is read-only, and an input that shares
memory with the output are refused with an exception (``BufferError``, ``ValueError``).

    from ferroce.collectives import Communicator
    comm = Communicator()          # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun's)
    comm.allreduce(grads, op="avg")
"""

from . import _ferroce

CollectiveError = _ferroce.CollectiveError

_FLOAT = {2: "half", 4: "float", 8: "double"}
_INT = {4: "int32", 8: "int64"}


def _dtype(buf, dtype):
    if dtype is not None:
        return dtype
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    fmt = view.format.lstrip("@=<")
    size = view.itemsize
    if fmt in ("e", "f", "d") and size in _FLOAT:
        return _FLOAT[size]
    if fmt in ("i", "l", "q", "n") and size in _INT:
        return _INT[size]
    if fmt in ("B", "c") and size == 1:
        return "uint8"
    raise TypeError(
        f"no ferroce element type for buffer format {view.format!r} (itemsize {size}): "
        "pass dtype=..."
    )


class Communicator:
    """The ranks of a job, joined from torchrun's environment (or mpirun's), or through
    ``exchange`` (a callable taking this rank's bytes and returning every rank's) with
    ``rank`` and ``size``."""

    def __init__(self, timeout=30.0, provider=None, device=None, *, rank=None, size=None,
                 exchange=None, master=None):
        if exchange is None:
            self._c = _ferroce.Communicator.from_env(timeout, provider, device)
        else:
            self._c = _ferroce.Communicator.from_exchange(
                rank, size, exchange, timeout, provider, device, master
            )

    @property
    def rank(self):
        return self._c.rank

    @property
    def size(self):
        return self._c.size

    def allreduce(self, buf, op="sum", dtype=None):
        """Reduces ``buf`` in place over every rank."""
        self._c._allreduce(buf, _dtype(buf, dtype), op)

    def allgather(self, inp, out):
        """Gathers every rank's ``inp`` into ``out`` (rank order)."""
        self._c._allgather(inp, out)

    def reduce_scatter(self, inp, out, op="sum", dtype=None):
        """Reduces ``inp`` (size blocks) over every rank; ``out`` gets this rank's block."""
        self._c._reduce_scatter(inp, out, _dtype(out, dtype), op)

    def broadcast(self, buf, root=0):
        """Copies rank ``root``'s ``buf`` into every rank's."""
        self._c._broadcast(buf, root)

    def alltoall(self, inp, out):
        """Block j of ``inp`` goes to rank j; block i of ``out`` comes from rank i."""
        self._c._alltoall(inp, out)

    def send(self, buf, peer):
        """Sends ``buf`` to rank ``peer`` (which calls ``recv`` with as many bytes)."""
        self._c._send(buf, peer)

    def recv(self, buf, peer):
        """Receives into ``buf`` what rank ``peer`` sends."""
        self._c._recv(buf, peer)

    def barrier(self):
        """Waits until every rank called it."""
        self._c.barrier()
