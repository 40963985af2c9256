"""Pure helpers shared by tests/ and property_tests/ (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import copy

import torch

import dta_ref

HF_FAMILIES = ("llama", "qwen2", "qwen3")
HF_ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
TINY_VOCAB = 64
EPS32 = torch.finfo(torch.float32).eps


def assert_close_report(actual, expected, atol: float, rtol: float, name: str = "tensor", max_bad: int = 5) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` elementwise.

    On failure the message gives the max abs diff, the relative RMS error
    ``||actual - expected|| / ||expected||`` and the first bad indices with
    their values. NaN in either tensor counts as a mismatch unless both are NaN
    at the same place.
    """
    if actual is None or expected is None:
        raise AssertionError(f"{name}: {'actual' if actual is None else 'expected'} is None (a missing gradient?)")
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    diff = (a - e).abs()
    both_nan = a.isnan() & e.isnan()
    bad = ~(diff <= atol + rtol * e.abs()) & ~both_nan
    if not bool(bad.any()):
        return
    finite = diff[~diff.isnan()]
    max_abs = float(finite.max()) if finite.numel() else float("nan")
    denom = float(e.nan_to_num().norm())
    rel_rms = float((a - e).nan_to_num(nan=float("inf")).norm()) / denom if denom > 0 else float("inf")
    idx = bad.nonzero()[:max_bad]
    lines = [
        f"{name}: {int(bad.sum())} of {bad.numel()} elements out of tolerance (atol={atol:g}, rtol={rtol:g})",
        f"  max abs diff {max_abs:.3e}, relative RMS {rel_rms:.3e}, max |expected| {float(e.abs().max()):.3e}",
    ]
    for row in idx.tolist():
        i = tuple(row)
        lines.append(f"  at {i}: actual {float(a[i]):.17g}, expected {float(e[i]):.17g}")
    raise AssertionError("\n".join(lines))


def tiny_decoder(dtype: torch.dtype = torch.float64, seed: int = 0, vocab_size: int = TINY_VOCAB) -> dta_ref.Decoder:
    """A seeded 2-layer reference decoder (hidden 32, 4 query heads, 2 KV heads, head_dim 8)."""
    torch.manual_seed(seed)
    cfg = dta_ref.DecoderConfig(
        vocab_size=vocab_size, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
    )
    return dta_ref.Decoder(cfg).to(dtype)


def tiny_hf_model(family: str, dtype: torch.dtype = torch.float64, attn_implementation: str = "eager", seed: int = 0):
    """A seeded tiny Hugging Face causal LM of ``family`` ("llama", "qwen2" or "qwen3").

    hidden 32, 2 layers, 4 query heads, 2 KV heads, head_dim 8, vocab 64, no
    attention dropout. The init range is large enough that attention is far
    from uniform, so a wrong mask changes the logits visibly. Returned in eval mode.
    """
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    if family not in classes:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(classes)}")
    config_cls, model_cls = classes[family]
    config = config_cls(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        attention_dropout=0.0,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


# Every text family the tree runs, tiny, with what each needs from it (docs: README's family table).
# Windows of 5 positions: the test rollouts are longer. Model types as transformers names them.
WINDOW = 5
LINEAR = dict(
    layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
)  # fmt: skip
TEXT_FAMILIES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),  # a window on every layer
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "gemma2": (
        "gemma2",
        dict(sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0, query_pre_attn_scalar=16),
    ),  # fmt: skip
    "gemma3": ("gemma3_text", dict(sliding_window=WINDOW, query_pre_attn_scalar=16, sliding_window_pattern=2)),
    "gpt-oss": ("gpt_oss", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)),  # sinks, MoE
    "qwen3-moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "phi3": ("phi3", dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)),
    "olmo2": ("olmo2", dict(pad_token_id=0, eos_token_id=1)),  # QK-norm over all heads
    "gpt2": ("gpt2", dict(n_inner=64, bos_token_id=0, eos_token_id=1)),  # learned absolute positions
    # hybrids: a Gated DeltaNet layer (convolution of width 4, recurrent state) before an attention layer
    "qwen3-next": (
        "qwen3_next",
        dict(
            LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
        ),
    ),  # fmt: skip
    "qwen3.5": ("qwen3_5_text", LINEAR),
    "deepseek-v3": (
        "deepseek_v3",
        dict(
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
    ),  # MLA: q/k head dim 16, v 12  # fmt: skip
}


