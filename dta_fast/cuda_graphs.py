"""Capturing a CUDA graph in the middle of a run: the sampler's decode steps (``dta_fast.decode``) and small
tree attention calls (``dta_fast.attention.graphed``) are captured while the rollouts or the training step
they belong to go on."""

from __future__ import annotations

import contextlib
import functools
import gc
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    warm: Any  # what the warm-up call returned: computed, and the capturing call's result
    outputs: Any  # what the captured call returned: tensors the graph rewrites at each replay


def capture(fn, pool, device) -> Captured:
    """``fn``'s CUDA work as a graph sharing the memory pool ``pool`` (None: a pool of its own), after a
    warm-up call on the capture's stream whose results stand (the capture itself computes nothing), so
    the call that captures is a call like the others.

    Unlike ``torch.cuda.graph``, no device synchronize and no ``empty_cache`` (an emptied cache costs the
    step's next allocations a ``cudaMalloc`` each), and the garbage collector paused: a dead graph that
    a collection frees during a capture invalidates it. ``thread_local``: autograd's device thread may
    capture while the main thread waits."""
    current = torch.cuda.current_stream(device)
    stream = _capture_stream(device)
    stream.wait_stream(current)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream):
            warm = fn()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                outputs = fn()
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the capture's own error says less than fn's
                    graph.capture_end()
                raise
            graph.capture_end()
    finally:
        if collecting:
            gc.enable()
        current.wait_stream(stream)
    return Captured(graph, warm, outputs)


@functools.cache
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)
