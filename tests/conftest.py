"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-process gloo group for the test's duration: DDP on the CPU."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
