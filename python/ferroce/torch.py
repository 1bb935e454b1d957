"""A torch.distributed backend over ferroce: ``import ferroce.torch`` registers ``"ferroce"``.

    import torch.distributed as dist
    import ferroce.torch  # noqa: F401
    dist.init_process_group("ferroce")     # under torchrun

CPU tensors' all_reduce, all_gather, all_gather_into_tensor, broadcast, reduce_scatter,
reduce_scatter_tensor, all_to_all, all_to_all_single (equal splits, and uneven ones pairwise),
send/recv and barrier run over ferroce's collectives (shared memory between ranks on a host,
RoCE v2 over UDP between hosts); where ferroce is a c10d Backend (below), reduce, gather,
scatter, all_reduce_coalesced, all_gather_coalesced and monitored_barrier too (older torch's
ProcessGroup has no reduce, gather or scatter a Python group can override).
DistributedDataParallel works with it. The endpoints are exchanged through
torch.distributed's own store, so it needs nothing but the rendezvous torch already has.
Each operation is queued to the group's worker thread and returns its ``Work`` at once:
``wait()`` blocks until it ran and raises its error, ``get_future()`` completes with its result
or error, so ``async_op=True`` overlaps and DDP's all_reduces overlap the backward pass
(``FERROCE_TORCH_SYNC=1`` runs each in the caller instead). ``is_completed()`` on the Work
torch hands back stays False: torch's wrapper of a Python Work forwards only ``wait`` and
``get_future`` (``get_future().done()`` tells). Older torch
reaches the tensor-based variants only from a C++ backend; newer torch calls them here under
their ``*_single`` names.

With torch whose c10d ``Backend`` Python can subclass (2.15; not 2.11), ferroce is a backend
for CPU tensors under torch's own group, so ``init_process_group("cpu:ferroce,cuda:nccl")``
keeps NCCL for CUDA tensors (``ROUTES_BY_DEVICE`` says which).

Tensors of any layout work (column slices, transposes, step slices): a non-contiguous tensor
goes through a contiguous copy, copied back where the operation writes it. A tensor reaches
the extension only as numpy's view of it (``_buf``; numpy must be installed), which holds the
tensor: the extension takes the bytes through the buffer protocol and holds them for the call,
so no address passes through Python and no temporary can be freed while it is read. An input
that shares memory with the output (an in-place ``all_gather_into_tensor``) is cloned first.
"""

import functools
import itertools
import os
import queue
import threading

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend

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


def _dtype(t):
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise TypeError(f"ferroce has no element type for {t.dtype}") from None


def _op(reduce_op):
    if isinstance(reduce_op, str):  # already converted (see `_Opts`)
        return reduce_op
    for k, v in _OPS.items():
        if reduce_op == k:
            return v
    raise ValueError(f"ferroce has no reduction {reduce_op}")


def _buf(t):
    """The object the extension reads or writes ``t`` through: numpy's view of the contiguous
    CPU tensor ``t`` (made by torch, which takes its address and length itself; bfloat16,
    which numpy lacks, as int16 of the same bits). The view holds ``t``, so ``t`` and its
    memory live as long as the view does; the extension holds the view's buffer for the whole
    call. This is the only way a tensor reaches the extension: no address is handled here, so
    a temporary (``t.contiguous()`` of a strided tensor) cannot be freed while a collective
    reads it."""
    if t.device.type != "cpu":
        raise ValueError("the ferroce backend takes CPU tensors")
    if not t.is_contiguous():
        raise ValueError("internal: a non-contiguous tensor reached ferroce's _buf")
    if t.requires_grad:
        t = t.detach()  # (only then: detach costs a microsecond per call)
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def _apart(inp, out):
    """``inp`` contiguous and sharing no memory with ``out`` (cloned when it does, as in
    torch's in-place ``all_gather_into_tensor(out, out.chunk(size)[rank])``): the extension
    refuses an input that overlaps the output."""
    same = inp.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    if same and inp.numel() > 0 and out.numel() > 0:
        return inp.clone(memory_format=torch.contiguous_format)
    return inp.contiguous()


