"""Kernel or reference: the one rule every dta_fast entry point follows.

``attention_impl="auto"`` runs the Triton tree kernel on CUDA and the explicit-mask reference attention
(``dta_ref.attention``: the same numbers at reference speed and O(T^2) memory) on any other device.
``"kernel"`` asks for the kernel anywhere it can run (on CPU under ``TRITON_INTERPRET=1``, as the test
suite does); ``"reference"`` for the reference. Importing dta_fast needs no Triton; asking for a
kernel without it raises an ImportError that names the extra to install.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

from dta_ref.attention import attention, mask_from_subtree_end

ATTENTION_IMPLS = ("auto", "kernel", "reference")
TRITON_MISSING = (
    "dta_fast's tree attention kernel needs Triton, which is not installed: pip install 'dta-prefix-tree[fast]' "
    "(or use attention_impl='reference', the explicit-mask attention)"
)

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


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


def tree_attend(subtree_end: torch.Tensor, num_queries: int, kernel: bool) -> Attend:
    """``attend(q, k, v, scale)`` over one tree for every layer of a forward: the kernel with one schedule
    built once, or the reference with one mask built once. The queries are the last ``num_queries`` of the
    ``subtree_end.shape[-1]`` key positions. The tree is taken as checked."""
    if kernel:
        from .attention import build_schedule, tree_attention

        schedule = build_schedule(subtree_end, num_queries, validate=False)
        return lambda q, k, v, scale: tree_attention(q, k, v, scale=scale, schedule=schedule)
    num_keys = subtree_end.shape[-1]
    queries = torch.arange(num_keys - num_queries, num_keys, device=subtree_end.device)
    mask = mask_from_subtree_end(subtree_end, queries)
    mask = mask[:, None] if mask.dim() == 3 else mask  # a tree per batch row: [B, 1, Tq, Tk]
    return lambda q, k, v, scale: attention(q, k, v, mask, scale)
