"""Tree attention with an explicit T x T mask: the readable ground truth.

``tree_mask`` is the attention rule; ``tree_attention`` is the twin of ``dta_fast.tree_attention``
(same signature), which computes the same function from ``subtree_end`` alone, without ever building
the mask; ``attention`` is softmax attention under any explicit mask.
"""

from __future__ import annotations

import math

import torch
from einops import repeat

from .checks import check_scale
from .tree import PrefixTree, nesting_depth


def tree_mask(q_idx: torch.Tensor, kv_idx: torch.Tensor, subtree_end: torch.Tensor) -> torch.Tensor:
    """True where the query at key position ``q_idx`` may attend key ``kv_idx``: ``kv_idx <= q_idx <
    subtree_end[kv_idx]``. Key j is visible exactly to its own subtree, which in preorder is the
    contiguous range ``[j, subtree_end[j])`` (docs/prefix_tree.md).

    The one mask predicate of the project. It broadcasts (``q_idx[:, None]``, ``kv_idx[None, :]``:
    [Tq, Tk]; a batched ``subtree_end`` [B, Tk] gives [B, Tq, Tk]) and is a FlexAttention ``mask_mod``
    as it stands: ``lambda b, h, q, kv: tree_mask(q, kv, subtree_end)``.
    """
    end = subtree_end[kv_idx] if subtree_end.dim() == 1 else subtree_end[:, kv_idx]
    return (kv_idx <= q_idx) & (q_idx < end)


def tree_attention_mask(tree: PrefixTree) -> torch.Tensor:
    """bool [T, T]: ``mask[i, j]`` is True iff query i may attend key j (:func:`tree_mask`)."""
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"expected a PrefixTree, got {type(tree).__name__}")
    i = torch.arange(tree.num_tokens, device=tree.subtree_end.device)
    return mask_from_subtree_end(tree.subtree_end, i)


