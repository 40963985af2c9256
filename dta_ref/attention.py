"""Tree attention with an explicit T x T mask: the readable ground truth.

``tree_mask`` is the attention rule (a sliding window included); ``tree_attention`` is the twin of
``dta_fast.tree_attention`` (same signature), which computes the same function from ``subtree_end``
alone, without ever building the mask; ``attention`` is softmax attention under any explicit mask, with
the variants models use: attention sinks, logit softcapping, a value head dim of its own (MLA).
"""

from __future__ import annotations

import math

import torch
from einops import repeat

from .checks import check_int, check_real, check_scale
from .tree import PrefixTree, nesting_depth


def tree_mask(q_idx, kv_idx, subtree_end, position_ids=None, window=None):
    """True where the query at key position ``q_idx`` may attend key ``kv_idx``: ``kv_idx <= q_idx <
    subtree_end[kv_idx]``. Key j is visible exactly to its own subtree, which in preorder is the
    contiguous range ``[j, subtree_end[j])`` (docs/prefix_tree.md). With a sliding ``window`` also
    ``position_ids[q_idx] - position_ids[kv_idx] < window``: positions are depths, so this is the window
    of every rollout that holds the query.

    The one mask predicate of the project. It broadcasts (``q_idx[:, None]``, ``kv_idx[None, :]``:
    [Tq, Tk]; a batched ``subtree_end`` [B, Tk] gives [B, Tq, Tk]) and is a FlexAttention ``mask_mod``
    as it stands: ``lambda b, h, q, kv: tree_mask(q, kv, subtree_end, position_ids, window)``.
    """

    def at(values, index):
        return values[index] if values.dim() == 1 else values[:, index]

    visible = (kv_idx <= q_idx) & (q_idx < at(subtree_end, kv_idx))
    if window is None:
        return visible
    return visible & (at(position_ids, q_idx) - at(position_ids, kv_idx) < window)


def tree_attention_mask(tree: PrefixTree) -> torch.Tensor:
    """bool [T, T]: ``mask[i, j]`` is True iff query i may attend key j (:func:`tree_mask`)."""
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"expected a PrefixTree, got {type(tree).__name__}")
    i = torch.arange(tree.num_tokens, device=tree.subtree_end.device)
    return mask_from_subtree_end(tree.subtree_end, i)


def mask_from_subtree_end(subtree_end, query_positions, position_ids=None, window=None) -> torch.Tensor:
    """bool [..., Tq, Tk] for queries at key positions ``query_positions`` (e.g. after a cached prefix);
    with a ``window``, of ``position_ids`` (the keys' depths, shaped as ``subtree_end``) as
    :func:`tree_mask` says.

    ``subtree_end`` is [Tk] or batched [B, Tk].
    """
    for name, t in (("subtree_end", subtree_end), ("query_positions", query_positions)):
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    window, position_ids = check_window(window, position_ids, subtree_end)
    j = torch.arange(subtree_end.shape[-1], device=subtree_end.device)
    return tree_mask(query_positions[:, None], j[None, :], subtree_end, position_ids, window)


def check_window(window, position_ids, subtree_end):
    """``window`` as an int >= 1 (or None) and ``position_ids`` as the keys' depths on ``subtree_end``'s
    device, shaped as it; a window needs them."""
    window = check_int("window", window, 1, allow_none=True)
    if window is None:
        return None, None
    integer = isinstance(position_ids, torch.Tensor) and not position_ids.dtype.is_floating_point
    if not integer or position_ids.dtype == torch.bool:
        raise TypeError(
            f"a sliding window needs position_ids, the keys' depths as an integer tensor shaped as subtree_end; "
            f"got {getattr(position_ids, 'dtype', type(position_ids).__name__)}"
        )
    if position_ids.shape != subtree_end.shape:
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, subtree_end {tuple(subtree_end.shape)}")
    return window, position_ids.to(subtree_end.device)


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


