"""dta_ref.attention against a per-head loop and against torch's SDPA, in float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import dta_ref
from dta_ref import PrefixTree
from tests.helpers import assert_close_report

TREE_SEQS = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 5, 6, 7], [1, 8], [9, 10, 11], [9, 10], [3]]


def loop_attention(q, k, v, mask, scale):
    """One query of one head at a time: softmax over its allowed keys, written out."""
    B, Hq, Tq, D = q.shape
    group = Hq // k.shape[1]
    mask = torch.broadcast_to(mask, (B, Hq, Tq, k.shape[2]))
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            kh, vh = k[b, h // group], v[b, h // group]
            for i in range(Tq):
                keys = mask[b, h, i].nonzero().flatten()
                s = (kh[keys] @ q[b, h, i]) * scale
                w = torch.exp(s - s.max())
                out[b, h, i] = (w / w.sum()) @ vh[keys]
    return out


def random_qkv(B, Hq, Hkv, Tq, Tk, D, dtype=torch.float64, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Tq, D, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, Tk, D, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, Tk, D, generator=gen, dtype=torch.float64).to(dtype)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def random_mask(shape, seed):
    """Random bool mask with at least one allowed key per query row."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=gen) < 0.4
    first = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    return mask.scatter(-1, first[..., None], True)


SHAPES = [
    (1, 1, 1, 1, 1, 4),
    (2, 4, 4, 5, 5, 8),
    (1, 4, 2, 6, 6, 8),
    (2, 6, 2, 3, 7, 16),
    (1, 8, 1, 9, 4, 6),
]
SHAPE_IDS = [f"B{b}-Hq{hq}-Hkv{hkv}-Tq{tq}-Tk{tk}-D{d}" for b, hq, hkv, tq, tk, d in SHAPES]
MASK_KINDS = ["2d", "per-batch", "per-head"]


def mask_shape(kind, B, Hq, Tq, Tk):
    return {"2d": (Tq, Tk), "per-batch": (B, 1, Tq, Tk), "per-head": (B, Hq, Tq, Tk)}[kind]


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_matches_per_head_loop(shape, kind):
    B, Hq, Hkv, Tq, Tk, D = shape
    q, k, v = random_qkv(*shape, seed=1)
    mask = random_mask(mask_shape(kind, B, Hq, Tq, Tk), seed=2)
    scale = 1 / math.sqrt(D)
    out = dta_ref.attention(q, k, v, mask)
    assert out.shape == q.shape and out.dtype == torch.float64
    assert_close_report(out, loop_attention(q, k, v, mask, scale), atol=1e-13, rtol=1e-12, name="attention vs loop")


def sdpa(q, k, v, mask, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_matches_sdpa_outputs_and_gradients(shape, kind):
    B, Hq, Hkv, Tq, Tk, D = shape
    mask = random_mask(mask_shape(kind, B, Hq, Tq, Tk), seed=3)
    q, k, v = random_qkv(*shape, seed=4, requires_grad=True)
    q2, k2, v2 = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = dta_ref.attention(q, k, v, mask)
    ref = sdpa(q2, k2, v2, mask)
    assert_close_report(out, ref, atol=1e-13, rtol=1e-12, name="out")
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q2, k2, v2), grad_out)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert_close_report(g, r, atol=1e-12, rtol=1e-11, name=f"d{name}")


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0], ids=lambda s: f"scale{s}")
def test_explicit_scale(scale):
    q, k, v = random_qkv(1, 4, 2, 5, 5, 8, seed=6)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    out = dta_ref.attention(q, k, v, mask, scale=scale)
    assert_close_report(out, sdpa(q, k, v, mask, scale=scale), atol=1e-13, rtol=1e-12, name="out")
    assert_close_report(out, loop_attention(q, k, v, mask, scale), atol=1e-13, rtol=1e-12, name="out vs loop")


