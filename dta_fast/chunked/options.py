"""``tree_backward``'s options and their checks, in one place (the engine, the budget search, the
distributed entry point and the TRL config all check through here)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from dta_ref.checks import check_bytes, check_flag, check_int, check_temperature

from ..dispatch import check_attention_impl


class TreeBackwardOptions(NamedTuple):
    """:func:`tree_backward`'s options as :func:`checked_options` returns them."""

    max_chunk_tokens: int | None
    memory_budget_bytes: int | None
    memory_margin_bytes: int | None
    recompute: bool | None
    checkpoint_layers: bool | None
    attention_impl: str
    temperature: float
    grad_scaler: torch.amp.GradScaler | None


def checked_options(
    *,
    max_chunk_tokens=None,
    memory_budget_bytes=None,
    memory_margin_bytes=None,
    recompute=None,
    checkpoint_layers=None,
    attention_impl="auto",
    temperature=1.0,
    grad_scaler=None,
) -> TreeBackwardOptions:
    """:func:`tree_backward`'s options checked; an unknown name is a TypeError. Alone, for a caller that
    must refuse them without a tree to train (a rank whose shard is empty)."""
    max_chunk_tokens, memory_budget_bytes, memory_margin_bytes = checked_chunking(
        max_chunk_tokens, memory_budget_bytes, memory_margin_bytes
    )
    recompute = check_flag("recompute", recompute, allow_none=True)
    checkpoint_layers = check_flag("checkpoint_layers", checkpoint_layers, allow_none=True)
    attention_impl = check_attention_impl(attention_impl)
    temperature = check_temperature(temperature)
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")
    return TreeBackwardOptions(
        max_chunk_tokens,
        memory_budget_bytes,
        memory_margin_bytes,
        recompute,
        checkpoint_layers,
        attention_impl,
        temperature,
        grad_scaler,
    )


def checked_chunking(max_chunk_tokens, memory_budget_bytes, memory_margin_bytes, prefix: str = ""):
    """The chunking options checked; ``prefix`` is how the caller names them (``tree_`` in TreeGRPOConfig)."""
    if max_chunk_tokens is not None and memory_budget_bytes is not None:
        raise ValueError(f"give {prefix}max_chunk_tokens or {prefix}memory_budget_bytes, not both")
    if max_chunk_tokens is not None:
        max_chunk_tokens = check_int(f"{prefix}max_chunk_tokens", max_chunk_tokens, 1)
    if memory_budget_bytes is not None:
        memory_budget_bytes = check_bytes(f"{prefix}memory_budget_bytes", memory_budget_bytes)
    if memory_margin_bytes is not None:
        memory_margin_bytes = check_bytes("memory_margin_bytes", memory_margin_bytes, allow_zero=True)
        if max_chunk_tokens is not None or memory_budget_bytes is not None:
            raise ValueError(
                "memory_margin_bytes sets memory aside from the automatic budget; with max_chunk_tokens or "
                "memory_budget_bytes it would do nothing: leave it out"
            )
    return max_chunk_tokens, memory_budget_bytes, memory_margin_bytes
