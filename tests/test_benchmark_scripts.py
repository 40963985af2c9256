"""The benchmark scripts' own machinery on small trees: the timings need a GPU, but the parts that
build schedules, check them and load kernel copies run anywhere, and a change to the library's
internals should break here rather than on a GPU machine at measuring time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import attention_timeline  # noqa: E402
import bench_schedule  # noqa: E402
import compare_attention  # noqa: E402

import dta_fast  # noqa: E402
from dta_ref import PrefixTree, grpo_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_schedule_benchmark_builds_and_gates(head_dim):
    """bench_schedule.py's build (the three kernels' lists at a head dim's blocks) and its gate, the
    block lists against a dense reference."""
    end = PrefixTree.from_sequences(grpo_batch(1, 40, 3, 20)).subtree_end.to(DEVICE)
    schedule = bench_schedule.build(end, end.numel(), True, head_dim)
    assert schedule._lists and schedule._order
    for (BM, BN), lists in schedule._lists.items():
        assert lists.rows() == bench_schedule.reference_rows(end, BM, BN)


def test_compare_attention_loads_an_independent_copy():
    """compare_attention.py's NAME=PATH: the copy is a module of its own whose results equal the
    library's."""
    copy = compare_attention.load("copy", dta_fast.attention.__file__)
    assert copy is not dta_fast.attention and copy.tree_attention is not dta_fast.tree_attention
    end = PrefixTree.from_sequences(grpo_batch(1, 24, 2, 12)).subtree_end.to(DEVICE)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, end.numel(), 16, generator=g).to(DEVICE) for _ in range(3))
    expected = dta_fast.tree_attention(q, k, v, schedule=dta_fast.build_schedule(end))
    assert torch.equal(copy.tree_attention(q, k, v, schedule=copy.build_schedule(end)), expected)


def test_attention_timeline_counts_each_kernels_products():
    """attention_timeline.py's useful TFLOP/s: 2, 4 and 3 products per visible pair for the forward,
    dK/dV and dQ kernels by their names (the Triton and the Hopper twins), none for the passes around
    them."""
    from dta_fast import attention, attention_hopper

    def name(kernel):
        while hasattr(kernel, "fn"):  # an autotuner wraps a JIT function, which wraps the Python one
            kernel = kernel.fn
        return kernel.__name__

    kernels = {attention.tree_attention_fwd_kernel: 2, attention.tree_attention_bwd_dkdv_kernel: 4,
               attention.tree_attention_bwd_dq_kernel: 3, attention.tree_attention_bwd_preprocess_kernel: None,
               attention.finite_rows_kernel: None, attention.queries_seeing_kernel: None}  # fmt: skip
    if attention_hopper.HAVE_GLUON:
        kernels.update({attention_hopper.tree_attention_fwd_hopper_kernel: 2,
                        attention_hopper.tree_attention_bwd_dkdv_hopper_kernel: 4,
                        attention_hopper.tree_attention_bwd_dq_hopper_kernel: 3})  # fmt: skip
    for kernel, products in kernels.items():
        assert attention_timeline._products(name(kernel)) == products, name(kernel)


