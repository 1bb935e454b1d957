"""The torch.distributed backend: collectives through torch's API on "ferroce", and
DistributedDataParallel training the same model from the same seed on "ferroce" and on "gloo"
with 2 ranks, whose weights must agree after every step. Skipped when torch is not installed,
except under CI, where that fails (_prereq.py; scripts/test-python.sh installs torch)."""

import inspect
import multiprocessing as mp
import os
import socket
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _prereq import require_module  # noqa: E402

torch = require_module("torch", "scripts/test-python.sh installs it unless FERROCE_SKIP_TORCH=1")
import _abort_ranks  # noqa: E402
import _fsdp_ranks  # noqa: E402
import _p2p_ranks  # noqa: E402
import _sparse_ranks  # noqa: E402
import _split_ranks  # noqa: E402
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


@pytest.mark.parametrize("size", [2, 3])
def test_every_operation_on_strided_tensors(size):
    """all_reduce, broadcast, all_gather, all_gather_into_tensor (also in place),
    reduce_scatter, reduce_scatter_tensor, all_to_all_single, all_to_all, send/recv and
    barrier, each on column slices, step slices and transposes, between separate processes:
    values as the operation must give them, and nothing beside the views written."""
    for rank, bad in run_ranks(_torch_ranks.strided, size):
        assert bad == [], f"rank {rank}: " + "\n".join(bad)


@pytest.mark.parametrize("size", [2, 3])
def test_reduce_gather_scatter_coalesced_uneven_and_monitored(size):
    """reduce, gather, scatter, the coalesced operations, uneven all_to_all, monitored
    barriers, and receives from any source."""
    for rank, bad in run_ranks(_torch_ranks.more_ops, size):
        assert bad == [], f"rank {rank}: " + "\n".join(bad)


@pytest.mark.parametrize("size", [2, 3])
def test_isend_and_irecv_stay_in_flight_together(size):
    """Receives posted before sends on every rank, sends both ways beyond the peer's slots,
    a ring, a column view, order per peer, and a collective behind them: as with gloo, none
    waits for the next operation to be called."""
    for rank, bad in run_ranks(_p2p_ranks.point_to_point, size):
        assert bad == [], f"rank {rank}: " + "\n".join(bad)


def test_split_group_gives_each_split_a_group_of_its_own():
    """split_group on 5 ranks: [[3, 0, 2], [1]], rank 4 in none, on gloo and on ferroce. A
    torch that cannot split CPU groups (2.11: CUDA only) refuses both alike; one that can
    (2.15) must split ferroce's as the test checks."""
    gloo = dict(run_ranks(_split_ranks.split, 5, "gloo"))
    ferroce = dict(run_ranks(_split_ranks.split, 5, "ferroce"))
    if isinstance(gloo[0], tuple):
        assert all(isinstance(g, tuple) and g[0] == "refused" for g in gloo.values()), gloo
        assert ferroce == gloo, f"gloo: {gloo}\nferroce: {ferroce}"
        return
    for backend, got in (("gloo", gloo), ("ferroce", ferroce)):
        for rank, bad in got.items():
            assert bad == [], f"{backend} rank {rank}: " + "\n".join(bad)


def test_abort_fails_the_operation_under_way_and_the_peers_at_once():
    for rank, bad in run_ranks(_abort_ranks.abort, 2):
        assert bad == [], f"rank {rank}: " + "\n".join(bad)


def test_a_dead_rank_fails_the_others_collective_within_the_timeout():
    for rank, bad in run_ranks(_torch_ranks.dead_rank, 3):
        assert bad == [], f"rank {rank}: {bad}"


def test_operations_are_queued_and_return_their_work_at_once():
    for rank, bad in run_ranks(_torch_ranks.asynchronous, 2):
        assert bad == [], f"rank {rank}: {bad}"


def test_a_device_string_routes_only_cpu_tensors_to_ferroce():
    """"cpu:ferroce,cuda:gloo" keeps gloo for CUDA tensors (no GPU is needed to build the
    table): ferroce is a C++ c10d Backend, which torch puts under its own group for CPU
    tensors alone."""
    for rank, bad in run_ranks(_torch_ranks.routing, 2):
        assert bad == [], f"rank {rank}: {bad}"


def same_weights_on_ferroce_as_on_gloo(target, *args):
    """Runs ``target`` on 2 ranks on each backend; every rank's weights must equal gloo rank
    0's bit for bit. Returns those."""
    states = {}
    for backend in ("ferroce", "gloo"):
        for rank, b, state, err in run_ranks(target, 2, backend, *args):
            assert err is None, f"{b} rank {rank}: {err}"
            states[(b, rank)] = state
    ref = states[("gloo", 0)]
    for key, state in states.items():
        for name, w in state.items():
            assert (w == ref[name]).all(), f"{key}: {name} differs from gloo rank 0's"
    return ref


