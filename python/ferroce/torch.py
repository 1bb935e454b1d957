"""A torch.distributed backend over ferroce: ``import ferroce.torch`` registers ``"ferroce"``.

    import torch.distributed as dist
    import ferroce.torch  # noqa: F401
    dist.init_process_group("ferroce")     # under torchrun

CPU tensors' all_reduce, all_gather, broadcast, reduce_scatter, send/recv and barrier run over
ferroce's collectives (shared memory between ranks on a host, RoCE v2 over UDP between
hosts); DistributedDataParallel works with it. The endpoints are exchanged through
torch.distributed's own store, so it needs nothing but the rendezvous torch already has.
Each operation completes before it returns (its ``Work`` is already done). The tensor-based
variants (``all_gather_into_tensor``, ``reduce_scatter_tensor``) are not reachable from a
ProcessGroup written in Python in current torch (it looks for a C++ backend for them).
"""

import itertools
import os

import torch
import torch.distributed as dist

from . import _ferroce

_DTYPES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "half",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
}

_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.AVG: "avg",
}

_generation = itertools.count()


def _dtype(t):
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise TypeError(f"ferroce has no element type for {t.dtype}") from None


def _op(reduce_op):
    for k, v in _OPS.items():
        if reduce_op == k:
            return v
    raise ValueError(f"ferroce has no reduction {reduce_op}")


def _raw(t):
    if t.device.type != "cpu":
        raise ValueError("the ferroce backend takes CPU tensors")
    return t.data_ptr(), t.numel() * t.element_size()


class _Done(dist._Work):
    """A finished operation (ferroce's run to completion before they return)."""

    def __init__(self, result):
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def get_future(self):
        return self._future


def _in_place(t, run):
    """Runs ``run`` on a contiguous tensor holding ``t``, and copies back if that was a copy."""
    c = t if t.is_contiguous() else t.contiguous()
    run(c)
    if c is not t:
        t.copy_(c)


class ProcessGroupFerroce(dist.ProcessGroup):
    """A process group whose collectives are ferroce's."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        gen = next(_generation)

        def exchange(card, _round=itertools.count()):
            key = f"ferroce/{gen}/{next(_round)}"
            store.set(f"{key}/{rank}", bytes(card))
            return [bytes(store.get(f"{key}/{r}")) for r in range(size)]

        self._comm = _ferroce.Communicator.from_exchange(
            rank,
            size,
            exchange,
            timeout.total_seconds(),
            None,
            os.environ.get("FERROCE_DEVICE"),
            os.environ.get("MASTER_ADDR"),
        )

    def getBackendName(self):
        return "ferroce"

    def allreduce(self, tensors, opts):
        op = _op(opts.reduceOp)
        for t in tensors:
            _in_place(t, lambda c: self._comm._allreduce(*_raw(c), _dtype(c), op))
        return _Done(tensors)

    def broadcast(self, tensors, opts):
        for t in tensors:
            _in_place(t, lambda c: self._comm._broadcast(*_raw(c), opts.rootRank))
        return _Done(tensors)

    def allgather(self, output_tensors, input_tensors, opts):
        for outs, inp in zip(output_tensors, input_tensors):
            inp = inp.contiguous()
            gathered = torch.empty((self.size(),) + tuple(inp.shape), dtype=inp.dtype)
            self._comm._allgather(_raw(inp), _raw(gathered))
            for o, g in zip(outs, gathered):
                o.copy_(g)
        return _Done(output_tensors)

    def _allgather_base(self, output, inp, opts):
        _in_place(output, lambda c: self._comm._allgather(_raw(inp.contiguous()), _raw(c)))
        return _Done(output)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        op = _op(opts.reduceOp)
        for out, ins in zip(output_tensors, input_tensors):
            whole = torch.cat([i.contiguous().reshape(-1) for i in ins])
            _in_place(out, lambda c: self._comm._reduce_scatter(
                _raw(whole), _raw(c), _dtype(c), op))
        return _Done(output_tensors)

    def _reduce_scatter_base(self, output, inp, opts):
        op = _op(opts.reduceOp)
        _in_place(output, lambda c: self._comm._reduce_scatter(
            _raw(inp.contiguous()), _raw(c), _dtype(c), op))
        return _Done(output)

    def alltoall_base(self, output, inp, output_split_sizes, input_split_sizes, opts):
        if output_split_sizes or input_split_sizes:
            raise ValueError("the ferroce backend takes equal splits only")
        _in_place(output, lambda c: self._comm._alltoall(_raw(inp.contiguous()), _raw(c)))
        return _Done(output)

    def send(self, tensors, dst, tag):
        for t in tensors:
            self._comm._send(*_raw(t.contiguous()), dst)
        return _Done(tensors)

    def recv(self, tensors, src, tag):
        for t in tensors:
            _in_place(t, lambda c: self._comm._recv(*_raw(c), src))
        return _Done(tensors)

    def barrier(self, opts):
        self._comm.barrier()
        return _Done([])


def _create(store, rank, size, timeout):
    return ProcessGroupFerroce(store, rank, size, timeout)


dist.Backend.register_backend("ferroce", _create, devices=["cpu"])