MOE_FAMILIES = ("gpt-oss", "qwen3-moe", "mixtral", "deepseek-v3", "qwen3-next")
LINEAR_FAMILIES = ("qwen3-next", "qwen3.5")  # Gated DeltaNet layers: recurrent states, short convolutions


def tiny_family_model(family: str, dtype: torch.dtype = torch.float64, attn_implementation: str = "eager", seed=0):
    """A seeded tiny causal LM of one of ``TEXT_FAMILIES`` (2 layers, hidden 32, 4/2 heads of 8, vocab 64),
    in eval mode. MoE experts run eagerly, which any dtype can."""
    import transformers

    model_type, extra = TEXT_FAMILIES[family]
    base = dict(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.2,
        tie_word_embeddings=False, attention_dropout=0.0,
    )  # fmt: skip
    config = transformers.AutoConfig.for_model(model_type, **{**base, **extra})
    torch.manual_seed(seed)
    kwargs = dict(experts_implementation="eager") if family in MOE_FAMILIES else {}
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, **kwargs)
    return model.to(dtype).eval()


def _float64_rms_norm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def hf_exact_float64_copy(model):
    """A deep copy of a float64 Hugging Face model that computes in float64 throughout.

    transformers casts to float32 inside RMSNorm (and the eager softmax) even
    in a float64 model, and RMSNorm's backward rounds the gradient through it
    to float32. In the copy every RMSNorm computes in the input dtype and the
    model's own attention is sdpa, so tree vs per-sequence through it must
    agree to float64 precision, and its per-sequence run is the ground truth
    for the model as built.
    """
    exact = copy.deepcopy(model)
    patched = 0
    for module in exact.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _float64_rms_norm.__get__(module)
            patched += 1
    if patched == 0:
        raise RuntimeError(f"no RMSNorm module found in {type(model).__name__}")
    exact.config._attn_implementation = "sdpa"
    return exact


def assert_no_worse_than(actual, baseline, truth, factor: float, floor: float, name: str = "tensor") -> None:
    """``max|actual - truth| <= factor * max|baseline - truth| + floor``.

    The tolerance comes from the data: ``baseline`` is the trusted computation
    at the same precision as ``actual`` (e.g. each sequence alone), ``truth``
    the same function at higher precision.
    """
    truth = torch.as_tensor(truth).detach().to(torch.float64)
    err = float((torch.as_tensor(actual).detach().to(torch.float64) - truth).abs().max()) if truth.numel() else 0.0
    base = float((torch.as_tensor(baseline).detach().to(torch.float64) - truth).abs().max()) if truth.numel() else 0.0
    assert err <= factor * base + floor, (
        f"{name}: error {err:.3e} vs baseline error {base:.3e} (allowed {factor:g} x baseline + {floor:.3e})"
    )


