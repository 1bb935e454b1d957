"""ferroce: a userspace RDMA stack speaking RoCE v2, from Python.

Verbs shaped like rdma-core's pyverbs (``Context``, ``PD``, ``MR``, ``CQ``, ``QP``, ``SGE``,
``SendWR``, ``RecvWR``; numbers in ``ferroce.enums``), collectives on buffers
(``ferroce.collectives``) and a torch.distributed backend (``import ferroce.torch``), on any
Linux machine, with no RDMA NIC and no kernel module.

Memory regions are read and written by copy (``MR.read``/``MR.write``): no Python object
views memory a remote peer may write at any moment. Calls that fail raise ``VerbsError``;
a work request that fails completes with a status (``WC.status``), as in pyverbs.
"""

from ._ferroce import (  # noqa: F401
    CQ,
    MR,
    PD,
    QP,
    SGE,
    WC,
    CollectiveError,
    Context,
    RecvWR,
    SendWR,
    VerbsError,
)
from . import enums  # noqa: F401

__all__ = [
    "CQ",
    "MR",
    "PD",
    "QP",
    "SGE",
    "WC",
    "CollectiveError",
    "Context",
    "RecvWR",
    "SendWR",
    "VerbsError",
    "enums",
]
