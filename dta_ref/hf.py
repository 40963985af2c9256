"""Running Hugging Face causal LMs with an attention function of our choosing.

Every decoder in transformers 5 calls its layers' attention through the attention-function registry,
looked up by the name in ``config._attn_implementation`` at every call, with ``(module, query, key,
value, attention_mask, scaling=, dropout=, sliding_window=, s_aux=, softcap=, ...)``. We wrap the
function registered under the model's name (and register one for "eager") with a router: a call that
carries our ``dta_attend`` kwarg goes to ``dta_attend(layer_idx, q, k, v, scale, window=, sinks=,
softcap=)``, any other call to the original function, unchanged. The route thus travels with the call
itself: when gradient checkpointing recomputes a layer's forward during backward, the recomputed call
carries the same ``dta_attend`` and is routed the same way, whatever the config says by then.

Whatever the family, the model's own modules compute everything else (embedding scaling, rotary
variants, QK norms, MoE routing), and the tree computes the attention variants the call names: a
sliding window, attention sinks, logit softcapping, a value head dim of its own. A layer that does not
come through the registry, a layer type other than softmax attention, or a keyword the tree does not
compute is refused by name, never approximated.

The trunk is given a ready-made empty 4-D attention mask, which transformers passes through as it is,
so no T x T mask is ever built: the same route serves the explicit-mask reference and the mask-free
Triton kernel, whatever ``attn_implementation`` the user built the model with.
"""

from __future__ import annotations

import sys

import torch

# the layer types of ``config.layer_types`` that are softmax attention, which the tree computes
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# linear-attention layers (Gated DeltaNet) whose modeling file routes its convolution and delta rule
LINEAR_LAYER_TYPE = "linear_attention"
LINEAR_FUNCTIONS = {"causal_conv1d_fn": "conv", "torch_chunk_gated_delta_rule": "delta_rule"}
# keywords a layer's attention call may carry that leave its result as the tree computes it
NEUTRAL_KWARGS = ("position_ids", "use_cache", "output_router_logits", "output_attentions", "cache_position")