def attention(q, k, v, mask, scale=None, *, sinks=None, softcap=None, return_lse=False):
    """Softmax attention with an explicit boolean mask (True = may attend).

    q [B, Hq, Tq, D]; k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv] with Hq a multiple of Hkv (GQA; v's head dim
    may differ, as in MLA); mask broadcastable to [B, Hq, Tq, Tk]. Returns [B, Hq, Tq, Dv] in q's dtype
    (and the float32 natural-log LSE [B, Hq, Tq] of the row's logits, sink included, with
    ``return_lse=True``; it carries no gradient).

    ``softcap``: scores ``softcap * tanh(scale * q.k / softcap)`` (Gemma 2). ``sinks`` [Hq]: a learned
    logit per head that joins every row's softmax denominator and takes no value (GPT-OSS); it gets a
    gradient. Every query must be allowed at least one key. A key a query may not attend never reaches
    its output or gradients, even when the key's rows hold NaN or inf; a query that attends a non-finite
    value row gets NaN. Under autocast, q, k and v are first cast to its dtype, as SDPA's are.
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
    for name, x in (("q", q), ("k", k), ("v", v)):
        if 0 in x.shape[1:]:
            raise ValueError(f"{name} has shape {tuple(x.shape)}: heads, tokens and head dim must be at least 1")
    B, Hq, Tq, D = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in batch, heads and tokens, got {tuple(k.shape)} and {tuple(v.shape)}")
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
    sinks = check_sinks(sinks, Hq)
    softcap = None if softcap is None else check_softcap(softcap)

    # Low-precision inputs are computed in float32, as every fused kernel does.
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    # a scale past the compute dtype's range would make every score inf, and the softmax NaN
    scale = 1.0 / math.sqrt(D) if scale is None else check_scale(scale, torch.finfo(compute).max)
    group = Hq // Hkv
    k = repeat(k, "b h t d -> b (h g) t d", g=group)
    v = repeat(v, "b h t d -> b (h g) t d", g=group)
    with torch.autocast(q.device.type, enabled=False):  # in ``compute``, not in autocast's dtype
        sinks = None if sinks is None else sinks.to(compute)
        out, lse = _MaskedAttention.apply(q.to(compute), k.to(compute), v.to(compute), mask, scale, sinks, softcap)
    out = out.to(q.dtype)
    return (out, lse.float()) if return_lse else out


def check_sinks(sinks, num_heads: int):
    """None, or one floating logit per query head [Hq]."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks must be a floating tensor [Hq], got {getattr(sinks, 'dtype', type(sinks).__name__)}")
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must hold one logit per query head, shape ({num_heads},), got {tuple(sinks.shape)}")
    return sinks


def check_softcap(softcap) -> float:
    """A logit softcap: a positive finite number."""
    value = check_real("softcap", softcap)
    if value <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    return value