def mask_from_subtree_end(subtree_end: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """bool [..., Tq, Tk] for queries at key positions ``query_positions`` (e.g. after a cached prefix).

    ``subtree_end`` is [Tk] or batched [..., Tk].
    """
    for name, t in (("subtree_end", subtree_end), ("query_positions", query_positions)):
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    j = torch.arange(subtree_end.shape[-1], device=subtree_end.device)
    return tree_mask(query_positions[:, None], j[None, :], subtree_end)


def refuse_create_graph(what: str) -> None:
    """Call first in the backward of an autograd Function whose backward builds no graph: with
    ``create_graph=True`` (grad mode on in the backward) its gradient would silently lack its
    second-order part, so refuse instead."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what} is differentiable once: its backward builds no graph, so create_graph=True (a second "
            "derivative, a gradient penalty) is not supported"
        )


def autocast_inputs(q, k, v):
    """q, k, v as autocast hands them to SDPA: all three in its dtype where autocast is on for their
    device (under autocast a model's projections give 16-bit q, k, v and RoPE's float32 tables turn q and
    k back to float32), else as they are."""
    if isinstance(q, torch.Tensor) and torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        # float64 stays itself, as autocast leaves it (the float64 ground truth keeps its digits)
        cast = lambda x: isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
        return tuple(x.to(dtype) if cast(x) else x for x in (q, k, v))
    return q, k, v


def attention(q, k, v, mask, scale=None):
    """Softmax attention with an explicit boolean mask (True = may attend).

    q [B, Hq, Tq, D]; k, v [B, Hkv, Tk, D] with Hq a multiple of Hkv (GQA);
    mask broadcastable to [B, Hq, Tq, Tk]. Returns [B, Hq, Tq, D] in q's dtype.
    Every query must be allowed at least one key. A key a query may not attend
    never reaches its output or gradients, even when the key's rows hold NaN
    or inf; a query that attends a non-finite value row gets NaN. Under
    autocast, q, k and v are first cast to its dtype, as SDPA's are.
    """
    q, k, v = autocast_inputs(q, k, v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, T, D], got shape {tuple(x.shape)}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, x in (("q", q), ("k", k)):
        if 0 in x.shape[1:]:
            raise ValueError(f"{name} has shape {tuple(x.shape)}: heads, tokens and head dim must be at least 1")
    B, Hq, Tq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    Bk, Hkv, Tk, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in batch or head dim")
    if Hq % Hkv != 0:
        raise ValueError(f"number of query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
    if mask.dim() > 4 or mask.dim() < 2:
        raise ValueError(f"mask must be 2-D to 4-D, broadcastable to {[B, Hq, Tq, Tk]}; got shape {tuple(mask.shape)}")
    try:
        mask = torch.broadcast_to(mask, (B, Hq, Tq, Tk))
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} is not broadcastable to {[B, Hq, Tq, Tk]}") from None
    if not bool(mask.any(dim=-1).all()):
        raise ValueError("mask has a query row with no allowed key; softmax over it is undefined")

    # Low-precision inputs are computed in float32, as every fused kernel does.
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    # a scale past the compute dtype's range would make every score inf, and the softmax NaN
    scale = 1.0 / math.sqrt(D) if scale is None else check_scale(scale, torch.finfo(compute).max)
    group = Hq // Hkv
    k = repeat(k, "b h t d -> b (h g) t d", g=group)
    v = repeat(v, "b h t d -> b (h g) t d", g=group)
    with torch.autocast(q.device.type, enabled=False):  # in ``compute``, not in autocast's dtype
        out = _MaskedAttention.apply(q.to(compute), k.to(compute), v.to(compute), mask, scale)
    return out.to(q.dtype)


def tree_attention(q, k, v, subtree_end, scale=None, *, return_lse=False):
    """Tree attention with the explicit mask of :func:`tree_mask`: the readable twin of
    ``dta_fast.tree_attention``, with its signature.

    q [B, Hq, Tq, D]; k, v [B, Hkv, Tk, D]; subtree_end [Tk] or [B, Tk] int. The queries are the last Tq
    key positions (Tq < Tk: the first Tk - Tq keys are a cached prefix). Returns the output [B, Hq, Tq, D]
    and, with ``return_lse=True``, the natural-log LSE of the scaled visible scores [B, Hq, Tq] in float32
    (no gradient).
    """
    if not isinstance(subtree_end, torch.Tensor):
        raise TypeError(f"subtree_end must be an integer tensor [Tk] or [B, Tk], got {type(subtree_end).__name__}")
    if subtree_end.dim() not in (1, 2):
        raise ValueError(f"subtree_end must be [Tk] or [B, Tk], got shape {tuple(subtree_end.shape)}")
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, H, T, D]")
    Tq, Tk = q.shape[2], k.shape[2]
    if subtree_end.shape[-1] != Tk:
        raise ValueError(f"subtree_end has shape {tuple(subtree_end.shape)}, but k has {Tk} keys")
    if not 1 <= Tq <= Tk:
        raise ValueError(f"{Tq} queries for {Tk} keys: the queries are the last Tq key positions")
    nesting_depth(subtree_end if subtree_end.dim() == 2 else subtree_end[None])  # a preorder forest
    end = subtree_end.to(q.device)
    mask = mask_from_subtree_end(end, torch.arange(Tk - Tq, Tk, device=q.device))
    mask = mask[:, None] if mask.dim() == 3 else mask  # [B, 1, Tq, Tk] for one tree per batch row
    out = attention(q, k, v, mask, scale)
    if not return_lse:
        return out
    q, k, _ = autocast_inputs(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else check_scale(scale)
    k = repeat(k, "b h t d -> b (h g) t d", g=q.shape[1] // k.shape[1])
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        scores = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale
        lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return out, lse.float()


def masked_attend(mask: torch.Tensor):
    """The ``attend(layer, q, k, v, scale)`` of ``adapter.hidden_states``: explicit-mask attention under ``mask``."""

    def attend(layer, q, k, v, scale):
        return attention(q, k, v, mask, scale)

    return attend


def _masked_matmul(a, b, mask):
    """sum over k with mask[m, k] of a[m, k] * b[k]: [..., M, N], for a [..., M, K] that is 0 where ~mask.

    A plain a @ b would add 0 * NaN = NaN from a non-finite row of b to every
    row m; here such a row reaches only the rows m that select it (as NaN).
    """
    bad = ~torch.isfinite(b).all(-1)  # [..., K]
    out = torch.matmul(a, b.masked_fill(bad[..., None], 0.0))
    reached = (mask & bad[..., None, :]).any(-1)  # [..., M]
    return out.masked_fill(reached[..., None], float("nan"))


class _MaskedAttention(torch.autograd.Function):
    """softmax(q k^T * scale over the allowed keys) v, forward and backward over allowed pairs only.

    Every output and gradient element is computed from the (query, key) pairs
    the mask allows and nothing else, so a NaN or inf in one rollout's rows
    never reaches a query (or a key's gradient) of another: masked entries are
    selected away, never multiplied by zero. The backward is the textbook one,
    written out with the same selection (tests/test_adversarial.py checks it
    with gradcheck and against autograd through plain masked softmax).
    """

    # In place where it is safe (nothing here is recorded by autograd): two [Tq, Tk] buffers at most.

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [B, Hq, Tq, Tk]
        probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1)
        del scores
        probs.masked_fill_(~mask, 0.0)  # a NaN row's softmax is NaN on masked entries too
        ctx.save_for_backward(q, k, v, mask, probs)
        ctx.scale = scale
        return _masked_matmul(probs, v, mask)

    @staticmethod
    def backward(ctx, grad_out):
        refuse_create_graph("dta_ref.attention")  # the saved probs carry no graph
        q, k, v, mask, probs = ctx.saved_tensors
        mask_t = mask.transpose(-1, -2)
        grad_v = _masked_matmul(probs.transpose(-1, -2), grad_out, mask_t)
        grad = torch.matmul(grad_out, v.transpose(-1, -2)).masked_fill_(~mask, 0.0)  # d probs
        delta = (probs * grad).sum(-1, keepdim=True)
        grad.sub_(delta).mul_(probs).masked_fill_(~mask, 0.0).mul_(ctx.scale)  # d scores
        grad_q = _masked_matmul(grad, k, mask)
        grad_k = _masked_matmul(grad.transpose(-1, -2), q, mask_t)
        return grad_q, grad_k, grad_v, None, None