def is_hf_model(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def check_hf_model(model) -> None:
    """A causal LM with an LM head, or a value model (a token classifier of one label: a PPO critic), whose
    layers the tree computes exactly; or a clear error."""
    name = type(model).__name__
    head = model.get_output_embeddings()
    if (head is None and value_head_of(model) is None) or decoder_of(model) is None:
        raise TypeError(
            f"{name} has no language-model head nor a one-output value head: pass the causal LM (e.g. "
            "Qwen2ForCausalLM) or a token classifier with num_labels=1 (a critic), not a base model"
        )
    layers_of(model)
    cfg = text_config_of(model)
    for i, layer_type in enumerate(getattr(cfg, "layer_types", None) or ()):
        if layer_type == LINEAR_LAYER_TYPE:
            linear_module_of(model, i)
        elif layer_type not in ATTENTION_LAYER_TYPES:
            raise ValueError(
                f"layer {i} of {name} is a '{layer_type}' layer: the tree computes softmax attention layers "
                f"({', '.join(ATTENTION_LAYER_TYPES)}) and Gated DeltaNet linear attention"
            )
    for rope_type in _rope_types(cfg):
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(
                f"rope type '{rope_type}' is not supported on the tree path: its frequencies follow the largest "
                "position of each forward call, so a tree (or a chunk of one) would use other frequencies than "
                "each rollout alone"
            )


def linear_layers_of(model) -> list[int]:
    """The indices of a model's linear-attention layers (``config.layer_types``)."""
    types = getattr(text_config_of(model), "layer_types", None) or ()
    return [i for i, layer_type in enumerate(types) if layer_type == LINEAR_LAYER_TYPE]


def linear_module_of(model, index: int):
    """Layer ``index``'s linear-attention module, whose modeling file defines the convolution and the
    delta rule it calls (a Gated DeltaNet: Qwen3-Next, Qwen3.5); else refused by name."""
    layer = layers_of(model)[index]
    module = getattr(layer, "linear_attn", None)
    modeling = sys.modules.get(type(module).__module__) if module is not None else None
    if modeling is None or not all(callable(getattr(modeling, f, None)) for f in LINEAR_FUNCTIONS):
        raise ValueError(
            f"layer {index} of {type(model).__name__} is a linear-attention layer the tree does not compute: it "
            f"computes Gated DeltaNet layers whose modeling file calls {' and '.join(LINEAR_FUNCTIONS)}"
        )
    return module


LINEAR_REFUSED = (
    "linear-attention layers need the recurrent state of each token's path: this forward passed no "
    "linear-attention mixing (adapter.hidden_states(..., linear=), dta_ref.linear_attention)"
)


def _linear_router(original, step: str):
    def routed(*args, dta_attend=None, **kwargs):
        if dta_attend is None:
            return original(*args, **kwargs)
        linear = getattr(dta_attend, "linear", None)
        if linear is None:
            raise ValueError(LINEAR_REFUSED)
        dta_attend.linear_calls[step] += 1
        return getattr(linear, step)(original, *args, **kwargs)

    routed.dta_router = True
    return routed


def route_linear_attention(model) -> None:
    """Install routers over the convolution and the delta rule of each linear-attention modeling file
    (once): a call carrying ``dta_attend`` goes to its ``linear`` mixing, any other to the original."""
    for index in linear_layers_of(model):
        modeling = sys.modules[type(linear_module_of(model, index)).__module__]
        for name, step in LINEAR_FUNCTIONS.items():
            current = getattr(modeling, name)
            if not getattr(current, "dta_router", False):
                setattr(modeling, name, _linear_router(current, step))


def text_config_of(model):
    """The config of a model's language model: its own, or a vision-language model's text config."""
    get = getattr(model.config, "get_text_config", None)
    return get() if callable(get) else model.config


def decoder_of(model):
    """The trunk of a causal LM (embedding, layers, final norm): ``model.model`` in transformers."""
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    return decoder if decoder is not None else getattr(model, "model", None)


def layers_of(model):
    """The decoder layers of a causal LM, in order: the trunk's list of ``num_hidden_layers`` modules
    (``layers`` in most families, ``h`` in GPT-2's)."""
    decoder = decoder_of(model)
    count = text_config_of(model).num_hidden_layers
    lists = [m for m in decoder.children() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if len(lists) != 1:
        raise TypeError(f"{type(model).__name__}'s trunk has no single list of its {count} decoder layers")
    return lists[0]


def value_head_of(model):
    """A token classifier's one-output head (``score``, after its dropout), as its own forward applies it:
    a PPO critic's value head; None for any other model."""
    score = getattr(model, "score", None)
    if model.get_output_embeddings() is not None or not isinstance(score, torch.nn.Linear) or score.out_features != 1:
        return None
    dropout = getattr(model, "dropout", None)
    return score if not isinstance(dropout, torch.nn.Module) else torch.nn.Sequential(dropout, score)


def logit_softcap_of(model) -> float | None:
    """The final logit softcap the causal LM applies after its head (Gemma 2), or None."""
    cap = getattr(text_config_of(model), "final_logit_softcapping", None)
    return float(cap) if cap else None


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


def _tree_attention(
    module, query, key, value, dta_attend, dropout=0.0, scaling=None, sliding_window=None, s_aux=None, softcap=None,
    is_causal=None, **kwargs,
):  # fmt: skip
    if dropout:
        raise ValueError(ATTENTION_DROPOUT_REFUSED)
    other = sorted(name for name, value in kwargs.items() if value is not None and name not in NEUTRAL_KWARGS)
    if other or is_causal is False:
        what = ", ".join(other + (["is_causal=False"] if is_causal is False else []))
        raise TypeError(
            f"{type(module).__name__} passes {what} to its attention function, which the tree path does not "
            "compute: refused rather than ignored"
        )
    out = dta_attend(module.layer_idx, query, key, value, scaling, window=sliding_window, sinks=s_aux, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None  # [B, T, Hq, Dv]


def _eager_of(module):
    """The eager attention function of the modeling file that defines ``module``'s class."""
    for cls in type(module).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if fn is not None:
            return fn
    raise RuntimeError(f"no eager attention function found for {type(module).__name__}")


def _router(original):
    def attention(module, query, key, value, attention_mask, *args, dta_attend=None, **kwargs):
        # only the decoder's layers attend on the tree: a vision tower's attention in the same call keeps its own
        if dta_attend is not None and getattr(dta_attend, "routes", lambda module: True)(module):
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


def hf_hidden_states(
    model, input_ids, position_ids, attend, output_router_logits: bool = False, linear=None, images=None
):  # fmt: skip
    """Final hidden states [B, T, hidden] of a causal LM, attention done by ``attend`` and linear-attention
    layers' convolution and delta rule by ``linear`` (``dta_ref.linear_attention``; None: such layers are
    refused); every decoder layer must route through them. With ``output_router_logits``, also a MoE
    model's router logits (one [B * T, experts] tensor per MoE layer). ``images``
    (``dta_ref.multimodal.TreeImages``): a vision-language model's images, each encoded once, and the
    packed tokens' multimodal rotary positions, which replace ``position_ids``."""
    route_attention(model.config._attn_implementation)
    route_linear_attention(model)
    counted = _Route(model, attend, linear, with_images=images is not None)

    decoder = decoder_of(model)
    no_mask = torch.empty(1, 1, 0, 0, device=input_ids.device)  # 4-D: used as it is, never built
    extra = dict(output_router_logits=True) if output_router_logits else {}
    if images is not None:
        decoder, position_ids, extra = _multimodal_trunk(model, images, input_ids, extra)
    out = decoder(
        input_ids=input_ids, position_ids=position_ids, attention_mask=no_mask, dta_attend=counted, use_cache=False,
        **extra,
    )  # fmt: skip
    linear_layers = linear_layers_of(model)
    missing = sorted(set(range(len(layers_of(model)))) - counted.attended - set(linear_layers))
    if any(calls != len(linear_layers) for calls in counted.linear_calls.values()):
        raise TypeError(
            f"the linear-attention layers of {type(model).__name__} did not each call their convolution and delta "
            "rule once through their modeling file, so the tree cannot compute them"
        )
    if missing:
        raise TypeError(
            f"layers {missing} of {type(model).__name__} did not call their attention through transformers' "
            "attention interface, so the tree cannot compute them"
        )
    if not output_router_logits:
        return out.last_hidden_state
    return out.last_hidden_state, out.get("router_logits")  # a key of the output, not always a field


class _Route:
    """What one tree forward's ``dta_attend`` carries to the routers: the attention of the decoder's layers
    (``routes``: a vision tower's attention in the same call is not the tree's) and the linear-attention
    layers' convolution and delta rule (``linear``), counting who called."""

    def __init__(self, model, attend, linear, with_images: bool):
        self.attend, self.linear = attend, linear
        self.attended, self.linear_calls = set(), dict.fromkeys(LINEAR_FUNCTIONS.values(), 0)
        # without images the call runs the decoder alone; with them, its modules are told from the tower's
        # (a walk over every module, about 1 ms a forward for 24 layers: a decode step pays it per token)
        self._decoder = {id(m) for layer in layers_of(model) for m in layer.modules()} if with_images else None

    def routes(self, module) -> bool:
        return self._decoder is None or id(module) in self._decoder

    def __call__(self, layer, *args, **kwargs):
        self.attended.add(layer)
        return self.attend(layer, *args, **kwargs)


def _multimodal_trunk(model, images, input_ids, extra):
    """A vision-language model's multimodal trunk, its rotary positions and inputs: the distinct images,
    which its vision tower encodes once each and the trunk places at the placeholders (the tower's own
    attention calls are not routed to the tree: ``routes`` below)."""
    trunk = getattr(model, "model", None)
    if not callable(getattr(trunk, "get_image_features", None)):
        raise TypeError(f"{type(model).__name__} takes no images: it has no multimodal trunk with a vision tower")
    if images.position_ids.shape != (3, input_ids.shape[-1]):
        raise ValueError(
            f"images.position_ids must be [3, {input_ids.shape[-1]}] (one per packed token), got "
            f"{tuple(images.position_ids.shape)}"
        )
    if images.encoded is not None:  # encoded once for the whole step, this chunk's share
        return trunk, images.position_ids[:, None], dict(extra, mm_encoder_outputs=images.encoded)
    media = images.media()
    if "image" in media:
        extra = dict(extra, pixel_values=images.pixel_values, image_grid_thw=images.image_grid_thw)
    if "video" in media:
        extra = dict(extra, pixel_values_videos=images.pixel_values_videos, video_grid_thw=images.video_grid_thw)
    return trunk, images.position_ids[:, None], extra


def router_aux_loss(model, router_logits, weights: torch.Tensor) -> torch.Tensor:
    """A MoE causal LM's own load-balancing loss over packed tokens, token t counted ``weights[t]`` times:
    with each token's multiplicity, exactly the loss of the padded batch of its rollouts (the loss is a
    product of token-weighted means over experts)."""
    if not hasattr(model, "num_experts_per_tok") or not router_logits:
        raise TypeError(f"{type(model).__name__} returns no router logits: it has no MoE auxiliary loss")
    loss_fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if loss_fn is None:
        raise TypeError(f"{type(model).__name__}'s modeling file has no load_balancing_loss_func")
    return loss_fn(tuple(router_logits), model.num_experts, model.num_experts_per_tok, weights[None])