def param_grads(model, loss: torch.Tensor, retain_graph: bool = False) -> dict[str, torch.Tensor]:
    """d loss / d parameter for every named parameter (zeros where the loss does not depend on it)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names, params = [n for n, _ in named], [p for _, p in named]
    grads = torch.autograd.grad(loss, params, retain_graph=retain_graph, allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for n, p, g in zip(names, params, grads, strict=True)}


def flatten_grads(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """All gradients of a :func:`param_grads` dict as one float64 vector, in name order."""
    return torch.cat([grads[n].detach().reshape(-1).to(torch.float64) for n in sorted(grads)])


def assert_grads_close(actual: dict, expected: dict, rel: float, name: str = "grad") -> None:
    """Every parameter gradient within ``rel * max|expected gradient over all parameters|``.

    The tolerance scales with the largest gradient of the model, so parameters
    whose gradient is (near) zero are held to the same absolute standard. If
    every expected gradient is zero (a loss with no valid token), the actual
    ones must be exactly zero too.
    """
    assert actual.keys() == expected.keys(), f"{name}: different parameter sets"
    scale = max(float(g.abs().max()) for g in expected.values())
    for key in sorted(expected):
        assert_close_report(actual[key], expected[key], atol=rel * scale, rtol=0.0, name=f"{name}[{key}]")


def prefix_of_packed_token(tree: dta_ref.PrefixTree, sequences) -> list[tuple[int, ...]]:
    """For every packed token, its root-to-token prefix, read off the input sequences.

    Uses only ``seq_index`` to know which packed slot holds step t of sequence
    s; the content of each prefix comes from the sequences. Raises if a slot is
    claimed by two different prefixes or by none.
    """
    prefixes: list[tuple[int, ...] | None] = [None] * tree.num_tokens
    for s, seq in enumerate(sequences):
        seq = [int(t) for t in seq]
        for t in range(len(seq)):
            slot = int(tree.seq_index[s, t])
            prefix = tuple(seq[: t + 1])
            if prefixes[slot] is not None and prefixes[slot] != prefix:
                raise AssertionError(f"packed slot {slot} holds both {prefixes[slot]} and {prefix}")
            prefixes[slot] = prefix
    missing = [i for i, p in enumerate(prefixes) if p is None]
    if missing:
        raise AssertionError(f"packed slots {missing[:10]} belong to no sequence")
    return prefixes  # type: ignore[return-value]


def brute_force_tree_mask(tree: dta_ref.PrefixTree, sequences) -> torch.Tensor:
    """bool [T, T]: key j visible to query i iff the prefix of j is a prefix of the prefix of i."""
    prefixes = prefix_of_packed_token(tree, sequences)
    T = len(prefixes)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i, pi in enumerate(prefixes):
        for j, pj in enumerate(prefixes):
            mask[i, j] = len(pj) <= len(pi) and pi[: len(pj)] == pj
    return mask


IMAGE, VISION_START, VISION_END = 70, 72, 73  # the tiny VLMs' placeholder and its brackets (vocabulary 80)
VIDEO = 71  # ... and their video placeholder


def tiny_vl_model(family: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    """A seeded tiny vision-language model, ``"qwen2.5-vl"``, ``"qwen3-vl"`` or ``"qwen3.5-vl"`` (2 text layers
    of hidden 32, a 2-block vision tower of patch 2 merging 2 x 2 patches per token), in eval mode."""
    import transformers

    text = dict(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
        spatial_merge_size=2, temporal_patch_size=1, in_channels=3,
    )  # fmt: skip
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
                  vision_end_token_id=VISION_END)  # fmt: skip
    if family == "qwen2.5-vl":
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [1, 1, 2]}
        config = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=dict(vision, window_size=8, fullatt_block_indexes=[1]), **tokens
        )
    elif family == "qwen3-vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                   "mrope_interleaved": True}  # fmt: skip
        config = transformers.Qwen3VLConfig(
            text_config=text, vision_config=dict(vision, num_position_embeddings=16, deepstack_visual_indexes=[0]),
            **tokens,
        )  # fmt: skip
    elif family == "qwen3.5-vl":  # a hybrid: a Gated DeltaNet layer, then an attention layer
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                   "mrope_interleaved": True, "partial_rotary_factor": 1.0}  # fmt: skip
        text.update(LINEAR)
        config = transformers.Qwen3_5Config(
            text_config=text, vision_config=dict(vision, num_position_embeddings=16), **tokens
        )  # fmt: skip
    else:
        raise ValueError(f"unknown vision-language family {family!r}")
    config.bos_token_id, config.eos_token_id = 1, 2
    torch.manual_seed(seed)
    return transformers.AutoModelForImageTextToText.from_config(config).to(dtype).eval()


def image_processor_in_code():
    """A Qwen2.5-VL processor built in code for the tiny VLM: a word-level tokenizer whose special tokens
    are the model's image ids, a patch-2 / merge-2 image processor, and a chat template that writes an
    image part as its placeholder."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    special = {0: "<pad>", 1: "<s>", 2: "</s>", IMAGE: "<|image_pad|>", 71: "<|video_pad|>",
               VISION_START: "<|vision_start|>", VISION_END: "<|vision_end|>", 79: "<unk>"}  # fmt: skip
    vocab = {special.get(i, f"w{i}"): i for i in range(80)}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()])
    # left padding, as TRL loads a processor itself: its token types must line up with TRL's left-padded prompts
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        padding_side="left", truncation_side="left",
    )  # fmt: skip
    template = (
        "{{ bos_token }}{% for message in messages %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endfor %}"
    )
    images = Qwen2VLImageProcessorPil(
        patch_size=2, temporal_patch_size=1, merge_size=2, min_pixels=16, max_pixels=4096,
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip

    class ImageProcessor(Qwen2_5_VLProcessor):  # images only: no video processor (which needs torchvision)
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)

    return ImageProcessor(images, tokenizer, chat_template=template)
