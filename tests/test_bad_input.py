"""Bad input gets a clear ValueError or TypeError naming the problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dta_fast
import dta_ref
from dta_ref import PrefixTree
from tests.helpers import TINY_VOCAB, tiny_decoder, tiny_family_model, tiny_hf_model


def case(name, fn, exc, match):
    return pytest.param(fn, exc, match, id=name)


def tree_case(name, batch, exc, match):
    return pytest.param(batch, exc, match, id=name)


TREE_CASES = [
    tree_case("empty-batch", [], ValueError, "empty batch"),
    tree_case("empty-sequence", [[1, 2], []], ValueError, "sequence 1 is empty"),
    tree_case(
        "empty-tensor-sequence",
        [torch.tensor([], dtype=torch.long)],
        ValueError,
        "sequence 0 is empty",
    ),
    tree_case("negative-token", [[1, 2], [3, -1]], ValueError, "non-negative, got -1"),
    tree_case(
        "negative-token-tensor",
        [torch.tensor([4, -7])],
        ValueError,
        "non-negative, got -7",
    ),
    tree_case("float-tokens", [[1.0, 2.0]], TypeError, "tokens must be ints, got 1.0"),
    tree_case("bool-tokens", [[True, False]], TypeError, "tokens must be ints, got True"),
    tree_case("string-token", [[1, "2"]], TypeError, "tokens must be ints, got '2'"),
    tree_case("string-sequence", ["abc"], TypeError, "sequence 0: expected a list"),
    tree_case("string-batch", "abc", TypeError, "must be a list of token sequences"),
    tree_case("none-batch", None, TypeError, "must be a list of token sequences"),
    tree_case("int-sequence", [5], TypeError, "sequence 0: expected a list"),
    tree_case(
        "1d-tensor-batch",
        torch.tensor([1, 2, 3]),
        TypeError,
        "must be a list of token sequences",
    ),
    tree_case(
        "3d-tensor-batch",
        torch.ones(2, 2, 2, dtype=torch.long),
        TypeError,
        "must be a list of token sequences",
    ),
    tree_case(
        "float-tensor",
        [torch.tensor([1.0, 2.0])],
        TypeError,
        "dtype torch.float32",
    ),
    tree_case(
        "2d-float-tensor-batch",
        torch.ones(2, 3),
        TypeError,
        "tokens must be integers",
    ),
    tree_case(
        "bool-tensor",
        [torch.tensor([True, False])],
        TypeError,
        "dtype torch.bool",
    ),
    tree_case(
        "float-numpy",
        [np.array([1.0, 2.0])],
        TypeError,
        "array of dtype float64",
    ),
    tree_case(
        "bool-numpy",
        [np.array([True, False])],
        TypeError,
        "array of dtype bool",
    ),
    tree_case(
        "ragged-nested-list",
        [[1, [2, 3]]],
        TypeError,
        r"tokens must be ints, got \[2, 3\]",
    ),
    tree_case(
        "2d-tensor-sequence",
        [torch.tensor([1, 2]), torch.ones(2, 2, dtype=torch.long)],
        ValueError,
        r"sequence 1: expected a 1-D tensor of tokens, got shape \(2, 2\)",
    ),
    tree_case(
        "0d-tensor-sequence",
        [torch.tensor(3)],
        ValueError,
        "expected a 1-D tensor",
    ),
    tree_case(
        "2d-numpy-sequence",
        [np.ones((2, 2), dtype=np.int64)],
        ValueError,
        "expected a 1-D array",
    ),
]


@pytest.mark.parametrize("batch,exc,match", TREE_CASES)
def test_tree_rejects(batch, exc, match):
    with pytest.raises(exc, match=match):
        PrefixTree.from_sequences(batch)


@pytest.mark.parametrize("batch,exc,match", TREE_CASES)
def test_fast_tree_builder_rejects_the_same(batch, exc, match):
    with pytest.raises(exc, match=match):
        dta_fast.build_tree(batch)


def qkv(B=1, Hq=4, Hkv=2, T=5, D=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, T, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, T, D, generator=gen).to(dtype)
    return q, k, v


CAUSAL = torch.ones(5, 5, dtype=torch.bool).tril()
Q, K, V = qkv()

ATTENTION_CASES = [
    case("int-q", lambda: dta_ref.attention(Q.long(), K, V, CAUSAL), TypeError, "q must be a floating tensor"),
    case("bool-v", lambda: dta_ref.attention(Q, K, V.bool(), CAUSAL), TypeError, "v must be a floating tensor"),
    case(
        "mixed-dtypes",
        lambda: dta_ref.attention(Q, K.float(), V, CAUSAL),
        TypeError,
        "q, k, v must share a dtype",
    ),
    case("list-q", lambda: dta_ref.attention(Q.tolist(), K, V, CAUSAL), TypeError, "q must be a tensor"),
    case("3d-q", lambda: dta_ref.attention(Q[0], K, V, CAUSAL), ValueError, r"q must be 4-D \[B, H, T, D\]"),
    case(
        "k-v-shape",
        lambda: dta_ref.attention(Q, K, V[:, :, :4], CAUSAL),
        ValueError,
        "k and v must agree in batch, heads and tokens",
    ),
    case(
        "head-dim-mismatch",
        lambda: dta_ref.attention(Q, K[..., :4], V[..., :4], CAUSAL),
        ValueError,
        "does not match q shape",
    ),
    case(
        "batch-mismatch",
        lambda: dta_ref.attention(Q, torch.cat([K, K]), torch.cat([V, V]), CAUSAL),
        ValueError,
        "does not match q shape",
    ),
    case(
        "hq-not-multiple-of-hkv",
        lambda: dta_ref.attention(*qkv(Hq=4, Hkv=3), CAUSAL),
        ValueError,
        r"query heads \(4\) must be a multiple of key/value heads \(3\)",
    ),
    case("float-mask", lambda: dta_ref.attention(Q, K, V, CAUSAL.double()), TypeError, "mask must be a bool tensor"),
    case("int-mask", lambda: dta_ref.attention(Q, K, V, CAUSAL.long()), TypeError, "mask must be a bool tensor"),
    case("list-mask", lambda: dta_ref.attention(Q, K, V, CAUSAL.tolist()), TypeError, "mask must be a bool tensor"),
    case("1d-mask", lambda: dta_ref.attention(Q, K, V, CAUSAL[0]), ValueError, "mask must be 2-D to 4-D"),
    case(
        "5d-mask",
        lambda: dta_ref.attention(Q, K, V, CAUSAL[None, None, None]),
        ValueError,
        "mask must be 2-D to 4-D",
    ),
    case(
        "mask-wrong-shape",
        lambda: dta_ref.attention(Q, K, V, CAUSAL[:4]),
        ValueError,
        r"mask of shape \(4, 5\) is not broadcastable",
    ),
    case(
        "mask-wrong-heads",
        lambda: dta_ref.attention(Q, K, V, CAUSAL.expand(1, 3, 5, 5)),
        ValueError,
        "is not broadcastable",
    ),
    case(
        "mask-row-without-keys",
        lambda: dta_ref.attention(Q, K, V, CAUSAL.clone().index_fill_(0, torch.tensor([2]), False)),
        ValueError,
        "no allowed key",
    ),
    case(
        "mask-row-without-keys-one-head",
        lambda: dta_ref.attention(
            Q,
            K,
            V,
            CAUSAL.expand(1, 4, 5, 5).clone().index_put_((torch.tensor([0]), torch.tensor([3])), torch.tensor(False)),
        ),
        ValueError,
        "no allowed key",
    ),
    case("tree-mask-of-list", lambda: dta_ref.tree_attention_mask([[1, 2]]), TypeError, "expected a PrefixTree"),
    case(
        "schedule-not-a-schedule",
        lambda: dta_fast.tree_attention(Q.float(), K.float(), V.float(), schedule=torch.tensor([5] * 5)),
        TypeError,
        "schedule must be a TreeSchedule",
    ),
]

BATCH_CASES = [
    case(
        "grpo-negative-groups", lambda: dta_ref.grpo_batch(num_groups=-1), ValueError, "num_groups must be at least 1"
    ),
    case(
        "grpo-bool-vocab",
        lambda: dta_ref.grpo_batch(1, 4, 2, 3, vocab_size=True),
        TypeError,
        "vocab_size must be an int",
    ),
    case(
        "grpo-float-vocab",
        lambda: dta_ref.grpo_batch(1, 4, 2, 3, vocab_size=2.5),
        TypeError,
        "vocab_size must be an int",
    ),
    case("grpo-empty-rollouts", lambda: dta_ref.grpo_batch(1, 0, 2, 0), ValueError, "response_len must be at least 1"),
    case("agentic-no-turns", lambda: dta_ref.agentic_batch(turns=0), ValueError, "turns must be at least 1"),
    case(
        "agentic-every-turn-str",
        lambda: dta_ref.agentic_batch(10, 1, 2, 1, 2, 3, 4, every_turn="no"),
        TypeError,
        "every_turn must be a bool",
    ),
    case(
        "agentic-negative-tool", lambda: dta_ref.agentic_batch(tool_len=-1), ValueError, "tool_len must be at least 0"
    ),
    case("grpo-negative-seed", lambda: dta_ref.grpo_batch(1, 4, 2, 3, seed=-1), ValueError, "seed must be at least 0"),
    case(
        "agentic-float-seed",
        lambda: dta_ref.agentic_batch(10, 1, 2, 1, 2, 3, 4, seed=1.5),
        TypeError,
        "seed must be an int",
    ),
]


@pytest.mark.parametrize("fn,exc,match", BATCH_CASES)
def test_batches_reject(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


@pytest.mark.parametrize("flag,value", [("--threads", "0"), ("--seed", "-1")])
def test_demo_refuses_bad_arguments(flag, value, capsys):
    from dta_ref.demo import main

    with pytest.raises(SystemExit) as exit_info:
        main([flag, value, "--quick"])
    assert exit_info.value.code == 2 and f"argument {flag}: must be at least" in capsys.readouterr().err


def test_batches_take_numpy_sizes():
    batch = dta_ref.grpo_batch(np.int64(2), 0, np.int32(2), 3, vocab_size=np.int64(5))
    assert len(batch) == 4 and all(len(s) == 3 and max(s) < 5 for s in batch)
    assert len(dta_ref.agentic_batch(2, 1, 1, 1, 2, 1, 1, every_turn=np.bool_(False))) == 1


@pytest.mark.parametrize("fn,exc,match", ATTENTION_CASES)
def test_attention_rejects(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_decoder_config_rejects():
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        dta_ref.DecoderConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        dta_ref.DecoderConfig(hidden_size=12, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(num_heads=0), ValueError, "num_heads must be at least 1, got 0"),
        (dict(num_kv_heads=0), ValueError, "num_kv_heads must be at least 1"),
        (dict(head_dim=0), ValueError, "head_dim must be at least 1"),
        (dict(hidden_size=-64), ValueError, "hidden_size must be at least 1"),
        (dict(num_layers=2.0), TypeError, "num_layers must be an int, got float"),
        (
            dict(hidden_size=64, num_heads=3, num_kv_heads=1),
            ValueError,
            r"hidden_size \(64\) must be a multiple of num_heads \(3\)",
        ),
        (dict(rms_norm_eps=float("nan")), ValueError, "rms_norm_eps must be a positive finite number"),
        (dict(rope_theta=0.0), ValueError, "rope_theta must be a positive finite number"),
    ],
)
def test_decoder_config_rejects_sizes(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        dta_ref.DecoderConfig(**kwargs)


def test_decoder_config_takes_numpy_sizes_and_the_decoder_wants_batched_ids():
    cfg = dta_ref.DecoderConfig(
        vocab_size=np.int64(11),
        hidden_size=np.int32(16),
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
    )
    assert type(cfg.vocab_size) is int and type(cfg.hidden_size) is int and cfg.head_dim == 8
    model = dta_ref.Decoder(cfg)
    assert model(torch.tensor([[1, 2]])).shape == (1, 2, 11)
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, tokens\], got shape \(2,\)"):
        model(torch.tensor([1, 2]))


TREE = PrefixTree.from_sequences([[1, 2, 3], [1, 2, 4]])


def unsupported_model():
    return torch.nn.Sequential(torch.nn.Embedding(TINY_VOCAB, 8), torch.nn.Linear(8, TINY_VOCAB))


def reentrant_checkpointed(model):
    """``model`` training with Hugging Face's reentrant gradient checkpointing."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model.train()


