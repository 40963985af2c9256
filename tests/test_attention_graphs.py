"""Small tree attention calls replayed from CUDA graphs (dta_fast/attention/graphed.py).

On CPU the orchestration runs under the interpreter with a stand-in for the capture (first call eager,
second captures and returns its warm-up, later ones replay, a failed capture stays eager); on GPU the
real graphs: every output and gradient bitwise the eager call's, and memory that stays put over steps.
"""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.kernel

from dta_fast import build_schedule, tree_attention  # noqa: E402
from dta_fast.attention import graphed  # noqa: E402
from dta_fast.cuda_graphs import Captured  # noqa: E402
from dta_ref import PrefixTree, grpo_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VARIANTS = {
    "plain": dict(),
    "window-sinks": dict(window=5, sinks=True),
    "softcap": dict(softcap=3.0),
}


def problem(tree, Hq, Hkv, D, dtype, seed, sinks=False, Dv=None):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    T = tree.num_tokens

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=DEVICE, dtype=dtype).requires_grad_(True)

    q, k, v = rand(1, Hq, T, D), rand(1, Hkv, T, D), rand(1, Hkv, T, Dv or D)
    s = torch.randn(Hq, generator=g, device=DEVICE).requires_grad_(True) if sinks else None
    do = torch.randn(1, Hq, T, Dv or D, generator=g, device=DEVICE, dtype=dtype)
    return q, k, v, s, do


def fwd_bwd(schedule, q, k, v, sinks, do, **options):
    out = tree_attention(q, k, v, schedule=schedule, sinks=sinks, **options)
    leaves = [x for x in (q, k, v, sinks) if x is not None]
    grads = torch.autograd.grad(out, leaves, do)
    return [out.detach(), *grads]


class StandIn:
    """``capture`` off CUDA: runs the warm-up and the captured call; its graph replays the captured
    call on the buffers and writes into the captured outputs, as a CUDA graph does."""

    def __init__(self, fail=False):
        self.captures, self.replays, self.fail = 0, 0, fail

    def __call__(self, fn, pool, device):
        warm = fn()
        self.captures += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        outputs = fn()
        counter = self

        class Graph:
            def replay(self):
                counter.replays += 1
                for out, new in zip(outputs, fn()):
                    if out is not None:
                        out.copy_(new)

        return Captured(Graph(), warm, outputs)