class _Pending(dist._Work):
    """An operation queued to its group's worker (see `_Worker`): ``wait()`` blocks until it
    ran and raises what it raised; ``get_future()`` completes with its result or its error."""

    def __init__(self):
        super().__init__()
        self._done = threading.Event()
        self._settled = threading.Event()
        self._finisher = None
        self._error = None
        self._future = torch.futures.Future()

    def _finish(self, result, error):
        self._error = error
        self._finisher = threading.current_thread()
        # The operation is done before its future completes: the callbacks the future runs
        # (in this thread) may wait on this work.
        self._done.set()
        try:
            if error is None:
                self._future.set_result(result)
            else:
                self._future.set_exception(error)
        finally:
            self._settled.set()

    def wait(self, timeout=None):
        # torch passes a timedelta; zero (kNoTimeout) means none.
        secs = timeout.total_seconds() if timeout is not None else 0
        if not self._done.wait(secs if secs > 0 else None):
            raise RuntimeError(f"ferroce: the operation did not finish within {secs} s")
        if threading.current_thread() is not self._finisher:
            # Elsewhere, return once the future completed too (as gloo's wait does), unless
            # this is a callback of that future, in the thread completing it.
            self._settled.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        return self._done.is_set()

    def is_success(self):
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        return self._future


#: Runs every operation in the calling thread before it returns (the behaviour before
#: operations were queued), for comparison: ``FERROCE_TORCH_SYNC=1``.
_SYNC = os.environ.get("FERROCE_TORCH_SYNC", "0") not in ("", "0")


class _Worker:
    """One thread per group that runs the group's operations one at a time, in the order they
    were called, as gloo's and NCCL's work queues do: a call returns at once with a
    `_Pending`, so DDP's gradient all_reduces overlap the rest of the backward pass (the
    extension lets go of the GIL while bytes move). The communicator is used from this
    thread alone. The thread holds the queue, not the group, so the group can be freed; it
    stops at the ``None`` the group's finalizer puts."""

    def __init__(self):
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_Worker._run, args=(self._jobs,), name="ferroce-pg", daemon=True)
        self._thread.start()

    @staticmethod
    def _run(jobs):
        while True:
            job = jobs.get()
            if job is None:
                return
            work, run = job
            try:
                result = run()
            except BaseException as e:  # noqa: B036 (handed to the waiter, not swallowed)
                work._finish(None, e)
            else:
                work._finish(result, None)
            del job, work, run

    def submit(self, run):
        work = _Pending()
        if _SYNC:
            try:
                result = run()
            except BaseException as e:  # noqa: B036
                work._finish(None, e)
            else:
                work._finish(result, None)
        else:
            self._jobs.put((work, run))
        return work

    def stop(self):
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()


class _Opts:
    """The fields of a c10d options object that the operations read, copied when the operation
    is called: the object torch passes can refer to C++ memory that is gone once the call
    returns, and the operation runs later, on the group's worker."""

    def __init__(self, opts):
        if hasattr(opts, "reduceOp"):
            self.reduceOp = _op(opts.reduceOp)
        if hasattr(opts, "rootRank"):
            self.rootRank = int(opts.rootRank)
        if hasattr(opts, "timeout"):
            self.timeout = opts.timeout  # a timedelta: a copy


def _queued(operation):
    """Makes a group method an operation queued to the group's worker: its arguments are
    taken now (options copied, see `_Opts`), it runs later, and the call returns its Work."""

    @functools.wraps(operation)
    def call(self, *args, **kwargs):
        args = tuple(_Opts(a) if type(a).__name__.endswith("Options") else a for a in args)
        return self._worker.submit(lambda: operation(self, *args, **kwargs))

    return call


def _unflatten(flat, tensors):
    """Copies consecutive pieces of the 1-D ``flat`` into ``tensors``, in order."""
    at = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[at:at + n].view(t.shape))
        at += n


