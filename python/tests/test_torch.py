"""The torch.distributed backend: collectives through torch's API on "ferroce", and
DistributedDataParallel training the same model from the same seed on "ferroce" and on "gloo"
with 2 ranks, whose weights must agree after every step. Skipped when torch is not installed
(see python/README.md)."""

import multiprocessing as mp
import os
import socket
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(__file__))
import _torch_ranks  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, size, *args):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, size, port, *args, results)) for r in range(size)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    return got


def test_collectives_through_torch_distributed():
    for rank, bad in run_ranks(_torch_ranks.collectives, 2):
        assert bad == [], f"rank {rank}: {bad}"


def test_ddp_on_ferroce_and_gloo_ends_with_the_same_weights():
    steps = 5
    states = {}
    for backend in ("ferroce", "gloo"):
        for rank, b, state, err in run_ranks(_torch_ranks.train, 2, backend, steps):
            assert err is None, f"{b} rank {rank}: {err}"
            states[(b, rank)] = state
    ref = states[("gloo", 0)]
    for key, state in states.items():
        for name, w in state.items():
            assert (w == ref[name]).all(), f"{key}: {name} differs from gloo rank 0's"
    # And the model did train: the weights moved from their initial values.
    torch.manual_seed(1234)
    init = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    assert not (init.state_dict()["0.weight"].numpy() == ref["0.weight"]).all()
