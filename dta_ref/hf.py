"""Running Hugging Face causal LMs with an attention function of our choosing.

transformers looks an attention function up by the name in
``config._attn_implementation`` and passes extra forward kwargs down to it. We
register one function under our own name; while :func:`attend_with` is active
the model calls it, and it hands q, k, v to the ``attend(layer_idx, q, k, v,
scale)`` callable given as the ``dta_attend`` forward kwarg. Because the name
is not a known mask implementation, transformers builds no mask at all, so the
same route serves the explicit-mask reference and the mask-free Triton kernel,
whatever ``attn_implementation`` the user built the model with.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

IMPL_NAME = "dta_tree"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def is_hf_model(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _dta_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, dta_attend=None, **kwargs):
    if dta_attend is None:
        raise RuntimeError(f"attention '{IMPL_NAME}' called without a dta_attend function; use dta_ref.hf.attend_with")
    if dropout:
        raise ValueError("attention dropout is not supported on the tree path: set attention_dropout=0")
    if kwargs.get("softcap") is not None:
        raise ValueError("attention logit softcapping is not supported on the tree path")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("sliding-window attention is not supported on the tree path")
    out = dta_attend(module.layer_idx, query, key, value, scaling)  # [B, Hq, T, D]
    return out.transpose(1, 2).contiguous(), None


def check_hf_model(model) -> None:
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type '{cfg.model_type}' is not supported; supported families: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        raise ValueError("models with sliding-window attention layers are not supported on the tree path")


@contextmanager
def attend_with(model):
    """Route every attention layer of ``model`` through ``dta_attend`` for the duration."""
    from transformers import AttentionInterface

    check_hf_model(model)
    if IMPL_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(IMPL_NAME, _dta_attention)
    previous = model.config._attn_implementation
    model.config._attn_implementation = IMPL_NAME
    try:
        yield
    finally:
        model.config._attn_implementation = previous


def hf_hidden_states(model, input_ids, position_ids, attend) -> torch.Tensor:
    """Final hidden states [B, T, hidden] of a causal LM, attention done by ``attend``."""
    with attend_with(model):
        out = model.model(input_ids=input_ids, position_ids=position_ids, dta_attend=attend, use_cache=False)
    return out.last_hidden_state