def test_dq_reductions_walk_the_live_query_tiles():
    """bench_dq_reductions.py's tiles per key block are those with a visible (query, key) pair: what
    the dK/dV pass walks, so the timed additions are the ones a fused backward would make."""
    import bench_dq_reductions as bench

    end = PrefixTree.from_sequences(grpo_batch(1, 300, 3, 170)).subtree_end.reshape(-1).long()
    T = end.numel()
    pos = torch.arange(T)
    visible = (pos[None, :] <= pos[:, None]) & (pos[:, None] < end[None, :])  # [query, key]
    m_lo, m_hi, order = bench.live_tiles(end)
    for n in range(m_lo.numel()):
        keys = visible[:, n * bench.KEYS:(n + 1) * bench.KEYS].any(1)
        tiles = {int(i) // bench.ROWS for i in keys.nonzero()}
        assert tiles == set(range(int(m_lo[n]), int(m_hi[n]))), n
    assert sorted(order.tolist()) == list(range(m_lo.numel()))
    assert (m_hi - m_lo)[order].diff().le(0).all()  # longest first


@pytest.mark.parametrize("cached", [0, 150])
def test_stored_ds_tiles_cover_every_walked_query_block_once(cached):
    """bench_stored_ds.py's tile index: each key block of 128 gets a tile per query block of 64 its
    dK/dV program walks, all tiles distinct and none left over, and every (query block, key block of
    64) with a visible pair, what its dQ pass reads, is among them (with a cached prefix too)."""
    import bench_stored_ds as bench

    end = PrefixTree.from_sequences(grpo_batch(1, 300, 3, 170)).subtree_end.to(torch.int32).reshape(1, -1)
    T = end.shape[1]
    Tq = T - cached
    base, tiles = bench.ds_tiles(end.to(DEVICE).contiguous(), Tq)
    rows = 64
    pos_k = torch.arange(T)
    pos_q = torch.arange(Tq) + cached
    visible = (pos_k[None, :] <= pos_q[:, None]) & (pos_q[:, None] < end[0][None, :].long())  # [query, key]
    seen = []
    for nb in range(-(-T // 128)):
        keys = torch.arange(nb * 128, min(nb * 128 + 128, T))
        m_lo = max(nb * 128 - cached, 0) // rows
        m_hi = -(-(int(end[0, keys].max()) - cached) // rows)
        seen += [int(base[nb]) + m for m in range(m_lo, m_hi)]
        for m in {int(i) // rows for i in visible[:, keys].any(1).nonzero()}:
            assert m_lo <= m < m_hi, (nb, m)  # the dQ pass's tile was written
    assert sorted(seen) == list(range(tiles))


def test_power_benchmark_times_the_passes_of_a_call():
    """bench_power.py's passes, called as it times them, give the call's own output and gradients:
    it times the library's passes with the arguments a call gives them."""
    import bench_power

    end = PrefixTree.from_sequences(grpo_batch(1, 30, 3, 17)).subtree_end.to(DEVICE)
    schedule = dta_fast.build_schedule(end)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, end.numel(), 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    k_gqa, v_gqa = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()
    do = torch.randn(1, 4, end.numel(), 16, generator=g).to(DEVICE)
    o = dta_fast.tree_attention(q, k_gqa, v_gqa, schedule=schedule)
    o.backward(do)
    calls = bench_power.pass_calls(q.detach(), k_gqa.detach(), v_gqa.detach(), do, schedule)
    assert set(calls) == {"forward", "preprocess", "dkdv", "k_copy", "dq"}
    assert torch.equal(calls["forward"]()[0], o.detach())
    dk, dv = calls["dkdv"]()
    assert torch.equal(dk, k_gqa.grad) and torch.equal(dv, v_gqa.grad)
    assert torch.equal(calls["dq"](), q.grad)


def test_power_benchmark_sample_window():
    """bench_power.py's sampler window: the samples inside it, or the first after its start when it is
    shorter than a sample; the clock-limit reasons seen, by name."""
    import bench_power

    sampler = bench_power.Sampler.__new__(bench_power.Sampler)  # no nvidia-smi: samples set by hand
    sampler.samples = [(1.0, 1980.0, 120.0, 0x1), (2.0, 1700.0, 690.0, 0x4), (3.0, 1600.0, 700.0, 0x4)]
    w = sampler.window(1.5, 3.0)
    assert (w["samples"], w["mhz"], w["watts"], w["reasons"]) == (2, 1650.0, 695.0, ["power cap"])
    assert sampler.window(2.2, 2.4)["mhz"] == 1600.0
    assert sampler.window(0.0, 1.0)["reasons"] == ["idle"]
    assert sampler.window(4.0, 5.0) == dict(samples=0)