def test_gqa_query_head_uses_kv_head_h_div_group():
    """With Hq = 4, Hkv = 2, query heads 0-1 read kv head 0 and heads 2-3 read kv head 1."""
    q, k, v = random_qkv(1, 4, 2, 3, 3, 4, seed=7)
    mask = torch.ones(3, 3, dtype=torch.bool)
    out = dta_ref.attention(q, k, v, mask)
    for h in range(4):
        single = dta_ref.attention(q[:, h : h + 1], k[:, h // 2 : h // 2 + 1], v[:, h // 2 : h // 2 + 1], mask)
        assert torch.equal(out[:, h : h + 1], single), f"head {h}"


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
def test_tree_mask_matches_sdpa(heads):
    Hq, Hkv = heads
    tree = PrefixTree.from_sequences(TREE_SEQS)
    mask = dta_ref.tree_attention_mask(tree)
    T = tree.num_tokens
    q, k, v = random_qkv(1, Hq, Hkv, T, T, 8, seed=8, requires_grad=True)
    out = dta_ref.attention(q, k, v, mask)
    ref = sdpa(q, k, v, mask)
    assert_close_report(out, ref, atol=1e-13, rtol=1e-12, name="tree attention")
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert_close_report(g, r, atol=1e-12, rtol=1e-11, name=f"d{name}")


def test_tree_attention_equals_causal_attention_per_sequence():
    """Packed token rows of one rollout see exactly that rollout's causal prefix."""
    tree = PrefixTree.from_sequences(TREE_SEQS)
    T = tree.num_tokens
    q, k, v = random_qkv(1, 4, 2, T, T, 8, seed=10)
    out = dta_ref.attention(q, k, v, dta_ref.tree_attention_mask(tree))
    for s in range(tree.num_sequences):
        idx = tree.seq_index[s, : int(tree.lengths[s])]
        n = idx.numel()
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        alone = dta_ref.attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], causal)
        assert_close_report(out[:, :, idx], alone, atol=1e-13, rtol=1e-12, name=f"sequence {s}")


@pytest.mark.parametrize("start", [0, 1, 4, 9], ids=lambda c: f"chunk-from-{c}")
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
def test_query_chunk_with_cached_keys(start, heads):
    """Tq < Tk: queries [start, T) against all T keys give the rows of the full tree attention."""
    Hq, Hkv = heads
    tree = PrefixTree.from_sequences(TREE_SEQS)
    T = tree.num_tokens
    assert 0 <= start < T
    q, k, v = random_qkv(1, Hq, Hkv, T, T, 8, seed=11)
    full = dta_ref.attention(q, k, v, dta_ref.tree_attention_mask(tree))
    positions = torch.arange(start, T)
    mask = dta_ref.mask_from_subtree_end(tree.subtree_end, positions)
    assert tuple(mask.shape) == (T - start, T)
    chunk = dta_ref.attention(q[:, :, start:], k, v, mask)
    assert_close_report(chunk, full[:, :, start:], atol=1e-13, rtol=1e-12, name="chunk vs full")
    assert_close_report(chunk, sdpa(q[:, :, start:], k, v, mask), atol=1e-13, rtol=1e-12, name="chunk vs sdpa")


def test_masked_keys_have_no_influence():
    tree = PrefixTree.from_sequences(TREE_SEQS)
    T = tree.num_tokens
    mask = dta_ref.tree_attention_mask(tree)
    q, k, v = random_qkv(1, 2, 2, T, T, 4, seed=12, requires_grad=True)
    out = dta_ref.attention(q, k, v, mask)
    for i in range(T):
        gk, gv = torch.autograd.grad(out[0, :, i].sum(), (k, v), retain_graph=True)
        hidden = ~mask[i]
        assert bool((gk[0, :, hidden] == 0).all()) and bool((gv[0, :, hidden] == 0).all()), f"query {i}"
        assert bool((gv[0, :, mask[i]] != 0).any()), f"query {i} must depend on its visible values"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_computes_in_float32(dtype):
    q, k, v = random_qkv(1, 4, 2, 6, 6, 8, dtype=dtype, seed=13)
    mask = random_mask((6, 6), seed=14)
    out = dta_ref.attention(q, k, v, mask)
    assert out.dtype == dtype
    expected = dta_ref.attention(q.float(), k.float(), v.float(), mask).to(dtype)
    assert torch.equal(out, expected)
    truth = loop_attention(q.double(), k.double(), v.double(), mask, 1 / math.sqrt(8))
    rounding = torch.finfo(dtype).eps
    assert_close_report(out, truth, atol=rounding, rtol=rounding, name=f"{dtype} vs float64")


