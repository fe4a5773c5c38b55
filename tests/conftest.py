"""Top-level test configuration: the `gpu` marker and the hypothesis profile.

Tests marked `gpu` need a usable CUDA device; without one they are skipped (the CPU suite runs
everywhere, including CI machines with no GPU).
"""
from __future__ import annotations

import functools
import os
import sys
import zlib

import pytest
from hypothesis import HealthCheck, settings

# JAX takes 75% of a GPU's memory at its first use unless told otherwise: with several test
# processes sharing a GPU (xdist), the later ones, and CuPy's and torch's pools beside it, would
# run short (failed allocations, CUDA graph captures broken). Set here, before any test module
# imports JAX, for every process of the run.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# The default profile draws the same examples on every run (a hash of each test), so that a
# test command passes or fails alike on every machine; "thorough" draws new ones, more of them,
# to look for failing cases (HYPOTHESIS_PROFILE=thorough).
settings.register_profile(
    "ci", deadline=None, max_examples=25, print_blob=True, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", parent=settings.get_profile("ci"), max_examples=300,
                          derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU here"
        return False


@pytest.fixture(autouse=True)
def _reproducible_draws(request):
    """torch's global generator is seeded from the test's id: a test draws the same numbers
    whatever ran before it, so a failure reproduces when the test runs alone."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _current_device_restored(request):
    """A GPU test leaves the CUDA current device (shared by CuPy and torch) as it found it, so a
    test that moves it to another GPU cannot change what the tests after it run on."""
    if request.node.get_closest_marker("gpu") is None or not cuda_available():
        yield
        return
    from cupy.cuda import runtime

    before = runtime.getDevice()
    yield
    if runtime.getDevice() != before:
        runtime.setDevice(before)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: the test needs a CUDA GPU (skipped when none is usable)")


@pytest.hookimpl(trylast=True)  # after any conftest below has added its `gpu` markers
def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none is usable on this machine")
        for item in gpu_items:
            item.add_marker(skip)
