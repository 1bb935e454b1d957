"""torch's own distributed test suite (``DistributedTest._DistTestBase``, shipped in the torch
wheel) run against ferroce the way torch's ``test/distributed/test_distributed_spawn.py`` runs
it against gloo: one process per rank, spawned for each test, a file store per test.

    python3 python/suite/torch_distributed_suite.py              # every test, on ferroce
    SUITE_BACKEND=gloo python3 python/suite/torch_distributed_suite.py    # gloo's own run
    python3 python/suite/torch_distributed_suite.py -k test_all_reduce_sum -k test_gather

The suite's skip lists and code paths key on ``BACKEND``, which stays ``gloo``: the process
groups it asks gloo for (``init_process_group``, ``new_group``) are made on ``SUITE_BACKEND``
(default ``ferroce``) instead, so ferroce takes gloo's CPU paths. ``WORLD_SIZE`` defaults to 3,
as torch's CI runs gloo. Prints unittest's report; the exit status is unittest's."""

import os
import sys
import tempfile

# torch's test utilities switch to their own CI mode (XML reports through xmlrunner, which is
# not installed) when CI is set; this harness reports as unittest does, wherever it runs.
os.environ.pop("CI", None)
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "3")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="ferroce-suite-"))
SUITE_BACKEND = os.environ.setdefault("SUITE_BACKEND", "ferroce")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if SUITE_BACKEND != "gloo":
    import ferroce.torch  # noqa: E402,F401  (registers "ferroce")

    _init_process_group = dist.init_process_group
    _new_group = dist.new_group

    def _mapped(backend):
        if isinstance(backend, str) and backend.lower() == "gloo":
            return SUITE_BACKEND
        return backend

    def init_process_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = _mapped(kwargs["backend"])
        elif args:
            args = (_mapped(args[0]),) + args[1:]
        return _init_process_group(*args, **kwargs)

    def new_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = _mapped(kwargs["backend"])
        elif len(args) > 2:
            args = args[:2] + (_mapped(args[2]),) + args[3:]
        return _new_group(*args, **kwargs)

    # The suite calls them as `dist.…` when each test runs, in every spawned rank (each imports
    # this module to find the test class), so patching the module's attributes reaches them.
    dist.init_process_group = init_process_group
    dist.new_group = new_group

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


#: How each test starts its ranks: ``spawn`` (torch's test_distributed_spawn.py) or ``fork``
#: (``SUITE_START=fork``: the ranks skip importing torch again, several times faster here).
SUITE_START = os.environ.get("SUITE_START", "spawn")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """As torch's test_distributed_spawn.py defines it (forked with ``SUITE_START=fork``)."""

    def setUp(self):
        super().setUp()
        if SUITE_START == "fork":
            # torch's _spawn_processes with the fork context (its _fork_processes is gone).
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()


if __name__ == "__main__":
    run_tests()