def test_mask_from_subtree_end_matches_tree_mask():
    tree = PrefixTree.from_sequences(TREE_SEQS)
    full = dta_ref.mask_from_subtree_end(tree.subtree_end, torch.arange(tree.num_tokens))
    assert torch.equal(full, dta_ref.tree_attention_mask(tree))
    assert full.dtype == torch.bool


def test_tree_mask_is_the_rule_key_j_for_its_subtree():
    """tree_mask(i, j, end) is j <= i < end[j], elementwise, broadcast, batched, and as a FlexAttention
    mask_mod: the BlockMask it builds densifies to the same mask."""
    tree = PrefixTree.from_sequences(TREE_SEQS)
    end, T = tree.subtree_end, tree.num_tokens
    rule = torch.tensor([[j <= i < int(end[j]) for j in range(T)] for i in range(T)])
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    assert torch.equal(dta_ref.tree_mask(i, j, end), rule)
    assert all(
        bool(dta_ref.tree_mask(torch.tensor(a), torch.tensor(b), end)) == bool(rule[a, b])
        for a in range(T)
        for b in range(T)
    )
    batched = dta_ref.tree_mask(i, j, torch.stack([end, torch.arange(1, T + 1)]))  # a tree, then singletons
    assert torch.equal(batched[0], rule) and torch.equal(batched[1], torch.eye(T, dtype=torch.bool))
    assert torch.equal(dta_ref.tree_attention_mask(tree), rule)

    from torch.nn.attention.flex_attention import create_block_mask

    block = create_block_mask(lambda b, h, q, kv: dta_ref.tree_mask(q, kv, end), 1, 1, T, T, device="cpu", BLOCK_SIZE=4)
    live = block.to_dense()[0, 0].bool().repeat_interleave(4, 0).repeat_interleave(4, 1)[:T, :T]
    assert not (rule & ~live).any()  # every visible pair lies in a block the BlockMask keeps
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = random_qkv(1, 2, 2, T, T, 8, dtype=torch.float32)
    out = flex_attention(q, k, v, block_mask=block)
    assert_close_report(out, dta_ref.tree_attention(q, k, v, end), atol=1e-5, rtol=1e-5, name="flex vs twin")


def test_tree_attention_twin_of_the_kernel():
    """dta_ref.tree_attention has the kernel's signature, and equals attention under its explicit mask, for
    a cached prefix, a tree per batch row, GQA; its LSE is the log-sum-exp of the visible scaled scores."""
    import inspect

    fast = pytest.importorskip("dta_fast").tree_attention if importlib_has("triton") else None
    ref_params = inspect.signature(dta_ref.tree_attention).parameters
    if fast is not None:
        fast_params = inspect.signature(fast).parameters
        for name, param in ref_params.items():
            assert name in fast_params and fast_params[name].kind == param.kind, name
            if name != "subtree_end":  # the kernel's may come from a schedule instead
                assert fast_params[name].default == param.default, name
    trees = [PrefixTree.from_sequences(TREE_SEQS).subtree_end, PrefixTree.from_sequences(TREE_SEQS[::-1]).subtree_end]
    T = trees[0].numel()
    for end, Tq in ((trees[0], T), (trees[0], 5), (torch.stack(trees), 7)):
        q, k, v = random_qkv(2, 4, 2, Tq, T, 8, seed=Tq)
        mask = dta_ref.mask_from_subtree_end(end, torch.arange(T - Tq, T))
        mask = mask[:, None] if mask.dim() == 3 else mask
        out, lse = dta_ref.tree_attention(q, k, v, end, 0.3, return_lse=True)
        torch.testing.assert_close(out, dta_ref.attention(q, k, v, mask, 0.3), rtol=0, atol=0)
        s = torch.matmul(q, k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
        torch.testing.assert_close(lse, torch.logsumexp(s.masked_fill(~mask, -math.inf), -1).float())
    with pytest.raises(ValueError, match="subtree_end has shape"):
        dta_ref.tree_attention(q, k, v, end[..., :-1])
    with pytest.raises(ValueError, match="crosses|exceeds|subtree"):
        dta_ref.tree_attention(q, k, v, torch.full((2, T), 1))


def importlib_has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
