"""_prereq's rule as pytest meets it: a test module whose Python module is missing is skipped,
with the reason, on a developer's machine, and fails the run under CI (CI=true or CI=1)."""

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))


def run_module_needing_a_missing_module(tmp_path, ci):
    """Runs pytest on a test module that requires a module no machine has, beside one that
    needs nothing, with CI set to `ci` (or unset when None); returns the finished process."""
    (tmp_path / "test_needs_nothing.py").write_text("def test_runs():\n    pass\n")
    test = tmp_path / "test_needs_missing.py"
    test.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {HERE!r})
            from _prereq import require_module

            require_module("ferroce_no_such_module", "scripts/test-python.sh installs it")

            def test_never_runs():
                raise AssertionError("ran without its module")
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_module_skips_with_its_reason_outside_ci(tmp_path):
    for ci in (None, "", "false", "0"):
        p = run_module_needing_a_missing_module(tmp_path, ci)
        out = p.stdout + p.stderr
        assert p.returncode == 0, (ci, out)
        assert "1 passed, 1 skipped" in out, (ci, out)
        assert "needs the Python module ferroce_no_such_module" in out, (ci, out)
        assert "(scripts/test-python.sh installs it)" in out, (ci, out)


def test_missing_module_fails_the_run_under_ci(tmp_path):
    for ci in ("true", "TRUE", "1"):
        p = run_module_needing_a_missing_module(tmp_path, ci)
        out = p.stdout + p.stderr
        assert p.returncode != 0, (ci, out)
        assert "skipped" not in out, (ci, out)
        assert "needs the Python module ferroce_no_such_module" in out, (ci, out)
        assert "under CI (CI=true) a missing prerequisite is a failure, not a skip" in out, (ci, out)
        assert "1 error" in out, (ci, out)
