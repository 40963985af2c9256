"""Test configuration shared by tests/ and property_tests/.

Hypothesis profiles, chosen with the environment variable DTA_HYPOTHESIS_PROFILE:

- ``ci`` (default): derandomized, a modest number of examples per property so
  the whole CPU suite runs in a few minutes on a small machine.
- ``nightly``: many more examples, fresh randomness on every run.

Markers (declared in pyproject.toml):

- ``gpu``: skipped when torch sees no CUDA device.
- ``kernel``: runs a Triton kernel; ``torch.empty`` and ``torch.empty_like`` fill floating tensors with
  NaN in these tests, so an output element a kernel forgets to write fails the test.
- ``slow``: the long tail, left out of the quick subset ``pytest -m "not slow"``: every Hypothesis
  property (property_tests/), the multi-process distributed runs and a few large kernel cases.
- ``large``: larger CPU cases, skipped unless DTA_LARGE=1.

Torch runs single-threaded on the CPU unless DTA_TEST_THREADS says otherwise.

This file sits at the repository root, so pytest puts the root on sys.path and
``from tests.helpers import ...`` works from every test file.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Kernels use their first tuned config in tests instead of autotuning every shape they meet.
os.environ.setdefault("DTA_AUTOTUNE", "0")

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=50,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    derandomize=False,
    deadline=None,
    max_examples=500,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

PROFILE = os.environ.get("DTA_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)

# CPU tests run tiny tensors: intra-op threads only add synchronisation, and on
# a busy machine their spin-waiting makes a run many times slower.
torch.set_num_threads(int(os.environ.get("DTA_TEST_THREADS", "1")))


def pytest_report_header(config):
    return f"hypothesis profile: {PROFILE} (max_examples={settings.default.max_examples})"


# whole modules of the long tail (``slow``)
SLOW_PATHS = ("property_tests/", "tests/test_distributed.py")


def pytest_collection_modifyitems(config, items):
    skip_gpu = None
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    skip_large = None
    if os.environ.get("DTA_LARGE") != "1":
        skip_large = pytest.mark.skip(reason="large test: set DTA_LARGE=1 to run it")
    for item in items:
        if item.nodeid.startswith(SLOW_PATHS):
            item.add_marker(pytest.mark.slow)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if skip_large is not None and "large" in item.keywords:
            item.add_marker(skip_large)


@pytest.fixture(autouse=True)
def poison_empty(request, monkeypatch):
    """In kernel tests, floating tensors from torch.empty / torch.empty_like hold NaN: kernel outputs are
    allocated with them, so unwritten elements fail."""
    if request.node.get_closest_marker("kernel") is None:
        return
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(x):
        if x.dtype.is_floating_point:
            with torch.no_grad():  # an empty leaf that requires grad (torch.empty(..., requires_grad=True)) too
                x.fill_(float("nan"))
        return x

    def nan_empty(*args, **kwargs):
        return poisoned(empty(*args, **kwargs))

    def nan_empty_like(*args, **kwargs):
        return poisoned(empty_like(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like", nan_empty_like)
