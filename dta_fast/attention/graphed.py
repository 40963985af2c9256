"""Small tree attention calls replayed from CUDA graphs.

A model calls tree attention once per layer with one schedule and the same shapes, forward and
backward (and again in a checkpointed layer's recomputed forward). At RL micro-batch sizes such a call is
host-bound: GRPO P=2K N=8 R=1K at 14/2 heads of 64 takes 1.5 ms of an H200 host per forward + backward,
Python and launches, against 0.95 ms of GPU (``benchmarks/dev/host_cost.py``). So on CUDA, a call of at
most ``MAX_ELEMENTS`` query elements runs, per (schedule, pass, shapes, strides, dtype, variant, stream):

- the first time, eagerly (its kernels compile, the schedule builds its block lists);
- the second time, into a graph: its inputs copied into buffers of its own, one eager run on them whose
  results it returns, then the capture (``dta_fast.cuda_graphs.capture``);
- from then on: the inputs copied in, the graph replayed, its outputs cloned out.

The same kernels on the same values, so bitwise the eager call's numbers. The graphs live with their
schedule and share one memory pool per device and stream (a replay writes everything it reads before
reading it, as an eager call does, so graphs of one stream may share their temporaries). Off with
``DTA_ATTENTION_GRAPHS=0`` or ``ENABLED = False``; never inside another capture.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..cuda_graphs import capture
from .interpreter import INTERPRET

ENABLED = os.environ.get("DTA_ATTENTION_GRAPHS", "1") != "0"
# Queries' elements (B x Hq x Tq x D) up to which a call is graphed: host-bound calls. Beyond it a
# call's GPU time exceeds its host time, and its copies in and out would only add to it.
MAX_ELEMENTS = 1 << 24


@dataclass
class _Graphed:
    """One call's graph, once captured: its input buffers and the outputs it rewrites at each replay."""

    eager_calls: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    inputs: tuple = ()
    outputs: tuple = ()
    error: str | None = None  # why the capture failed, if it did: eager from now on


_POOLS: dict = {}  # (device, stream) -> the anchor of the memory pool its graphs share


def applies(q: torch.Tensor) -> bool:
    return (
        ENABLED and q.is_cuda and not INTERPRET and q.numel() <= MAX_ELEMENTS
        and not torch.cuda.is_current_stream_capturing()
    )  # fmt: skip


def run(body, inputs: tuple, cache: dict, key: tuple) -> tuple:
    """``body(*inputs)``, a tuple of tensors (or None), eagerly or from the graph kept in ``cache`` (the
    schedule's) under ``key`` (the call's constants: pass, scale, variant) and the inputs' layouts."""
    if not applies(inputs[0]):
        return body(*inputs)
    device = inputs[0].device
    stream = _stream_id(device)
    key = (*key, stream, *((x.shape, x.stride(), x.dtype) for x in inputs))
    entry = cache.get(key)
    if entry is None:
        entry = cache[key] = _Graphed()
    if entry.graph is not None:
        for buffer, x in zip(entry.inputs, inputs):
            buffer.copy_(x)
        entry.graph.replay()
        return tuple(None if x is None else x.clone() for x in entry.outputs)
    if entry.error is not None or entry.eager_calls == 0:
        entry.eager_calls += 1
        return body(*inputs)
    buffers = tuple(torch.empty_like(x).copy_(x) for x in inputs)
    try:
        captured = capture(lambda: body(*buffers), _pool(device, stream), device)
    except Exception as error:  # something in the call syncs with the host: eager from now on, the same numbers
        entry.error = f"{type(error).__name__}: {error}"
        _POOLS.pop((device, stream), None)  # a capture that failed may leave its pool unusable
        return body(*inputs)
    entry.graph, entry.inputs, entry.outputs = captured.graph, buffers, captured.outputs
    return captured.warm


def _stream_id(device: torch.device) -> int:
    return torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0


def _pool(device: torch.device, stream: int):
    """The memory pool of the graphs replayed on ``stream``, held by a one-tensor anchor graph kept here:
    capturing into a pool whose every graph is gone is an error in PyTorch (its host-side count is 0),
    and a trainer's schedules, with their graphs, go every step."""
    if (device, stream) not in _POOLS:
        _POOLS[device, stream] = capture(lambda: torch.zeros(1, device=device), None, device)
    return _POOLS[device, stream].graph.pool()