def test_ddp_on_ferroce_and_gloo_ends_with_the_same_weights():
    ref = same_weights_on_ferroce_as_on_gloo(_torch_ranks.train, 5)
    # And the model did train: the weights moved from their initial values.
    torch.manual_seed(1234)
    init = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    assert not (init.state_dict()["0.weight"].numpy() == ref["0.weight"]).all()


def test_all_reduce_of_sparse_tensors_gives_every_rank_the_coalesced_sum():
    for rank, bad in run_ranks(_sparse_ranks.all_reduce, 3):
        assert bad == [], f"rank {rank}: {bad}"


def test_ddp_with_sparse_gradients_on_ferroce_ends_with_gloos_weights():
    """An nn.Embedding(sparse=True) under DDP: its gradients are sparse all_reduces. With 2
    ranks every sum has two terms, whose order cannot change a float's rounding, so the
    weights agree bit for bit (3 ranks' sparse sums are checked exactly above)."""
    ref = same_weights_on_ferroce_as_on_gloo(_sparse_ranks.ddp_embedding, 4)
    # And the embedding did train: rows the ranks' token ids hit moved from seed 0's.
    torch.manual_seed(0)
    init = torch.nn.Embedding(50, 8, sparse=True).weight.detach().numpy()
    assert (init != ref["0.weight"]).any(axis=1).sum() >= 10


@pytest.mark.parametrize("size,bf16", [(2, False), (2, True), (4, False)])
def test_fsdp2_on_ferroce_and_gloo_ends_with_the_same_losses_and_weights(size, bf16):
    """FSDP2 (``fully_shard`` per layer, activation checkpointing, bf16 parameters in one
    case) trains a small transformer from one seed on "ferroce" and on "gloo": the same loss
    at every step and the same final parameters on every rank. With 2 ranks bitwise: a sum of
    two numbers is the same in either order, so both backends' all_gather and reduce_scatter
    must give identical bits. With 4 ranks the backends add in different orders (gloo's ring,
    ferroce's own), so float32 rounding may differ: within 1e-5 relative, 1e-6 absolute."""
    import numpy as np

    steps = 4
    runs = {}
    for backend in ("ferroce", "gloo"):
        for rank, b, losses, params, err in run_ranks(_fsdp_ranks.train, size, backend, steps,
                                                      bf16):
            assert err is None, f"{b} rank {rank}: {err}"
            assert len(losses) == steps
            runs[(b, rank)] = (losses, params)
    ref_losses, ref_params = runs[("gloo", 0)]
    assert ref_losses[-1] < ref_losses[0], f"gloo did not train: {ref_losses}"
    for key, (losses, params) in runs.items():
        assert params.keys() == ref_params.keys()
        if size == 2:
            assert losses == ref_losses, f"{key}: losses {losses} != gloo's {ref_losses}"
            for name, w in params.items():
                assert np.array_equal(w, ref_params[name]), f"{key}: {name} differs from gloo's"
        else:
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6, err_msg=str(key))
            for name, w in params.items():
                np.testing.assert_allclose(w, ref_params[name], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{key}: {name}")


def test_torchrun_trains_the_example_on_ferroce_as_on_gloo():
    """The example training script under the real launcher: torchrun starts 2 ranks, the loss
    falls, every rank ends with the same weights, and "ferroce" ends where "gloo" does."""
    import re
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "examples", "train_ddp.py")
    out = {}
    for backend in ("ferroce", "gloo"):
        for _ in range(3):
            run = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(free_port()), script, "--backend", backend,
                 "--steps", "30"],
                capture_output=True, text=True, timeout=300,
                # python/ itself must not shadow the installed package in the ranks.
                cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            )
            # The port was free a moment before torchrun bound it; another may take it first.
            port_taken = "address already in use" in (run.stdout + run.stderr).lower()
            # A rank that finished (the checksum line is printed after the last collective)
            # and then died in C++ teardown ("terminate called without an active exception",
            # SIGABRT, seen about once in ten loaded runs and never alone; see issue #31):
            # tried again, at most twice, so that anything else still fails at once.
            teardown_abort = (
                run.returncode != 0
                and "same on all ranks: True" in run.stdout
                and "terminate called without an active exception" in run.stderr
            )
            if teardown_abort:
                print(f"{backend}: a rank aborted in teardown after training; trying again")
            if not (port_taken or teardown_abort):
                break
        assert run.returncode == 0, run.stdout + run.stderr
        losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", run.stdout)]
        assert len(losses) == 30 and losses[-1] < losses[0] / 4, run.stdout
        m = re.search(r"weights checksum (\S+) same on all ranks: True", run.stdout)
        assert m, run.stdout
        out[backend] = m.group(1)
    assert out["ferroce"] == out["gloo"], out