def _in_place(t, run):
    """Runs ``run`` on a contiguous tensor holding ``t``, and copies back if that was a copy."""
    c = t if t.is_contiguous() else t.contiguous()
    run(c)
    if c is not t:
        t.copy_(c)


def _backend_is_subclassable():
    """Whether this torch's c10d ``Backend`` can be built from Python (torch 2.15's can; 2.11's
    has no Python constructor: "No constructor defined!")."""

    class _Probe(_C10dBackend):
        pass

    try:
        _Probe(0, 1)
    except TypeError as e:
        if "No constructor defined" not in str(e):
            raise
        return False
    return True


#: Whether torch routes each device's tensors to its own backend under a device string such as
#: ``"cpu:ferroce,cuda:nccl"``: True where ferroce is a c10d ``Backend`` (torch whose
#: ``Backend`` Python can subclass). Elsewhere ferroce is a whole ``ProcessGroup``, which torch
#: puts in place of the group it built, so every device's tensors come here (a CUDA tensor
#: then fails with "the ferroce backend takes CPU tensors").
ROUTES_BY_DEVICE = _backend_is_subclassable()

_Base = _C10dBackend if ROUTES_BY_DEVICE else dist.ProcessGroup


class ProcessGroupFerroce(_Base):
    """ferroce's collectives as a c10d ``Backend`` of a torch ``ProcessGroup``.

    A backend, not a ``ProcessGroup`` subclass, wherever torch allows it (see
    ``ROUTES_BY_DEVICE``): torch takes a ``ProcessGroup`` that a backend's creator hands back
    as the whole group, in place of the group it built, so ``"cpu:ferroce,cuda:nccl"`` sent
    CUDA tensors here too, and the group had no name (FSDP2 stops at "ProcessGroup name not
    set"). A backend is registered for the CPU alone, under torch's own group, which routes
    each tensor to the backend of its device and names itself as any group does."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)

        # torch gives each group's backend a store of its own (a prefix of the group's name
        # and device), so the keys need no group number: a per-process counter of groups
        # went wrong for groups of some ranks, which the others never create.
        def exchange(card, _round=itertools.count()):
            key = f"ferroce/{next(_round)}"
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

        self._worker = _Worker()

    def __del__(self):
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.stop()

    def getBackendName(self):
        return "ferroce"

    @_queued
    def allreduce(self, tensors, opts):
        op = _op(opts.reduceOp)
        for t in tensors:
            _in_place(t, lambda c: self._comm._allreduce(_buf(c), _dtype(c), op))
        return tensors

    @_queued
    def broadcast(self, tensors, opts):
        for t in tensors:
            _in_place(t, lambda c: self._comm._broadcast(_buf(c), opts.rootRank))
        return tensors

    @_queued
    def allgather(self, output_tensors, input_tensors, opts):
        for outs, inp in zip(output_tensors, input_tensors):
            inp = inp.contiguous()
            gathered = torch.empty((self.size(),) + tuple(inp.shape), dtype=inp.dtype)
            self._comm._allgather(_buf(inp), _buf(gathered))
            for o, g in zip(outs, gathered):
                o.copy_(g)
        return output_tensors

    @_queued
    def _allgather_base(self, output, inp, opts):
        _in_place(output, lambda c: self._comm._allgather(_buf(_apart(inp, c)), _buf(c)))
        return output

    # Newer torch dispatches all_gather_into_tensor here.
    all_gather_single = _allgather_base

    @_queued
    def reduce_scatter(self, output_tensors, input_tensors, opts):
        op = _op(opts.reduceOp)
        for out, ins in zip(output_tensors, input_tensors):
            whole = torch.cat([i.reshape(-1) for i in ins])
            _in_place(out, lambda c: self._comm._reduce_scatter(
                _buf(whole), _buf(c), _dtype(c), op))
        return output_tensors

    @_queued
    def _reduce_scatter_base(self, output, inp, opts):
        op = _op(opts.reduceOp)
        _in_place(output, lambda c: self._comm._reduce_scatter(
            _buf(_apart(inp, c)), _buf(c), _dtype(c), op))
        return output

    # Newer torch dispatches reduce_scatter_tensor here.
    reduce_scatter_single = _reduce_scatter_base

    @_queued
    def alltoall_base(self, output, inp, output_split_sizes, input_split_sizes, opts):
        if output_split_sizes or input_split_sizes:
            self._alltoall_uneven(output, inp, output_split_sizes, input_split_sizes)
        else:
            _in_place(output, lambda c: self._comm._alltoall(_buf(_apart(inp, c)), _buf(c)))
        return output

    # Newer torch dispatches all_to_all_single here.
    all_to_all_single = alltoall_base

    @_queued
    def alltoall(self, output_tensors, input_tensors, opts):
        # One tensor per rank each way: of one size, ferroce's alltoall; else pairwise.
        sizes = {t.numel() for t in list(input_tensors) + list(output_tensors)}
        if len(sizes) > 1:
            send = [t.contiguous() for t in input_tensors]
            recv = [t if t.is_contiguous() else t.contiguous() for t in output_tensors]
            self._exchange_blocks([t.reshape(-1) for t in send], [t.reshape(-1) for t in recv])
            for o, c in zip(output_tensors, recv):
                if c is not o:
                    o.copy_(c)
            return output_tensors
        inp = torch.cat([i.reshape(-1) for i in input_tensors])
        out = torch.empty_like(inp)
        self._comm._alltoall(_buf(inp), _buf(out))
        for o, block in zip(output_tensors, out.chunk(self.size())):
            o.copy_(block.view(o.shape))
        return output_tensors

    @_queued
    def send(self, tensors, dst, tag):
        for t in tensors:
            self._comm._send(_buf(t.contiguous()), dst)
        return tensors

    @_queued
    def recv(self, tensors, src, tag):
        for t in tensors:
            _in_place(t, lambda c: self._comm._recv(_buf(c), src))
        return tensors

    @_queued
    def barrier(self, opts):
        self._comm.barrier()
        return []

    @_queued
    def reduce(self, tensors, opts):
        op = _op(opts.reduceOp)
        for t in tensors:
            _in_place(t, lambda c: self._comm._reduce(_buf(c), _dtype(c), op, opts.rootRank))
        return tensors

    @_queued
    def allreduce_coalesced(self, tensors, opts):
        # One reduction of them all, flattened (gloo's too needs one dtype).
        if len({t.dtype for t in tensors}) > 1:
            raise ValueError("all_reduce_coalesced takes tensors of one dtype")
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._comm._allreduce(_buf(flat), _dtype(flat), _op(opts.reduceOp))
        _unflatten(flat, tensors)
        return tensors

    @_queued
    def allgather_coalesced(self, output_lists, input_tensors, opts):
        # Every rank's inputs flattened into one block, one allgather, then split back:
        # output_lists[r][i] gets rank r's input_tensors[i].
        if len({t.dtype for t in input_tensors}) > 1:
            raise ValueError("all_gather_coalesced takes tensors of one dtype")
        flat = torch.cat([t.reshape(-1) for t in input_tensors])
        gathered = torch.empty((self.size(), flat.numel()), dtype=flat.dtype)
        self._comm._allgather(_buf(flat), _buf(gathered))
        for outs, block in zip(output_lists, gathered):
            _unflatten(block, outs)
        return output_lists

    @_queued
    def gather(self, output_tensors, input_tensors, opts):
        root, me = opts.rootRank, self.rank()
        inp = input_tensors[0].contiguous()
        if me != root:
            self._comm._send(_buf(inp), root)
            return output_tensors
        for r, out in enumerate(output_tensors[0]):
            if r == me:
                out.copy_(inp)
            else:
                _in_place(out, lambda c, r=r: self._comm._recv(_buf(c), r))
        return output_tensors

    @_queued
    def scatter(self, output_tensors, input_tensors, opts):
        root, me = opts.rootRank, self.rank()
        out = output_tensors[0]
        if me != root:
            _in_place(out, lambda c: self._comm._recv(_buf(c), root))
            return output_tensors
        for r, t in enumerate(input_tensors[0]):
            if r == me:
                out.copy_(t)
            else:
                self._comm._send(_buf(t.contiguous()), r)
        return output_tensors

    def _exchange_blocks(self, send_blocks, recv_blocks):
        """Block ``j`` of ``send_blocks`` to rank ``j``, block ``i`` of ``recv_blocks`` from
        rank ``i`` (contiguous tensors, any sizes the ranks agree on): pairwise, rank ``r``
        sending to ``r + s`` while receiving from ``r - s`` at step ``s``, which cannot
        deadlock. Empty blocks are skipped on both sides alike."""
        n, r = self.size(), self.rank()
        recv_blocks[r].copy_(send_blocks[r])
        for step in range(1, n):
            to, source = (r + step) % n, (r - step) % n
            out, into = send_blocks[to], recv_blocks[source]
            self._comm._sendrecv(
                _buf(out) if out.numel() else None, to,
                _buf(into) if into.numel() else None, source)

    def _alltoall_uneven(self, out, inp, output_split_sizes, input_split_sizes):
        n = self.size()

        def blocks(t, splits):
            flat = t.reshape(-1)
            rows = t.shape[0] if t.dim() else 1
            per_row = flat.numel() // rows if rows else 0
            if not splits:
                if rows % n:
                    raise ValueError(f"{rows} rows do not split into {n} equal blocks")
                splits = [rows // n] * n
            if len(splits) != n or sum(splits) != rows:
                raise ValueError(f"split sizes {list(splits)} do not cover {rows} rows")
            offs = [0]
            for k in splits:
                offs.append(offs[-1] + k * per_row)
            return [flat[a:b] for a, b in zip(offs, offs[1:])]

        src = _apart(inp, out)

        def run(c):
            self._exchange_blocks(blocks(src, input_split_sizes), blocks(c, output_split_sizes))

        _in_place(out, run)

    def monitored_barrier(self, opts, wait_all_ranks=False):
        """As gloo's: rank 0 hears from every other rank within the call's timeout, then
        answers each; a rank that does not arrive fails rank 0's call, naming it, and the
        others' with the error rank 0's failure sends them. It returns when done (torch
        calls it for no Work)."""
        self._monitored_barrier(_Opts(opts), wait_all_ranks).wait()

    @_queued
    def _monitored_barrier(self, opts, wait_all_ranks):
        n, me = self.size(), self.rank()
        one = torch.zeros(1, dtype=torch.uint8)
        saved = self._comm.timeout
        timeout = getattr(opts, "timeout", None)
        if timeout is not None and timeout.total_seconds() > 0:
            self._comm.timeout = timeout.total_seconds()
        try:
            if me != 0:
                self._comm._send(_buf(one), 0)
                try:
                    self._comm._recv(_buf(one), 0)
                except Exception as e:
                    raise RuntimeError(
                        f"Rank {me} successfully reached monitoredBarrier, but received "
                        f"errors while waiting for send/recv from rank 0: {e}") from None
                return []
            for r in range(1, n):
                try:
                    self._comm._recv(_buf(one), r)
                except Exception as e:
                    # The communicator is broken after a failure (see ferroce-coll), so the
                    # ranks after this one cannot be told apart: the first is named.
                    raise RuntimeError(
                        f"Rank {r} failed to pass monitoredBarrier in {timeout}: {e}") from None
            for r in range(1, n):
                self._comm._send(_buf(one), r)
            return []
        finally:
            self._comm.timeout = saved


def _create(store, rank, size, timeout):
    return ProcessGroupFerroce(store, rank, size, timeout)


# Only for CPU tensors: in "cpu:ferroce,cuda:nccl" NCCL keeps the CUDA ones.
dist.Backend.register_backend("ferroce", _create, devices=["cpu"])
