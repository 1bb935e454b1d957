"""A torch.distributed backend over ferroce: ``import ferroce.torch`` registers ``"ferroce"``.

    import torch.distributed as dist
    import ferroce.torch  # noqa: F401
    dist.init_process_group("ferroce")     # under torchrun; or "cpu:ferroce,cuda:nccl"

The backend is C++ (``csrc/ProcessGroupFerroce.cpp``): a c10d ``Backend``, built against the
installed torch the first time this module is imported (torch's ``cpp_extension``; it needs a
C++ compiler, Python's headers and ``ninja``, and is cached per torch version; a failed build
raises ``ImportError`` saying which). Why C++: torch routes a device's tensors to a backend
(``"cpu:ferroce,cuda:nccl"`` keeps NCCL for CUDA tensors) only if the backend is a C++
``Backend``, and torch 2.11 cannot make one from Python; and torch reads a C++ ``Work``
directly (``is_completed()``, ``wait(timeout)``, ``exception()``), where its wrapper of a
Python Work forwards only ``wait`` and ``get_future``. The collectives are ferroce-coll's,
called from C++ through the Rust extension's table of C functions (``_ferroce._coll_api()``).

The c10d operations gloo has, on dense CPU tensors: all_reduce (and coalesced), broadcast,
reduce, all_gather, all_gather_into_tensor (and coalesced), all_gather_coalesced, gather,
scatter, reduce_scatter, reduce_scatter_tensor (and coalesced), all_to_all_single (even and
uneven splits), all_to_all, send, recv (also from any source: the first send of the
tensor's length), batch_isend_irecv (c10d coalescing), barrier and monitored_barrier, with SUM,
PRODUCT, MIN, MAX and AVG on float32, float64, float16, bfloat16, int32, int64 and uint8
(reductions; the others move any dtype), and split_group; all_reduce of sparse COO tensors
(SUM, any dtype: DDP's sparse gradients), as gloo's. Refused with an error that says so:
sparse tensors in other operations, other reductions (bitwise, PREMUL_SUM) and an empty
receive from any source. Not done: tags (ignored: sends and receives between two ranks match in order). isend
and irecv stay in flight together until each completes, whatever order the ranks post them in
and however large (ferroce-coll's start_send/start_recv); an operation queued after them runs
once they are done. Strided tensors of any shape and strides work (a non-contiguous one goes
through a contiguous copy, copied back where the operation writes it).

Each operation is queued to the group's worker thread and returns its ``Work`` at once:
``wait()`` blocks until it ran and raises its error, ``get_future()`` completes with its result
or error, so ``async_op=True`` overlaps and DDP's all_reduces overlap the backward pass
(``FERROCE_TORCH_SYNC=1`` runs each in the caller instead). A call's ``timeout`` (else the
group's) bounds how long an operation may go without progress from a peer; a rank that stops
answering fails it with ``torch.distributed.DistBackendError``. The endpoints are exchanged
through torch.distributed's own store, so it needs nothing but the rendezvous torch has.
"""

import datetime
import os
import re
import shutil

import torch
import torch.distributed as dist

from . import _ferroce


def _build():
    """The compiled backend module for this torch: built on first use, then loaded from
    torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default under ``~/.cache``)."""
    from torch.utils import cpp_extension

    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc",
                          "ProcessGroupFerroce.cpp")
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        raise ImportError(
            f"ferroce.torch builds its c10d backend against torch {torch.__version__} on first "
            f"import, and {' and '.join(missing)} is not on PATH (install a C++ compiler, e.g. "
            f"Debian's g++, and `pip install ninja`)")
    # The extension is built per torch version (torch's cache keys on the source and flags).
    name = "ferroce_c10d_" + re.sub(r"[^0-9A-Za-z]", "_", torch.__version__)
    try:
        return cpp_extension.load(
            name=name, sources=[source], extra_cflags=["-O2"], with_cuda=False,
            verbose=os.environ.get("FERROCE_TORCH_BUILD_VERBOSE", "0") not in ("", "0"))
    except Exception as err:
        raise ImportError(
            f"ferroce.torch could not build its c10d backend against torch "
            f"{torch.__version__} (FERROCE_TORCH_BUILD_VERBOSE=1 shows the compiler's "
            f"output): {err}") from err


_ext = _build()

#: The backend's type: what ``group._get_backend(torch.device("cpu"))`` is for a ferroce group.
ProcessGroupFerroce = _ext.ProcessGroupFerroce

#: Whether torch routes each device's tensors to its own backend under a device string such as
#: ``"cpu:ferroce,cuda:nccl"``: always, now that the backend is C++ (kept for callers that
#: read it).
ROUTES_BY_DEVICE = True


def _create(store, rank, size, timeout):
    # torch gives each group's backend a store of its own (a prefix of the group's name and
    # device), so the keys need no group number: a per-process counter of groups went wrong
    # for groups of some ranks, which the others never create.
    rounds = iter(range(1 << 62))

    def exchange(card):
        key = f"ferroce/{next(rounds)}"
        store.set(f"{key}/{rank}", bytes(card))
        return [bytes(store.get(f"{key}/{r}")) for r in range(size)]

    comm = _ferroce.Communicator.from_exchange(
        rank,
        size,
        exchange,
        timeout.total_seconds(),
        None,
        os.environ.get("FERROCE_DEVICE"),
        os.environ.get("MASTER_ADDR"),
    )
    # The backend takes the communicator over (``comm`` is empty afterwards).
    return _ext.create_backend(comm, _ferroce._coll_api(), rank, size, timeout.total_seconds())


def _create_split(store, rank, size, timeout_seconds):
    # The backend's split (torch's split_group) connects the child group here, over the
    # child's store, as a new group is.
    return _create(store, rank, size, datetime.timedelta(seconds=timeout_seconds))


# Only for CPU tensors: in "cpu:ferroce,cuda:nccl" NCCL keeps the CUDA ones.
dist.Backend.register_backend("ferroce", _create, devices=["cpu"])

__all__ = ["ProcessGroupFerroce", "ROUTES_BY_DEVICE"]
