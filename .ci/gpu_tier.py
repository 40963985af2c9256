"""pytest plugin for .ci/gpu: the real-size GPU cases share one pytest-xdist group.

They hold tens of GiB of GPU memory each (the float64 reference at 20K
tokens), so they run one after another on one worker while the small kernel
cases, which mostly wait on Triton compiling, spread over the others.
"""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.xdist_group("gpu_memory"))
