"""Kernel or reference: the one rule every dta_fast entry point follows.

``attention_impl="auto"`` runs the Triton tree kernel on CUDA and the explicit-mask reference attention
(``dta_ref.attention``: the same numbers at reference speed and O(T^2) memory) on any other device.
``"kernel"`` asks for the kernel anywhere it can run (on CPU under ``TRITON_INTERPRET=1``, as the test
suite does); ``"reference"`` for the reference. Importing dta_fast needs no Triton; asking for a
kernel without it raises an ImportError that names the extra to install. One exception, for the
KV-cached sampler: :func:`sdpa_attend` runs a hybrid model's decode steps (one query a row) through
SDPA with the same mask, where no key a query does not see can be non-finite (other models' decode
steps: ``dta_fast.decode``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dta_ref.attention import mask_from_subtree_end, masked_attend

ATTENTION_IMPLS = ("auto", "kernel", "reference")
TRITON_MISSING = (
    "dta_fast's tree attention kernel needs Triton, which is not installed: pip install 'dta-prefix-tree[fast]' "
    "(or use attention_impl='reference', the explicit-mask attention)"
)

Attend = Callable[..., torch.Tensor]  # attend(layer, q, k, v, scale, *, window, sinks, softcap)


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_attention_impl(attention_impl) -> str:
    if not isinstance(attention_impl, str) or attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be 'auto', 'kernel' or 'reference', got {attention_impl!r}")
    return attention_impl


def uses_kernel(device: torch.device, attention_impl: str = "auto") -> bool:
    """Whether a call on ``device`` runs the Triton kernel; a kernel that cannot run there is an error."""
    attention_impl = check_attention_impl(attention_impl)
    if attention_impl == "reference" or (attention_impl == "auto" and device.type != "cuda"):
        return False
    if not has_triton():
        raise ImportError(TRITON_MISSING)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"attention_impl='kernel' on {device} needs TRITON_INTERPRET=1 (the Triton interpreter, set before "
            "triton is imported); on CPU the reference attention is the fast choice"
        )
    return True


def tree_attend(subtree_end: torch.Tensor, num_queries: int, kernel: bool, position_ids=None) -> Attend:
    """``attend(layer, q, k, v, scale, *, window, sinks, softcap)`` over one tree for every layer of a
    forward (``adapter.hidden_states``' seam): the kernel with one schedule, or the reference with its
    masks, built once. The queries are the last ``num_queries`` of the ``subtree_end.shape[-1]`` keys;
    ``position_ids``, the keys' depths, serve sliding windows. The tree is taken as checked."""
    if kernel:
        from .attention import build_schedule, tree_attention

        schedule = build_schedule(subtree_end, num_queries, validate=False, position_ids=position_ids)

        def attend(layer, q, k, v, scale, window=None, sinks=None, softcap=None):
            return tree_attention(q, k, v, scale=scale, window=window, sinks=sinks, softcap=softcap, schedule=schedule)

        return attend
    num_keys = subtree_end.shape[-1]
    return masked_attend(subtree_end, torch.arange(num_keys - num_queries, num_keys, device=subtree_end.device),
                         position_ids)  # fmt: skip


def sdpa_attend(subtree_end: torch.Tensor, num_queries: int, position_ids, fallback: Callable[[], Attend]) -> Attend:
    """``attend`` as :func:`tree_attend` gives it, through SDPA's fused kernels with the tree's mask (dta_ref's
    predicate) as an additive bias, one per window and dtype, built once: one launch a call where the
    tree kernel takes three (its isolation passes), for the KV-cached sampler's decode steps.
    Exact where every key a query does not see is finite or a copy of one it sees (SDPA multiplies masked
    values by zero, and 0 * NaN leaks; tree attention isolates them). A GQA group's query heads are
    folded into its query rows, so every SDPA backend takes the call without copying K and V. Sinks and
    softcaps, which SDPA does not compute, go to ``fallback()``'s attend, built on the first such call."""
    num_keys = subtree_end.shape[-1]
    query_index = torch.arange(num_keys - num_queries, num_keys, device=subtree_end.device)
    biases, others = {}, []

    def attend(layer, q, k, v, scale, window=None, sinks=None, softcap=None):
        if sinks is not None or softcap is not None:
            if not others:
                others.append(fallback())
            return others[0](layer, q, k, v, scale, window=window, sinks=sinks, softcap=softcap)
        B, Hq, Tq, D = q.shape
        Hkv = k.shape[1]
        group = Hq // Hkv
        if (window, q.dtype) not in biases:
            mask = mask_from_subtree_end(subtree_end, query_index, position_ids, window)
            mask = mask.reshape(-1, 1, *mask.shape[-2:]).repeat(1, 1, group, 1)  # rows (g, t) of the folded heads
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            biases[window, q.dtype] = bias.masked_fill(~mask, -torch.inf)
        folded = q.reshape(B, Hkv, group * Tq, D)  # query head h = kv head h // group, as the kernels take it
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=biases[window, q.dtype], scale=scale)
        return out.reshape(B, Hq, Tq, v.shape[-1])

    return attend