@pytest.mark.parametrize("fail", [False, True], ids=["captures", "capture-fails"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_graphed_calls_orchestration(variant, fail, monkeypatch):
    """Through tree_attention with a stand-in capture: per pass the first call runs eagerly, the second
    captures (its warm-up's results stand), later calls replay on new inputs; each call's output and
    every gradient equal an eager call's; a failed capture leaves that call eager."""
    options = dict(VARIANTS[variant])
    sinks = options.pop("sinks", False)
    tree = PrefixTree.from_sequences(grpo_batch(1, 12, 3, 9, vocab_size=50))
    pos = tree.position_ids.to(DEVICE) if "window" in options else None
    end = tree.subtree_end.to(DEVICE)
    want = []
    for seed in range(4):
        want.append(fwd_bwd(build_schedule(end, position_ids=pos), *problem(tree, 4, 2, 16, torch.float32, seed, sinks),
                            **options))  # fmt: skip
    stand_in = StandIn(fail)
    monkeypatch.setattr(graphed, "applies", lambda q: True)
    monkeypatch.setattr(graphed, "capture", stand_in)
    monkeypatch.setattr(graphed, "_pool", lambda device, stream: None)
    schedule = build_schedule(end, position_ids=pos)
    for seed in range(4):
        got = fwd_bwd(schedule, *problem(tree, 4, 2, 16, torch.float32, seed, sinks), **options)
        for a, b in zip(got, want[seed]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert stand_in.captures == 2  # the forward's and the backward's
    assert stand_in.replays == (0 if fail else 4)  # calls 3 and 4 of each
    entries = list(schedule.graphs.values())
    assert len(entries) == 2 and all((e.graph is None) == fail and (e.error is not None) == fail for e in entries)


def test_graphed_calls_keyed_by_layout(monkeypatch):
    """A call whose inputs differ in shape, layout or dtype gets a graph of its own."""
    monkeypatch.setattr(graphed, "applies", lambda q: True)
    monkeypatch.setattr(graphed, "capture", StandIn())
    monkeypatch.setattr(graphed, "_pool", lambda device, stream: None)
    tree = PrefixTree.from_sequences(grpo_batch(1, 12, 3, 9, vocab_size=50))
    schedule = build_schedule(tree.subtree_end.to(DEVICE))
    q, k, v, _, _ = problem(tree, 4, 2, 16, torch.float32, 0)
    with torch.no_grad():
        calls = [
            (q, k, v),
            (q.transpose(1, 2).contiguous().transpose(1, 2), k, v),  # strides
            (q[:, :2], k[:, :1], v[:, :1]),  # heads
            (q.half(), k.half(), v.half()),
        ]
        for args in calls:
            want = tree_attention(*args, schedule=build_schedule(tree.subtree_end.to(DEVICE)))
            for _ in range(3):
                assert torch.equal(tree_attention(*args, schedule=schedule), want)
    assert len(schedule.graphs) == len(calls)
    assert all(e.graph is not None for e in schedule.graphs.values())


def test_graphed_calls_apply_only_where_they_can():
    """Never off CUDA or under the interpreter; on CUDA not above MAX_ELEMENTS nor inside a capture."""
    q = torch.zeros(1, 2, 8, 16)
    assert not graphed.applies(q)
    if DEVICE == "cuda":
        small = torch.zeros(1, 2, 8, 16, device="cuda")
        big = torch.empty(graphed.MAX_ELEMENTS + 1, device="cuda").view(1, 1, -1, 1)
        assert graphed.applies(small) == graphed.ENABLED and not graphed.applies(big)


def _assert_bitwise(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        same = (a == b) | (a.isnan() & b.isnan())
        assert bool(same.all()), f"tensor {i}: {int((~same).sum())} of {a.numel()} differ"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "D, dtype, variant",
    [(64, torch.bfloat16, "plain"), (128, torch.bfloat16, "plain"), (128, torch.float32, "plain"),
     (64, torch.bfloat16, "window-sinks"), (128, torch.bfloat16, "softcap")],
)  # fmt: skip
def test_gpu_graphed_calls_are_bitwise_eager(D, dtype, variant, monkeypatch):
    """Six layers' forward + backward over one schedule, new inputs each: layer 1 eager, layer 2
    captures, layers 3-6 replay; every output and gradient bitwise an eager call's (graphs off), a
    non-finite value row isolated as eagerly, inputs laid out as a model's (heads transposed)."""
    gc.collect()  # a dead graph freed during a capture invalidates it
    options = dict(VARIANTS[variant])
    sinks = options.pop("sinks", False)
    tree = PrefixTree.from_sequences(grpo_batch(1, 700, 4, 300))
    pos = tree.position_ids.cuda() if "window" in options else None
    end = tree.subtree_end.cuda()
    if "window" in options:
        options["window"] = 128
    layers = []
    for seed in range(6):
        q, k, v, s, do = problem(tree, 8, 2, D, dtype, seed, sinks)
        q = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)  # [B, T, H, D] storage
        if seed == 4:
            with torch.no_grad():
                v[0, 1, 500] = float("nan")
        layers.append((q, k, v, s, do))
    monkeypatch.setattr(graphed, "ENABLED", False)
    want = [fwd_bwd(build_schedule(end, position_ids=pos), *layer, **options) for layer in layers]
    monkeypatch.setattr(graphed, "ENABLED", True)
    schedule = build_schedule(end, position_ids=pos)
    got = [fwd_bwd(schedule, *layer, **options) for layer in layers]
    assert len(schedule.graphs) == 2 and all(e.graph is not None for e in schedule.graphs.values()), [
        e.error for e in schedule.graphs.values()
    ]
    for g, w in zip(got, want):
        _assert_bitwise(g, w)
    assert bool(got[4][0].isnan().any()) and bool(got[3][0].isfinite().all())


@pytest.mark.gpu
def test_gpu_graphed_calls_memory_stays_put():
    """A step per new schedule (as a trainer builds one a step): after the first steps the graphs' memory
    is reused, so the reserved memory stops growing; a call inside a user's capture runs eagerly."""
    gc.collect()
    tree = PrefixTree.from_sequences(grpo_batch(1, 700, 4, 300))
    end = tree.subtree_end.cuda()
    reserved = []
    for _ in range(6):
        schedule = build_schedule(end)
        for layer in range(4):
            fwd_bwd(schedule, *problem(tree, 8, 2, 64, torch.bfloat16, layer))
        del schedule
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] == reserved[2], reserved
    q, k, v, _, _ = problem(tree, 8, 2, 64, torch.bfloat16, 0)
    schedule = build_schedule(end)
    with torch.no_grad():
        want = tree_attention(q, k, v, schedule=schedule)
        tree_attention(q, k, v, schedule=schedule)
        gc.collect()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tree_attention(q, k, v, schedule=schedule)
    graph.replay()
    assert torch.equal(out, want)
