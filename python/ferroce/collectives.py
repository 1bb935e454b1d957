"""Collectives on buffers: ferroce-coll's communicator from Python.

Any C-contiguous object with the buffer protocol works (numpy arrays, ``bytearray``,
``memoryview``, ``array.array``); results land in the caller's buffers with no copy. The element
type comes from the buffer's format (float32, float64, float16, int32, int64, uint8) or the
``dtype`` argument ("float", "double", "half", "bfloat16", "int32", "int64", "uint8"; bfloat16
has no buffer format: pass its bytes, e.g. a numpy ``uint16`` view, with ``dtype="bfloat16"``).
Operators are "sum", "prod", "min", "max" and "avg". The GIL is released while a collective runs.

    from ferroce.collectives import Communicator
    comm = Communicator()          # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun's)
    comm.allreduce(grads, op="avg")
"""

import ctypes

from . import _ferroce

CollectiveError = _ferroce.CollectiveError

_FLOAT = {2: "half", 4: "float", 8: "double"}
_INT = {4: "int32", 8: "int64"}


def _dtype(view, dtype):
    if dtype is not None:
        return dtype
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


class _Held:
    """A buffer's address and length, with what keeps it exported while a collective runs."""

    def __init__(self, obj, writable):
        view = obj if isinstance(obj, memoryview) else memoryview(obj)
        if not view.c_contiguous:
            raise ValueError("the buffer is not C-contiguous")
        self.view = view
        self.len = view.nbytes
        self.copy = None
        if self.len == 0:
            self.ptr = 0
            return
        if not view.readonly:
            self._keep = (ctypes.c_char * self.len).from_buffer(view)
            self.ptr = ctypes.addressof(self._keep)
        elif writable:
            raise ValueError("the buffer is read-only")
        else:
            # A read-only input (bytes, say) has no address ctypes will give: read it from a
            # copy.
            self.copy = bytearray(view.cast("B"))
            self._keep = (ctypes.c_char * self.len).from_buffer(self.copy)
            self.ptr = ctypes.addressof(self._keep)

    @property
    def raw(self):
        return (self.ptr, self.len)


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
        h = _Held(buf, True)
        self._c._allreduce(h.ptr, h.len, _dtype(h.view, dtype), op)

    def allgather(self, inp, out):
        """Gathers every rank's ``inp`` into ``out`` (rank order)."""
        i, o = _Held(inp, False), _Held(out, True)
        self._c._allgather(i.raw, o.raw)

    def reduce_scatter(self, inp, out, op="sum", dtype=None):
        """Reduces ``inp`` (size blocks) over every rank; ``out`` gets this rank's block."""
        i, o = _Held(inp, False), _Held(out, True)
        self._c._reduce_scatter(i.raw, o.raw, _dtype(o.view, dtype), op)

    def broadcast(self, buf, root=0):
        """Copies rank ``root``'s ``buf`` into every rank's."""
        h = _Held(buf, True)
        self._c._broadcast(h.ptr, h.len, root)

    def alltoall(self, inp, out):
        """Block j of ``inp`` goes to rank j; block i of ``out`` comes from rank i."""
        i, o = _Held(inp, False), _Held(out, True)
        self._c._alltoall(i.raw, o.raw)

    def send(self, buf, peer):
        """Sends ``buf`` to rank ``peer`` (which calls ``recv`` with as many bytes)."""
        h = _Held(buf, False)
        self._c._send(h.ptr, h.len, peer)

    def recv(self, buf, peer):
        """Receives into ``buf`` what rank ``peer`` sends."""
        h = _Held(buf, True)
        self._c._recv(h.ptr, h.len, peer)

    def barrier(self):
        """Waits until every rank called it."""
        self._c.barrier()
