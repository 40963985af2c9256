"""Running Hugging Face causal LMs with an attention function of our choosing.

A Hugging Face attention layer looks its attention function up by the name in
``config._attn_implementation`` at every call, and passes extra forward kwargs
down to it. We wrap the function registered under the model's name (and
register one for "eager") with a router: a call that carries our
``dta_attend`` kwarg goes to ``dta_attend(layer_idx, q, k, v, scale)``, any
other call to the original function, unchanged. The route thus travels with
the call itself: when gradient checkpointing recomputes a layer's forward
during backward, the recomputed call carries the same ``dta_attend`` and is
routed the same way, whatever the config says by then.

The trunk is given a ready-made empty 4-D attention mask, which transformers
passes through as it is, so no T x T mask is ever built: the same route serves
the explicit-mask reference and the mask-free Triton kernel, whatever
``attn_implementation`` the user built the model with.
"""

from __future__ import annotations

import sys

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def is_hf_model(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def check_hf_model(model) -> None:
    """A causal LM of a supported family with an LM head, or a clear error."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type '{cfg.model_type}' is not supported; supported families: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    head = model.get_output_embeddings()
    if head is None or not hasattr(model, "model"):
        raise TypeError(
            f"{type(model).__name__} has no language-model head: pass the causal LM "
            "(e.g. Qwen2ForCausalLM), not a base model or a classification model"
        )
    for rope_type in _rope_types(cfg):
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(
                f"rope type '{rope_type}' is not supported on the tree path: its frequencies follow the largest "
                "position of each forward call, so a tree (or a chunk of one) would use other frequencies than "
                "each rollout alone"
            )


def sliding_window_of(cfg) -> int | None:
    """The window of the model's sliding-window layers; None where every layer attends fully."""
    layer_types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    sliding = (
        "sliding_attention" in layer_types if layer_types is not None else getattr(cfg, "use_sliding_window", False)
    )
    return int(window) if sliding and window is not None else None


def check_in_window(window: int | None, last_position: int) -> None:
    """A sliding-window layer attends to all of a query's ancestors while its position is below the window
    (the keys it drops are further back than the root): there it is ordinary causal attention, which is
    what the tree path computes. Past it the tree path would attend to keys the model drops: refused."""
    if window is not None and last_position >= window:
        raise ValueError(
            f"this model's sliding-window layers attend to the last {window} positions; the tree path runs them "
            f"only while every position is below {window}, where they attend to every earlier token, and this "
            f"call reaches position {last_position}"
        )


def _rope_types(cfg) -> set[str]:
    """The RoPE types a config names (rope_parameters in recent transformers, rope_scaling before; either
    may hold one dict or one per layer type)."""
    types = set()
    for params in (getattr(cfg, "rope_parameters", None), getattr(cfg, "rope_scaling", None)):
        if not isinstance(params, dict):
            continue
        for entry in [params] + [v for v in params.values() if isinstance(v, dict)]:
            name = entry.get("rope_type", entry.get("type"))
            if isinstance(name, str):
                types.add(name)
    return types


ATTENTION_DROPOUT_REFUSED = (
    "attention dropout is not supported on the tree path: set attention_dropout=0 (or, to score or sample "
    "without dropout, put the model in eval mode: model.eval())"
)


def attention_dropout_in(model) -> float:
    """The largest attention dropout rate of ``model``'s attention modules (what they drop in train mode)."""
    rates = (getattr(m, "attention_dropout", 0.0) for m in model.modules())
    return max((r for r in rates if isinstance(r, (int, float)) and not isinstance(r, bool)), default=0.0)


def _tree_attention(module, query, key, value, dta_attend, dropout=0.0, scaling=None, **kwargs):
    if dropout:
        raise ValueError(ATTENTION_DROPOUT_REFUSED)
    if kwargs.get("softcap") is not None:
        raise ValueError("attention logit softcapping is not supported on the tree path")
    # a sliding window passed here covers every position of the call: hf_hidden_states checked it
    out = dta_attend(module.layer_idx, query, key, value, scaling)  # [B, Hq, T, D]
    return out.transpose(1, 2).contiguous(), None


def _eager_of(module):
    """The eager attention function of the modeling file that defines ``module``'s class."""
    for cls in type(module).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if fn is not None:
            return fn
    raise RuntimeError(f"no eager attention function found for {type(module).__name__}")


def _router(original):
    def attention(module, query, key, value, attention_mask, *args, dta_attend=None, **kwargs):
        if dta_attend is not None:
            return _tree_attention(module, query, key, value, dta_attend, **kwargs)
        fn = original if original is not None else _eager_of(module)
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    attention.dta_router = True
    return attention


def route_attention(implementation: str) -> None:
    """Install the router under the attention implementation ``implementation`` (once)."""
    from transformers import AttentionInterface

    current = AttentionInterface._global_mapping.get(implementation)
    if getattr(current, "dta_router", False):
        return
    if current is None and implementation != "eager":
        raise ValueError(f"attention implementation {implementation!r} is not supported on the tree path")
    AttentionInterface.register(implementation, _router(current))


def hf_hidden_states(model, input_ids, position_ids, attend) -> torch.Tensor:
    """Final hidden states [B, T, hidden] of a causal LM, attention done by ``attend``."""
    route_attention(model.config._attn_implementation)
    window = sliding_window_of(model.config)
    if window is not None:  # a host sync, for these models only
        check_in_window(window, int(position_ids.max()) if position_ids.numel() else -1)
    no_mask = torch.empty(1, 1, 0, 0, device=input_ids.device)  # 4-D: used as it is, never built
    out = model.model(
        input_ids=input_ids, position_ids=position_ids, attention_mask=no_mask, dta_attend=attend, use_cache=False
    )
    return out.last_hidden_state
