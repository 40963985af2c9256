"""Tree attention with an explicit T x T mask: the readable ground truth.

The fast path (dta_fast.tree_attention) computes the same function from
``subtree_end`` alone, without ever building this mask.
"""

from __future__ import annotations

import math

import torch
from einops import repeat

from .tree import PrefixTree


def tree_attention_mask(tree: PrefixTree) -> torch.Tensor:
    """bool [T, T]: ``mask[i, j]`` is True iff query i may attend key j.

    Key j is visible exactly to the queries of its own subtree, which in
    preorder is the contiguous range ``[j, subtree_end[j])``.
    """
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"expected a PrefixTree, got {type(tree).__name__}")
    i = torch.arange(tree.num_tokens, device=tree.subtree_end.device)
    return mask_from_subtree_end(tree.subtree_end, i)


def mask_from_subtree_end(subtree_end: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """bool [..., Tq, Tk] for queries at key positions ``query_positions`` (e.g. after a cached prefix).

    ``subtree_end`` is [Tk] or batched [..., Tk].
    """
    j = torch.arange(subtree_end.shape[-1], device=subtree_end.device)
    i = query_positions[:, None]
    return (j <= i) & (i < subtree_end[..., None, :])


def attention(q, k, v, mask, scale=None):
    """Softmax attention with an explicit boolean mask (True = may attend).

    q [B, Hq, Tq, D]; k, v [B, Hkv, Tk, D] with Hq a multiple of Hkv (GQA);
    mask broadcastable to [B, Hq, Tq, Tk]. Returns [B, Hq, Tq, D] in q's dtype.
    Every query must be allowed at least one key.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, T, D], got shape {tuple(x.shape)}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
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

    scale = 1.0 / math.sqrt(D) if scale is None else scale
    group = Hq // Hkv
    k = repeat(k, "b h t d -> b (h g) t d", g=group)
    v = repeat(v, "b h t d -> b (h g) t d", g=group)
    # Low-precision inputs are computed in float32, as every fused kernel does.
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale  # [B, Hq, Tq, Tk]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.to(compute)).to(q.dtype)
