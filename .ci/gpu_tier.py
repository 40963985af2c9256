"""pytest plugin for .ci/gpu: the largest GPU cases run one at a time within their shape.

The real-size cases hold up to about 20 GiB of GPU memory each (the float64
reference of a 20K-token tree); each big shape gets its own pytest-xdist
group, so at most one case of each runs at a time and several shapes run
side by side. Everything else, mostly waiting on Triton compiling kernels,
spreads over all workers.
"""

import pytest

BIG_SHAPES = ("random", "agentic", "grpo-")  # test_gpu_real_sizes ids: T = 20011, 15848, 12288


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") is None or "real_sizes" not in item.name:
            continue
        shape = next((s for s in BIG_SHAPES if f"[{s}" in item.name), None)
        if shape is not None:
            item.add_marker(pytest.mark.xdist_group(f"gpu_memory_{shape.strip('-')}"))