def tree_attention(
    q, k, v, subtree_end, scale=None, *, position_ids=None, window=None, sinks=None, softcap=None, return_lse=False
):
    """Tree attention with the explicit mask of :func:`tree_mask`: the readable twin of
    ``dta_fast.tree_attention``, with its signature.

    q [B, Hq, Tq, D]; k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv]; subtree_end [Tk] or [B, Tk] int. The queries
    are the last Tq key positions (Tq < Tk: the first Tk - Tq keys are a cached prefix). ``window``: a
    sliding window over ``position_ids`` (the keys' depths, shaped as ``subtree_end``); ``sinks`` [Hq]
    and ``softcap`` as :func:`attention` takes them. Returns the output [B, Hq, Tq, Dv] and, with
    ``return_lse=True``, the float32 natural-log LSE [B, Hq, Tq] (no gradient).
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
    queries = torch.arange(Tk - Tq, Tk, device=q.device)
    mask = mask_from_subtree_end(end, queries, position_ids, window)
    mask = mask[:, None] if mask.dim() == 3 else mask  # [B, 1, Tq, Tk] for one tree per batch row
    return attention(q, k, v, mask, scale, sinks=sinks, softcap=softcap, return_lse=return_lse)


def masked_attend(subtree_end, query_index, position_ids=None):
    """The ``attend(layer, q, k, v, scale, *, window, sinks, softcap)`` of ``adapter.hidden_states`` by
    explicit masks: queries at key positions ``query_index`` of the forest ``subtree_end``, keys at depths
    ``position_ids`` (which sliding windows need); one mask per window, built once."""
    masks = {}

    def attend(layer, q, k, v, scale, window=None, sinks=None, softcap=None):
        if window not in masks:
            mask = mask_from_subtree_end(subtree_end, query_index, position_ids, window)
            masks[window] = mask[:, None] if mask.dim() == 3 else mask  # a tree per batch row: [B, 1, Tq, Tk]
        return attention(q, k, v, masks[window], scale, sinks=sinks, softcap=softcap)

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
    """softmax(scores over the allowed keys [and a sink]) v, forward and backward over allowed pairs only.

    scores = scale * q k^T, or ``softcap * tanh(scale * q k^T / softcap)``; a head's sink logit joins the
    softmax denominator and takes no value. Every output and gradient element is computed from the
    (query, key) pairs the mask allows and nothing else, so a NaN or inf in one rollout's rows never
    reaches a query (or a key's gradient) of another: masked entries are selected away, never multiplied
    by zero. The backward is the textbook one, written out with the same selection
    (tests/test_adversarial.py checks it with gradcheck and against autograd through plain masked
    softmax): dS = P (dP - delta) with delta = rowsum(dO * O); a sink's gradient is -sum(P_sink delta);
    a softcap multiplies dS by 1 - tanh^2.
    """

    # In place where it is safe (nothing here is recorded by autograd): two [Tq, Tk] buffers at most.

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, sinks, softcap):
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [B, Hq, Tq, Tk]
        tanh = None
        if softcap is not None:
            tanh = scores.div_(softcap).tanh_()
            scores = tanh * softcap
        scores.masked_fill_(~mask, float("-inf"))
        if sinks is None:
            lse = torch.logsumexp(scores, dim=-1)
        else:  # the sink as one more logit of every row
            sink = sinks[None, :, None].expand(scores.shape[:3])  # [B, Hq, Tq]
            lse = torch.logsumexp(torch.cat([scores, sink[..., None]], dim=-1), dim=-1)
        probs = scores.sub_(lse[..., None]).exp_()
        probs.masked_fill_(~mask, 0.0)  # a NaN row's softmax is NaN on masked entries too
        ctx.save_for_backward(q, k, v, mask, probs, tanh, sinks, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return _masked_matmul(probs, v, mask), lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        refuse_create_graph("dta_ref.attention")  # the saved probs carry no graph
        q, k, v, mask, probs, tanh, sinks, lse = ctx.saved_tensors
        mask_t = mask.transpose(-1, -2)
        grad_v = _masked_matmul(probs.transpose(-1, -2), grad_out, mask_t)
        grad = torch.matmul(grad_out, v.transpose(-1, -2)).masked_fill_(~mask, 0.0)  # d probs
        delta = (probs * grad).sum(-1, keepdim=True)
        grad_sinks = None
        if sinks is not None:  # d lse / d sink is the sink's probability
            grad_sinks = -((sinks[None, :, None] - lse).exp() * delta[..., 0]).sum((0, 2))
        grad.sub_(delta).mul_(probs).masked_fill_(~mask, 0.0)  # d scores
        if tanh is not None:
            grad.mul_(1 - tanh * tanh)
        grad.mul_(ctx.scale)
        grad_q = _masked_matmul(grad, k, mask)
        grad_k = _masked_matmul(grad.transpose(-1, -2), q, mask_t)
        return grad_q, grad_k, grad_v, None, None, grad_sinks, None