def short_convolution_model():
    """A tiny LFM2: short-convolution layers beside attention layers, a layer type the tree does not compute."""
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "lfm2", vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def rope_llama(rope):
    """A tiny Llama whose RoPE frequencies depend on each call's largest position."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    cfg.rope_parameters = dict(rope, rope_theta=10000.0)
    cfg.rope_scaling = cfg.rope_parameters
    return transformers.LlamaForCausalLM(cfg)


def train_mode_with_dropout():
    model = tiny_hf_model("llama", torch.float64, "eager")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    return model.train()


LOGPROB_CASES = [
    case(
        "tree-logprobs-of-list",
        lambda: dta_ref.tree_logprobs(tiny_decoder(), [[1, 2, 3]]),
        TypeError,
        "expected a PrefixTree, got list",
    ),
    case(
        "tree-logprobs-unsupported-model",
        lambda: dta_ref.tree_logprobs(unsupported_model(), TREE),
        TypeError,
        "unsupported model Sequential",
    ),
    case(
        "flat-logprobs-unsupported-model",
        lambda: dta_ref.flat_logprobs(unsupported_model(), [[1, 2, 3]]),
        TypeError,
        "unsupported model Sequential",
    ),
    case(
        "hf-short-convolution-layers",
        lambda: dta_ref.tree_logprobs(short_convolution_model(), TREE),
        ValueError,
        "layer 0 of Lfm2ForCausalLM is a 'conv' layer",
    ),
    case(
        "hf-linear-attention-chunks-reentrant-checkpointing",
        lambda: dta_fast.tree_backward(
            reentrant_checkpointed(tiny_family_model("qwen3.5")),
            TREE,
            dta_ref.SFTLoss(TREE.logprob_mask),
            max_chunk_tokens=2,
        ),  # fmt: skip
        ValueError,
        "which reentrant activation checkpointing runs without a graph",
    ),
    case(
        "hf-dynamic-rope",
        lambda: dta_ref.tree_logprobs(rope_llama({"rope_type": "dynamic", "factor": 4.0}), TREE),
        ValueError,
        "rope type 'dynamic' is not supported",
    ),
    case(
        "hf-longrope",
        lambda: dta_ref.tree_logprobs(
            rope_llama(
                {
                    "rope_type": "longrope",
                    "long_factor": [1.0, 2.0, 4.0, 8.0],
                    "short_factor": [1.0] * 4,
                    "original_max_position_embeddings": 4,
                }
            ),
            TREE,
        ),
        ValueError,
        "rope type 'longrope' is not supported",
    ),
    case(
        "hf-attention-dropout-in-training",
        lambda: dta_ref.tree_logprobs(train_mode_with_dropout(), TREE),
        ValueError,
        "attention dropout is not supported",
    ),
    case("flat-empty-batch", lambda: dta_ref.flat_logprobs(tiny_decoder(), []), ValueError, "empty batch"),
    case(
        "flat-empty-sequence",
        lambda: dta_ref.flat_logprobs(tiny_decoder(), [[1], []]),
        ValueError,
        "sequence 1 is empty",
    ),
    case(
        "flat-string-batch",
        lambda: dta_ref.flat_logprobs(tiny_decoder(), "12"),
        TypeError,
        "must be a list of token sequences",
    ),
    case(
        "flat-float-tokens",
        lambda: dta_ref.flat_logprobs(tiny_decoder(), [[1, 2.5]]),
        TypeError,
        "tokens must be ints",
    ),
]


HEAD = torch.nn.Linear(4, TINY_VOCAB, bias=False).double()
HIDDEN = torch.randn(TREE.num_tokens, 4, dtype=torch.float64)
TREE_MASK = torch.ones(TREE.num_sequences, TREE.max_length - 1, dtype=torch.bool)
LOGPROB_CASES += [
    case(
        "chunked-zero-rows",
        lambda: dta_fast.gather_logprobs_chunked(HIDDEN, HEAD, TREE, chunk_rows=0),
        ValueError,
        "chunk_rows must be at least 1",
    ),
    case(
        "chunked-float-rows",
        lambda: dta_fast.gather_logprobs_chunked(HIDDEN, HEAD, TREE, chunk_rows=2.5),
        TypeError,
        "chunk_rows must be an int",
    ),
    case(
        "chunked-list-tree",
        lambda: dta_fast.gather_logprobs_chunked(HIDDEN, HEAD, [[1, 2]]),
        TypeError,
        "tree must be a PrefixTree",
    ),
]
# Both packed-hidden twins: the chunked one and the reference's.
for _twin, _gather in (("chunked", dta_fast.gather_logprobs_chunked), ("ref", dta_ref.gather_tree_logprobs)):
    LOGPROB_CASES += [
        case(
            f"{_twin}-zero-temperature",
            lambda g=_gather: g(HIDDEN, HEAD, TREE, temperature=0.0),
            ValueError,
            "temperature must be positive",
        ),
        case(
            f"{_twin}-negative-temperature",
            lambda g=_gather: g(HIDDEN, HEAD, TREE, temperature=-1.0),
            ValueError,
            "temperature must be positive",
        ),
        case(f"{_twin}-hidden-rows", lambda g=_gather: g(HIDDEN[:-1], HEAD, TREE), ValueError, "packed hidden states"),
        case(
            f"{_twin}-hidden-more-rows",
            lambda g=_gather: g(torch.cat([HIDDEN, HIDDEN]), HEAD, TREE),
            ValueError,
            "packed hidden states",
        ),
        case(f"{_twin}-hidden-3d", lambda g=_gather: g(HIDDEN[None], HEAD, TREE), ValueError, "packed hidden states"),
        case(
            f"{_twin}-float-mask",
            lambda g=_gather: g(HIDDEN, HEAD, TREE, mask=TREE_MASK.float()),
            TypeError,
            "mask must be a bool tensor",
        ),
        case(
            f"{_twin}-mask-shape",
            lambda g=_gather: g(HIDDEN, HEAD, TREE, mask=TREE_MASK[:, :1]),
            ValueError,
            "mask has shape",
        ),
    ]


@pytest.mark.parametrize("fn,exc,match", LOGPROB_CASES)
def test_logprobs_reject(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_trees_changed_by_hand_are_refused_by_the_scoring_entry_points():
    """A tree whose rows are not root-to-node paths, or whose parent points past the tree, is refused by
    the packed-hidden entry points of both packages (as by every other), not scored or read out of range."""
    import dataclasses

    from dta_fast.logprobs import gather_logprobs_chunked
    from dta_ref.logprobs import gather_tree_logprobs

    head = torch.nn.Linear(8, TINY_VOCAB, bias=False)
    hidden = torch.randn(TREE.num_tokens, 8)
    shuffled = dataclasses.replace(TREE, seq_index=TREE.seq_index.flip(1).clone())
    parent = TREE.parent.clone()
    parent[1] = TREE.num_tokens + 3
    for tree, match in (
        (shuffled, "is not a root-to-node path|lengths"),
        (dataclasses.replace(TREE, parent=parent), "is not the token above 1"),
    ):
        for gather in (
            lambda t: gather_logprobs_chunked(hidden, head, t),
            lambda t: gather_tree_logprobs(hidden, head, t),
        ):
            with pytest.raises(ValueError, match=match):
                gather(tree)


def test_response_mask_takes_unsigned_arrays():
    lengths = np.full(TREE.num_sequences, 2, dtype=np.uint64)
    assert torch.equal(TREE.response_mask(lengths), TREE.response_mask([2] * TREE.num_sequences))
    lengths[0] = 2**64 - 1  # past int64: refused with the others out of range, not wrapped to a small one
    with pytest.raises(ValueError, match="between 1 and its rollout's length"):
        TREE.response_mask(lengths)


def test_numpy_temperature_is_a_number():
    expected = dta_ref.tree_logprobs(tiny_decoder(), TREE, temperature=0.5)
    torch.testing.assert_close(dta_ref.tree_logprobs(tiny_decoder(), TREE, temperature=np.float32(0.5)), expected)


def test_reference_attention_refuses_second_derivatives():
    """dta_ref.attention's backward saves the forward's probabilities without their graph: a second
    derivative through it would be wrong, so create_graph=True raises instead."""
    q, k, v = (x.requires_grad_() for x in qkv())
    out = dta_ref.attention(q, k, v, CAUSAL)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad((out * torch.randn_like(out)).sum(), q, create_graph=True)


def test_hf_error_leaves_attention_implementation_unchanged():
    model = train_mode_with_dropout()
    with pytest.raises(ValueError, match="dropout"):
        dta_ref.tree_logprobs(model, TREE)
    assert model.config._attn_implementation == "eager"


LP = -torch.rand(2, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
MASK = torch.ones(2, 3, dtype=torch.bool)
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)

LOSS_CASES = [
    case(
        "invalid-normalization",
        lambda: dta_ref.policy_gradient_loss(LP, LP, ADV, MASK, normalization="mean"),
        ValueError,
        "normalization must be one of .* got 'mean'",
    ),
    case(
        "sft-invalid-normalization",
        lambda: dta_ref.sft_loss(LP, MASK, normalization="batch"),
        ValueError,
        "normalization must be one of",
    ),
    case("weights-1d-mask", lambda: dta_ref.token_weights(MASK[0]), ValueError, r"loss_mask must be a 2-D tensor"),
    case("weights-list-mask", lambda: dta_ref.token_weights([[1, 0]]), ValueError, r"loss_mask must be a 2-D tensor"),
    case(
        "logprobs-not-tensor",
        lambda: dta_ref.policy_gradient_loss(LP.tolist(), LP, ADV, MASK),
        TypeError,
        "logprobs must be a tensor, got list",
    ),
    case(
        "logprobs-1d",
        lambda: dta_ref.policy_gradient_loss(LP[0], LP[0], ADV, MASK[0]),
        ValueError,
        r"logprobs must be \[N, L\]",
    ),
    case(
        "old-logprobs-shape",
        lambda: dta_ref.policy_gradient_loss(LP, LP[:, :2], ADV, MASK),
        ValueError,
        r"old_logprobs has shape \(2, 2\), expected \(2, 3\)",
    ),
    case(
        "loss-mask-shape",
        lambda: dta_ref.policy_gradient_loss(LP, LP, ADV, MASK[:1]),
        ValueError,
        r"loss_mask has shape \(1, 3\), expected \(2, 3\)",
    ),
    case(
        "advantages-shape",
        lambda: dta_ref.policy_gradient_loss(LP, LP, torch.ones(3, dtype=torch.float64), MASK),
        ValueError,
        r"advantages must be \[N\] or \[N, L\]",
    ),
    case(
        "advantages-transposed",
        lambda: dta_ref.policy_gradient_loss(LP, LP, torch.ones(3, 2, dtype=torch.float64), MASK),
        ValueError,
        r"advantages must be \[N\] or \[N, L\]",
    ),
    case(
        "advantages-not-tensor",
        lambda: dta_ref.policy_gradient_loss(LP, LP, [1.0, -1.0], MASK),
        TypeError,
        "advantages must be a tensor",
    ),
    case(
        "negative-clip",
        lambda: dta_ref.policy_gradient_loss(LP, LP, ADV, MASK, clip_low=-0.1),
        ValueError,
        "clip ranges must be non-negative",
    ),
    case(
        "negative-clip-high",
        lambda: dta_ref.policy_gradient_loss(LP, LP, ADV, MASK, clip_high=-0.1),
        ValueError,
        "clip ranges must be non-negative",
    ),
    case(
        "dual-clip-not-above-one",
        lambda: dta_ref.policy_gradient_loss(LP, LP, ADV, MASK, dual_clip=1.0),
        ValueError,
        "dual_clip must be > 1",
    ),
    case(
        "sft-mask-shape",
        lambda: dta_ref.sft_loss(LP, MASK[:, :2]),
        ValueError,
        r"loss_mask has shape \(2, 2\), expected \(2, 3\)",
    ),
    case("sft-logprobs-3d", lambda: dta_ref.sft_loss(LP[None], MASK), ValueError, r"logprobs must be \[N, L\]"),
]


SFT = dta_ref.SFTLoss(MASK)
LAYOUT = dta_ref.PaddedLayout.of(torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
LOSS_CASES += [
    case("loss-index-past-the-batch", lambda: SFT(5, LP[0]), ValueError, "sequence index 5 is out of range"),
    case("loss-negative-index", lambda: SFT(-1, LP[0]), ValueError, "sequence index -1 is out of range"),
    case("loss-float-index", lambda: SFT(1.0, LP[0]), TypeError, "sequence index must be an int"),
    case("loss-rows-past-the-batch", lambda: SFT.rows([5]), ValueError, "index must be 1-D sequence indices"),
    case(
        "padded-float-column", lambda: LAYOUT.to_tree(torch.ones(2, 3), 2.5), TypeError, "first_column must be an int"
    ),
    case(
        "padded-bool-column", lambda: LAYOUT.to_tree(torch.ones(2, 3), True), TypeError, "first_column must be an int"
    ),
    case(
        "padded-nan-fill-of-ints",
        lambda: LAYOUT.to_tree(torch.ones(2, 3, dtype=torch.long), 1, fill=float("nan")),
        ValueError,
        "fill must be a whole number",
    ),
    case("padded-from-list", lambda: LAYOUT.from_tree([[1.0, 1.0]] * 2, 1, 2), TypeError, "values must be a tensor"),
    case(
        "padded-negative-columns",
        lambda: LAYOUT.from_tree(torch.ones(2, 3), 1, -1),
        ValueError,
        "columns must be a non-negative int",
    ),
    case("response-mask-of-bools", lambda: TREE.response_mask([True, True]), ValueError, "prompt_lengths must be"),
    case("response-mask-of-none", lambda: TREE.response_mask(None), TypeError, "prompt_lengths must be 2 integers"),
    case("response-mask-of-a-string", lambda: TREE.response_mask("ab"), TypeError, "prompt_lengths must be 2 integers"),
    case(
        "response-mask-of-floats",
        lambda: TREE.response_mask([2.0, 2]),
        TypeError,
        "prompt_lengths must be integers, got torch.float32",
    ),
    case(
        "mask-from-a-list",
        lambda: dta_ref.mask_from_subtree_end([3, 3, 3], torch.arange(3)),
        TypeError,
        "subtree_end must be an integer tensor",
    ),
    case(
        "mask-from-floats",
        lambda: dta_ref.mask_from_subtree_end(torch.tensor([2.5, 3.0, 3.0]), torch.arange(3)),
        TypeError,
        "subtree_end must be an integer tensor",
    ),
    case(
        "mask-at-float-positions",
        lambda: dta_ref.mask_from_subtree_end(torch.tensor([3, 3, 3]), torch.ones(3)),
        TypeError,
        "query_positions must be an integer tensor",
    ),
    case(
        "response-mask-a-bool-among-ints",
        lambda: TREE.response_mask([True] + [2] * (TREE.num_sequences - 1)),
        ValueError,
        "got a bool",
    ),
    case(
        "padded-fill-wraps",
        lambda: LAYOUT.to_tree(torch.ones(2, 3, dtype=torch.uint8), 1, fill=-1),
        ValueError,
        "fill -1 does not fit values of dtype torch.uint8",
    ),
    case(
        "padded-fill-past-int64",
        lambda: LAYOUT.to_tree(torch.ones(2, 3, dtype=torch.long), 1, fill=2**70),
        ValueError,
        "does not fit",
    ),
    case(
        "padded-fill-past-float32",
        lambda: LAYOUT.to_tree(torch.ones(2, 3), 1, fill=1e300),
        ValueError,
        "does not fit values of dtype torch.float32",
    ),
    case("tree-to-a-dtype", lambda: TREE.to(torch.float16), TypeError, "takes a device, got the dtype torch.float16"),
    case(
        "step-bytes-of-a-list",
        lambda: dta_fast.estimated_step_bytes(tiny_decoder(), [[1, 2]], 2),
        TypeError,
        "expected a PrefixTree",
    ),
    case(
        "budget-of-a-list",
        lambda: dta_fast.chunk_tokens_for_budget(tiny_decoder(), [[1, 2]], 10**6),
        TypeError,
        "expected a PrefixTree",
    ),
    case(
        "recompute-a-string",
        lambda: dta_fast.tree_backward(tiny_decoder(), TREE, SFTLoss_of(TREE), recompute="no"),
        TypeError,
        "recompute must be True, False or None",
    ),
    case(
        "checkpoint-layers-a-string",
        lambda: dta_fast.tree_backward(tiny_decoder(), TREE, SFTLoss_of(TREE), checkpoint_layers="yes"),
        TypeError,
        "checkpoint_layers must be True, False or None, got 'yes'",
    ),
    case(
        "loss-the-class",
        lambda: dta_fast.tree_backward(tiny_decoder(), TREE, dta_ref.SFTLoss),
        TypeError,
        "loss_fn is the class SFTLoss: pass an instance",
    ),
    case(
        "loss-complex",
        lambda: dta_fast.tree_backward(tiny_decoder(), TREE, lambda i, lp: lp.sum() * 1j),
        ValueError,
        "loss_fn must return a real scalar tensor; for sequence 0 it returned a torch.complex",
    ),
    case(
        "loss-a-float",
        lambda: dta_fast.tree_backward(tiny_decoder(), TREE, lambda i, lp: 1.0),
        ValueError,
        "loss_fn must return a real scalar tensor; for sequence 0 it returned float",
    ),
    # ints past float's range: the checks' own errors, not an OverflowError from float()
    case(
        "budget-past-the-floats",
        lambda: dta_fast.chunk_tokens_for_budget(tiny_decoder(), TREE, 10**400),
        ValueError,
        "memory_budget_bytes must be a finite positive number",
    ),
    case(
        "temperature-past-the-floats",
        lambda: dta_fast.tree_backward(tiny_decoder(), TREE, SFTLoss_of(TREE), temperature=10**400),
        ValueError,
        "temperature must be positive and finite",
    ),
    case(
        "cost-past-the-floats",
        lambda: dta_fast.CostModel(token=10**400),
        ValueError,
        "CostModel.token must be finite and non-negative",
    ),
]


def SFTLoss_of(tree):
    return dta_ref.SFTLoss(tree.logprob_mask)


@pytest.mark.parametrize("fn,exc,match", LOSS_CASES)
def test_losses_reject(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_numpy_integers_are_taken_as_ints():
    """A chunk size read from a config or an array (numpy's integers) is an int, as the engine's own
    sizes take it."""
    got = dta_fast.gather_logprobs_chunked(HIDDEN, HEAD, TREE, chunk_rows=np.int64(2))
    want = dta_fast.gather_logprobs_chunked(HIDDEN, HEAD, TREE, chunk_rows=2)
    assert torch.equal(got, want)
