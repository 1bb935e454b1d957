"""One rule for a test whose prerequisite this machine lacks (the Python side of
crates/test-support): on a developer's machine the test is skipped with the reason; under CI (the
CI environment variable is "true" or "1") it fails, since scripts/test-python.sh installs
everything these tests use and a green run over tests that never ran would hide a broken set-up."""

import importlib
import os

import pytest


def in_ci():
    """Whether this run is CI's: CI is "true" (any case) or "1"."""
    value = os.environ.get("CI", "")
    return value.lower() == "true" or value == "1"


def require_module(name, how):
    """Imports and returns module `name`; when it cannot be imported, skips the calling test
    module (or fails it under CI), saying what is missing and `how` the scripts provide it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        reason = f"needs the Python module {name} ({how}): {e}"
        if in_ci():
            pytest.fail(
                f"{reason}; under CI (CI=true) a missing prerequisite is a failure, not a skip",
                pytrace=False,
            )
        pytest.skip(reason, allow_module_level=True)
