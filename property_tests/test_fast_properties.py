"""dta_fast against dta_ref on generated trees.

Without a GPU the Triton kernels run under the interpreter, so sizes stay
small and examples few; on a GPU the same properties run on the real kernels.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
pytestmark = pytest.mark.kernel

import dta_fast  # noqa: E402
import dta_ref  # noqa: E402
from property_tests.strategies import rollout_sets, seeds  # noqa: E402
from tests.attention_checks import check_tree_attention, subtree_end_from_depths  # noqa: E402
from tests.helpers import assert_close_report, assert_grads_close, param_grads, tiny_decoder, tiny_hf_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
few = settings(max_examples=max(3, settings.default.max_examples // 3))


@st.composite
def preorder_depths(draw, max_tokens=70):
    """Depths of any preorder forest: each token is a root, a child of the previous token, or climbs up."""
    T = draw(st.integers(1, max_tokens))
    depths = [0]
    for _ in range(T - 1):
        depths.append(draw(st.integers(0, depths[-1] + 1)))
    return depths


@few
@given(
    depths=preorder_depths(),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
    head_dim=st.sampled_from([16, 32, 48]),
    prefix_fraction=st.sampled_from([0.0, 0.3, 0.9]),
    # the default scale 1/sqrt(D) in both dtypes; in float32 also a larger, a zero and a negative one. Not
    # in float16: the backward's delta = rowsum(dO * O) reads O rounded to 16 bits (as every flash-style
    # backward does), and the scale multiplies that rounding into dQ and dK past the check's bound, which
    # comes from torch's own 16-bit error (a 2-key row at scale 0.5 fails it, with the kernels of 8bc01cb too)
    dtype_and_scale=st.one_of(
        st.tuples(st.sampled_from([torch.float32, torch.float16]), st.none()),
        st.tuples(st.just(torch.float32), st.sampled_from([0.5, 0.0, -0.3])),
    ),
    seed=seeds(),
)
def test_tree_attention_matches_reference(depths, heads, head_dim, prefix_fraction, dtype_and_scale, seed):
    dtype, scale = dtype_and_scale
    end = subtree_end_from_depths(depths).to(DEVICE)
    Tk = len(depths)
    Tq = max(1, Tk - int(prefix_fraction * Tk))
    Hq, Hkv = heads
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(1, Hq, Tq, head_dim, generator=g, device=DEVICE, dtype=dtype)
    k = torch.randn(1, Hkv, Tk, head_dim, generator=g, device=DEVICE, dtype=dtype)
    v = torch.randn(1, Hkv, Tk, head_dim, generator=g, device=DEVICE, dtype=dtype)
    check_tree_attention(q, k, v, end, scale=scale, seed=seed)


@few
@given(
    depths=preorder_depths(),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    dims=st.sampled_from([(16, 16), (32, 16), (16, 32), (48, 24)]),  # (q/k, v) head dims: MLA's differ
    window=st.one_of(st.none(), st.integers(1, 12)),
    sinks=st.booleans(),
    softcap=st.one_of(st.none(), st.sampled_from([1.0, 5.0])),
    prefix_fraction=st.sampled_from([0.0, 0.5]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=seeds(),
)
def test_tree_attention_variants_match_reference(depths, heads, dims, window, sinks, softcap, prefix_fraction, dtype,
                                                 seed):  # fmt: skip
    """Sliding windows over the depths, attention sinks, logit softcaps and a value head dim of its own, in any
    combination: output, LSE and every gradient (the sinks' included) as the reference's."""
    end = subtree_end_from_depths(depths).to(DEVICE)
    Tk = len(depths)
    Tq = max(1, Tk - int(prefix_fraction * Tk))
    (Hq, Hkv), (D, Dv) = heads, dims
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(1, Hq, Tq, D, generator=g, device=DEVICE, dtype=dtype)
    k = torch.randn(1, Hkv, Tk, D, generator=g, device=DEVICE, dtype=dtype)
    v = torch.randn(1, Hkv, Tk, Dv, generator=g, device=DEVICE, dtype=dtype)
    s = torch.randn(Hq, generator=g, device=DEVICE) if sinks else None
    pos = torch.tensor(depths, device=DEVICE) if window else None
    check_tree_attention(q, k, v, end, seed=seed, position_ids=pos, window=window, sinks=s, softcap=softcap)


@few
@given(depths=preorder_depths(max_tokens=200))
def test_validation_accepts_every_preorder_forest(depths):
    dta_fast.validate_subtree_end(subtree_end_from_depths(depths)[None])


@few
@given(depths=preorder_depths(max_tokens=60), data=st.data())
def test_validation_rejects_crossing_ranges(depths, data):
    """Moving one subtree end inside a proper descendant's range (or past its parent's) must be refused."""
    end = subtree_end_from_depths(depths)
    T = len(depths)
    j = data.draw(st.integers(0, T - 1))
    new = data.draw(st.integers(j + 1, T))
    if new == int(end[j]):
        return
    bad = end.clone()
    bad[j] = new
    # the changed array is still valid only if it describes some preorder forest
    still_valid = _is_preorder_forest(bad.tolist())
    if still_valid:
        dta_fast.validate_subtree_end(bad[None])
    else:
        with pytest.raises(ValueError, match="preorder forest"):
            dta_fast.validate_subtree_end(bad[None])


def _is_preorder_forest(end):
    """Brute force: every two ranges [j, end[j]) are nested or disjoint."""
    T = len(end)
    for a in range(T):
        for b in range(a + 1, T):
            if b < end[a] < end[b]:
                return False
    return True


@few
@given(sequences=rollout_sets(max_sequences=6, max_len=12), seed=seeds())
def test_fast_tree_logprobs_match_flat(sequences, seed):
    """Reference decoder in float32: logprobs and parameter gradients, tree kernel vs each sequence alone."""
    tree = dta_ref.PrefixTree.from_sequences(sequences)
    model = tiny_decoder(torch.float32, seed=seed).to(DEVICE)
    exact = copy.deepcopy(model).double()
    flat64 = dta_ref.flat_logprobs(exact, sequences)
    flat32 = dta_ref.flat_logprobs(model, sequences)
    fast = dta_fast.tree_logprobs(model, tree, attention_impl="kernel")
    err_flat = (flat32.double() - flat64).abs().amax().item() if flat64.numel() else 0.0
    assert_close_report(fast, flat64, atol=4 * err_flat + 1e-5, rtol=0, name="logprobs")
    g_fast = param_grads(model, fast.sum())
    g_flat = param_grads(exact, flat64.sum())
    assert_grads_close({n: g.double() for n, g in g_fast.items()}, g_flat, rel=1e-4, name="grad")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fast_tree_logprobs_hf(family):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 64, 9).tolist()
    sequences = [prompt + rng.integers(0, 64, int(n)).tolist() for n in (5, 1, 7)] + [[3, 4]]
    tree = dta_ref.PrefixTree.from_sequences(sequences)
    model = tiny_hf_model(family, torch.float32, "sdpa").to(DEVICE)
    exact = copy.deepcopy(model).double()
    flat64 = dta_ref.flat_logprobs(exact, sequences)
    fast = dta_fast.tree_logprobs(model, tree, attention_impl="kernel")
    assert_close_report(fast, flat64, atol=2e-5, rtol=0, name="logprobs")
    g_fast = param_grads(model, fast.sum())
    g_flat = param_grads(exact, flat64.sum())
    assert_grads_close({n: g.double() for n, g in g_fast.items()}, g_flat, rel=1e-4, name="grad")