def torchrun(script, *args, nproc=2):
    """Runs ``script`` under torchrun with ``nproc`` ranks (from the repository root: python/
    itself must not shadow the installed package), retrying when the free port was taken."""
    import subprocess

    for _ in range(3):
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
             "--master-port", str(free_port()), script, *args],
            capture_output=True, text=True, timeout=300,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        if "address already in use" not in (run.stdout + run.stderr).lower():
            return run
    return run


def test_send_of_a_64_mib_column_under_torchrun():
    """The reproduction of the use-after-free: rank 0 ``dist.send(base[:, 0], 1)`` of a 64 MiB
    column of an (N, 2) tensor. The contiguous copy was freed before the extension read it,
    and rank 0 died with SIGSEGV; now rank 1 receives every value."""
    run = torchrun(os.path.join(os.path.dirname(__file__), "_send_column.py"))
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "rank 0 sent the column" in run.stdout, out
    assert "rank 1 received the column: 0 wrong values" in run.stdout, out


# torch's own distributed suite (python/suite/torch_distributed_suite.py), whole, on ferroce in
# gloo's place and on gloo itself, 3 ranks each. Every test gloo passes must pass on ferroce,
# but these, each for the reason given (the README's torch section lists them too).
SUITE_EXPLAINED = {
    "test_get_backend": "the harness makes the groups the suite asks gloo for on ferroce, and "
                        "the test checks that get_backend() names the backend it asked for",
    "test_ddp_logging_data_cpu": "DDP's logger names a third-party backend 'custom' (torch's "
                                 "ProcessGroup says so), where the test expects get_backend()",
}


def run_suite(backend):
    """Runs the whole suite on ``backend`` (ranks forked: ~2 min; spawned, as torch's own
    test_distributed_spawn.py does, it takes an hour here); returns (tests run, skipped, the
    names of the tests that failed or erred, the output)."""
    import re
    import subprocess

    suite = os.path.join(os.path.dirname(__file__), "..", "suite", "torch_distributed_suite.py")
    run = subprocess.run(
        [sys.executable, suite], capture_output=True, text=True, timeout=1500,
        env={**os.environ, "SUITE_BACKEND": backend, "SUITE_START": "fork",
             "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": "60"})
    out = run.stdout + run.stderr
    ran = re.search(r"^Ran (\d+) tests?", out, re.M)
    assert ran, out[-3000:]
    skipped = re.search(r"skipped=(\d+)", out.split("\nRan ")[-1])
    failed = set(re.findall(r"^(?:ERROR|FAIL): (test_\w+) ", out, re.M))
    assert (run.returncode == 0) == (not failed), out[-3000:]
    return int(ran.group(1)), int(skipped.group(1)) if skipped else 0, failed, out


def test_torchs_own_distributed_suite_passes_on_ferroce_as_on_gloo():
    require_module("expecttest", "scripts/test-python.sh installs it (torch's test utilities)")
    g_ran, g_skipped, g_failed, g_out = run_suite("gloo")
    f_ran, f_skipped, f_failed, f_out = run_suite("ferroce")
    # The counts, for `pytest -s` (the notes' tables).
    for name, ran, skipped, failed in (("gloo", g_ran, g_skipped, g_failed),
                                       ("ferroce", f_ran, f_skipped, f_failed)):
        print(f"torch {torch.__version__}, {name}: {ran} run, {ran - skipped - len(failed)} "
              f"passed, {skipped} skipped, failed or erred: {sorted(failed)}")
    assert g_ran == f_ran and g_skipped == f_skipped, (g_ran, g_skipped, f_ran, f_skipped)
    assert g_ran - g_skipped >= 80, f"only {g_ran - g_skipped} of gloo's tests ran"
    explained = set(SUITE_EXPLAINED)
    if "only implemented for GLOO" in inspect.getsource(torch.distributed.monitored_barrier):
        # This torch (2.11, say) refuses monitored_barrier in Python for every backend but
        # gloo, before any backend is called: its own refusal, not ferroce's.
        explained |= {t for t in f_failed if t.startswith("test_monitored_barrier")}
    unexplained = f_failed - g_failed - explained
    assert not unexplained, f"failed on ferroce, not on gloo: {sorted(unexplained)}\n" + f_out[-4000:]
