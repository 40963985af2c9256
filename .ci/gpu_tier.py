"""pytest plugin for .ci/gpu: the largest GPU cases run one at a time within their shape, and workers
give their cached memory back after each test.

The real-size cases hold up to about 20 GiB of GPU memory each (the float64
reference of a 20K-token tree); each big shape gets its own pytest-xdist
group, so at most one case of each runs at a time and several shapes run
side by side. Every worker returns its cached blocks to the device after
each test: the blocks that 8 workers' caching allocators kept from earlier
tests ran the real-size cases out of memory on an 80 GB H100. Everything
else, mostly waiting on Triton compiling kernels, spreads over all workers.
"""

import pytest
import torch

BIG_SHAPES = ("random", "agentic", "grpo-")  # test_gpu_real_sizes ids: T = 20011, 15848, 12288


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") is None or "real_sizes" not in item.name:
            continue
        shape = next((s for s in BIG_SHAPES if f"[{s}" in item.name), None)
        if shape is not None:
            item.add_marker(pytest.mark.xdist_group(f"gpu_memory_{shape.strip('-')}"))


def pytest_runtest_teardown(item, nextitem):
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
