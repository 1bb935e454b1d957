"""Launching a job's ranks as processes of their own: each rank's output goes to files (no pipe
fills while another rank is waited on), and a rank that fails or outlasts the timeout ends
the others at once, instead of leaving them waiting for it in a collective."""

import subprocess
import tempfile
import time


def run_ranks(commands, envs, timeout):
    """Starts ``commands[r]`` with environment ``envs[r]`` for every rank and waits until all
    have exited, one has failed, or ``timeout`` seconds have passed; then kills what still
    runs. Returns ``(returncode, stdout, stderr)`` by rank (a killed rank's code is negative)."""
    procs = []
    try:
        for command, env in zip(commands, envs):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            procs.append((subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True),
                          out, err))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p, _, _ in procs):
            if time.monotonic() > deadline or any(p.poll() for p, _, _ in procs):
                break
            time.sleep(0.1)
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, out, err in procs:
        p.wait()
        out.seek(0)
        err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return results
