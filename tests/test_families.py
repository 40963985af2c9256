"""Every text family RL teams train, on the tree, against each rollout run alone through the model's own
forward: logprobs and every parameter gradient. Rollouts are longer than the sliding windows; the
families bring windows, attention sinks, logit softcapping (attention and final), MLA head dims, MoE
routing and its auxiliary loss, QK norms, partial rotary and embedding scaling."""

from __future__ import annotations

import copy

import pytest
import torch

import dta_fast
import dta_ref
from dta_fast.trainer_common import LinearizedLoss
from dta_ref import PrefixTree
from tests.helpers import LINEAR_FAMILIES, MOE_FAMILIES, TEXT_FAMILIES, TINY_VOCAB, WINDOW, tiny_family_model

GRPO = dta_ref.grpo_batch(num_groups=2, prompt_len=7, num_responses=3, response_len=6, vocab_size=TINY_VOCAB, seed=1)
AGENTIC = dta_ref.agentic_batch(
    system_len=4, num_tasks=2, task_len=2, rollouts_per_task=2, turns=3, assistant_len=2, tool_len=2,
    vocab_size=TINY_VOCAB, seed=2,
)  # fmt: skip
ROLLOUT_SETS = {"grpo": GRPO, "agentic": AGENTIC}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
assert min(map(len, GRPO)) > 2 * WINDOW and max(map(len, AGENTIC)) > 2 * WINDOW


def weighted(logprobs: torch.Tensor, tree: PrefixTree) -> torch.Tensor:
    """A loss with a random weight on every logprob (one seed: the same weights for every way of computing)."""
    weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return (logprobs * weights.to(logprobs) * tree.logprob_mask.to(logprobs.device)).sum()


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def each_rollout_alone(model, sequences, tree):
    """The truth: logprobs of each rollout alone through the model's own forward, and the gradient of the
    weighted loss on them."""
    model.zero_grad(set_to_none=True)
    logprobs = dta_ref.flat_logprobs(model, sequences)
    weighted(logprobs, tree).backward()
    return logprobs.detach(), grads(model)


def assert_same(got_lp, got_grads, want_lp, want_grads, rel: float, what: str):
    torch.testing.assert_close(got_lp.double(), want_lp.double(), rtol=rel, atol=rel, msg=lambda m: f"{what}: {m}")
    err = float((got_grads.double() - want_grads.double()).norm() / want_grads.double().norm())
    assert err < rel, f"{what}: parameter gradients {err:.2e} (relative) away from each rollout alone"


@pytest.mark.parametrize("rollouts", ROLLOUT_SETS)
@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_reference_tree_equals_each_rollout_alone(family, rollouts):
    """dta_ref.tree_logprobs (explicit masks) and tree_backward in one chunk and in small chunks: the
    logprobs and parameter gradients of each rollout alone (float64 models; transformers computes norms
    and routers in float32 inside, hence 1e-6). Hybrids' chunks read recurrent states across chunks."""
    sequences = ROLLOUT_SETS[rollouts]
    tree = PrefixTree.from_sequences(sequences)
    model = tiny_family_model(family, torch.float64)
    want_lp, want_grads = each_rollout_alone(model, sequences, tree)
    assert want_grads.norm() > 0

    # the model's own delta rule computes in float32 whatever the model's dtype, hence 3e-5 for the hybrids
    rel = 3e-5 if family in LINEAR_FAMILIES else 1e-6
    model.zero_grad(set_to_none=True)
    logprobs = dta_ref.tree_logprobs(model, tree)
    weighted(logprobs, tree).backward()
    assert_same(logprobs.detach(), grads(model), want_lp, want_grads, rel, "dta_ref.tree_logprobs")

    loss = WeightedLoss(tree)
    for chunk in (None, 5, 13):
        model.zero_grad(set_to_none=True)
        logprobs, _ = dta_fast.tree_backward(model, tree, loss, max_chunk_tokens=chunk)
        assert_same(logprobs, grads(model), want_lp, want_grads, rel, f"tree_backward, chunks of {chunk}")


def assert_hybrid_is_each_rollout_alone(family: str, sequences, chunks) -> None:
    """Both twins' tree_logprobs and tree_backward in ``chunks``: each rollout alone's logprobs and every
    gradient (the model's delta rule computes in float32 whatever its dtype, hence 3e-5)."""
    tree = PrefixTree.from_sequences(sequences)
    model = tiny_family_model(family, torch.float64)
    want_lp, want_grads = each_rollout_alone(model, sequences, tree)
    for twin in (dta_ref, dta_fast):
        model.zero_grad(set_to_none=True)
        logprobs = twin.tree_logprobs(model, tree)
        weighted(logprobs, tree).backward()
        assert_same(logprobs.detach(), grads(model), want_lp, want_grads, 3e-5, f"{twin.__name__}.tree_logprobs")
    for chunk in chunks:
        model.zero_grad(set_to_none=True)
        logprobs, _ = dta_fast.tree_backward(model, tree, WeightedLoss(tree), max_chunk_tokens=chunk)
        assert_same(logprobs, grads(model), want_lp, want_grads, 3e-5, f"tree_backward, chunks of {chunk}")


@pytest.mark.parametrize("family", LINEAR_FAMILIES)
@pytest.mark.parametrize("checkpointing", ["ours", "model"])
def test_hybrid_chunks_with_checkpointed_layers(family, checkpointing):
    """Hybrids in chunks with every layer under non-reentrant activation checkpointing (tree_backward's
    checkpoint_layers, or the model's own gradient checkpointing): a layer's recomputation reads the same
    states and convolution inputs, so logprobs and every gradient are each rollout alone's."""
    model = tiny_family_model(family, torch.float64).train()
    options = dict(checkpoint_layers=True) if checkpointing == "ours" else {}
    if checkpointing == "model":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for sequences in (GRPO, AGENTIC):
        tree = PrefixTree.from_sequences(sequences)
        want_lp, want_grads = each_rollout_alone(model, sequences, tree)
        for chunk in (5, 13):
            model.zero_grad(set_to_none=True)
            logprobs, _ = dta_fast.tree_backward(model, tree, WeightedLoss(tree), max_chunk_tokens=chunk, **options)
            assert_same(logprobs, grads(model), want_lp, want_grads, 3e-5, f"checkpointed, chunks of {chunk}")


@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_hybrid_forks_inside_a_convolution_window(family):
    """Forks 1, 2 and 3 tokens after the one before (the convolution spans 4 tokens, so its window crosses
    two or three branch points): both twins and tree_backward in chunks against each rollout alone."""
    prompt = [1, 2, 3, 4, 5, 6]
    sequences = [
        prompt + [10, 11, 12, 13, 14, 15, 16],
        prompt + [10, 20, 21, 22, 23, 24],  # a fork 1 token after the fork at the prompt's end
        prompt + [10, 11, 30, 31, 32, 33],  # 2 tokens after
        prompt + [10, 11, 12, 40, 41, 42, 43],  # 3 tokens after
        prompt + [50, 51, 52, 53],
    ]  # each branch longer than the window, so the window's reach below every fork is scored
    assert_hybrid_is_each_rollout_alone(family, sequences, chunks=(None, 3, 5))


@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_hybrid_segments_longer_than_the_kernel_chunk(family):
    """Segments span several of the delta rule's 64-token chunks and forks fall inside one: both twins and
    tree_backward (a chunk boundary inside a segment) against each rollout alone."""
    sequences = dta_ref.grpo_batch(
        num_groups=1, prompt_len=130, num_responses=3, response_len=100, vocab_size=TINY_VOCAB, seed=3
    )  # fmt: skip
    tree = PrefixTree.from_sequences(sequences)
    assert max(end - start for start, end, _ in dta_ref.linear_attention.segments(tree.parent)) > 128
    assert_hybrid_is_each_rollout_alone(family, sequences, chunks=(None, 100))


def WeightedLoss(tree: PrefixTree) -> LinearizedLoss:
    """:func:`weighted` as a TokenLoss, so tree_backward trains it chunk by chunk."""
    shape = (tree.num_sequences, tree.max_length - 1)
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return LinearizedLoss(weights * tree.logprob_mask)


VARIANT_FAMILIES = ("gemma2", "gpt-oss", "deepseek-v3")  # softcaps, sinks and windows, MLA: in the quick subset


@pytest.mark.kernel
@pytest.mark.parametrize(
    "family", [f if f in VARIANT_FAMILIES else pytest.param(f, marks=pytest.mark.slow) for f in TEXT_FAMILIES]
)
def test_kernel_tree_equals_each_rollout_alone(family):
    """The Triton kernel (interpreted on CPU) on a float32 model: its logprobs and gradients are as close to
    the float64 truth as each rollout alone in float32 is, within a small factor."""
    tree = PrefixTree.from_sequences(GRPO)
    model = tiny_family_model(family, torch.float32).to(DEVICE)
    exact = copy.deepcopy(model).double()
    want_lp, want_grads = each_rollout_alone(exact, GRPO, tree)
    same_lp, same_grads = each_rollout_alone(model, GRPO, tree)
    model.zero_grad(set_to_none=True)
    logprobs = dta_fast.tree_logprobs(model, tree, attention_impl="kernel")
    weighted(logprobs, tree).backward()
    lp_err = float((logprobs.detach().double() - want_lp).abs().max())
    lp_same = float((same_lp.double() - want_lp).abs().max())
    assert lp_err <= 4 * lp_same + 1e-5, f"logprobs {lp_err:.2e} against {lp_same:.2e} each rollout alone"
    norm = want_grads.norm()
    g_err = float((grads(model).double() - want_grads).norm() / norm)
    g_same = float((same_grads.double() - want_grads).norm() / norm)
    assert g_err <= 4 * g_same + 1e-5, f"gradients {g_err:.2e} against {g_same:.2e} each rollout alone"


@pytest.mark.kernel
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gpt-oss", "deepseek-v3"])
def test_kernel_tree_backward_in_chunks(family):
    """tree_backward through the kernel in small chunks, where cached prefixes meet windows, sinks, softcaps
    and MLA head dims: each rollout alone's gradients, within float32."""
    tree = PrefixTree.from_sequences(AGENTIC)
    model = tiny_family_model(family, torch.float32).to(DEVICE)
    want_lp, want_grads = each_rollout_alone(copy.deepcopy(model).double(), AGENTIC, tree)
    model.zero_grad(set_to_none=True)
    logprobs, _ = dta_fast.tree_backward(model, tree, WeightedLoss(tree), max_chunk_tokens=7, attention_impl="kernel")
    assert_same(logprobs, grads(model), want_lp, want_grads, 1e-4, "kernel, chunks of 7")


@pytest.mark.parametrize("family", [f for f in MOE_FAMILIES if f != "deepseek-v3"])  # DeepSeek-V3 has none
def test_router_aux_loss_equals_the_padded_batch(family):
    """A MoE model's load-balancing loss over the tree, each packed token counted once per rollout that
    holds it, equals the model's own on the padded batch of the rollouts, and so do its gradients
    (Qwen3-Next's loss sums its token weights in float32: looser there)."""
    value_rtol, grad_rtol = (1e-6, 5e-6) if family == "qwen3-next" else (1e-9, 1e-6)  # routers: float32
    model = tiny_family_model(family, torch.float64)
    width = max(map(len, GRPO))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in GRPO])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in GRPO])
    want = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    want_grads = torch.autograd.grad(want, list(model.parameters()), allow_unused=True)
    tree = PrefixTree.from_sequences(GRPO)
    assert int(tree.multiplicity.sum()) == int(mask.sum())
    for twin in (dta_ref.tree_logprobs_and_entropy, dta_fast.tree_logprobs_and_entropy):
        aux = twin(model, tree, router_aux_loss=True).aux_loss
        torch.testing.assert_close(aux, want, rtol=value_rtol, atol=0)
        got = torch.autograd.grad(aux, list(model.parameters()), allow_unused=True)
        assert [g is None for g in got] == [w is None for w in want_grads]  # the same parameters reached
        got, flat = (torch.cat([x.flatten() for x in gs if x is not None]) for gs in (got, want_grads))
        assert float((got - flat).norm() / flat.norm()) < grad_rtol
    with pytest.raises(TypeError, match="no MoE auxiliary loss|no router logits"):
        dta_ref.tree_logprobs_and_entropy(tiny_family_model("llama"), tree, router_aux_loss=True)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt-oss"])
def test_samplers_past_the_window(family):
    """The samplers generate past a sliding window (sinks and softcaps too): the twins draw the same tokens,
    and their behaviour logprobs are each completion's logprobs scored alone."""
    model = tiny_family_model(family, torch.float64)
    prompts = [GRPO[0][:4], GRPO[3][:6]]
    kw = dict(temperature=1.0, eos_token_id=None)
    ref = dta_ref.sample(model, prompts, 2 * WINDOW, generator=torch.Generator().manual_seed(3), **kw)
    fast = dta_fast.sample(model, prompts, 2 * WINDOW, generator=torch.Generator().manual_seed(3), **kw)
    assert ref.completions == fast.completions
    cache = dta_ref.RolloutCache()
    for p, c in zip(prompts, ref.completions):
        cache.add(p, c)
    spec = dta_fast.speculative_sample(model, prompts, 2 * WINDOW, cache=cache, temperature=0.0)
    greedy = dta_ref.sample(model, prompts, 2 * WINDOW, temperature=0.0)
    assert spec.completions == greedy.completions
    scored = dta_ref.flat_logprobs(model, [p + c for p, c in zip(prompts, fast.completions)])
    for i, (p, c) in enumerate(zip(prompts, fast.completions)):
        torch.testing.assert_close(fast.logprobs[i][: len(c)].double(), scored[i, len(p) - 1 : len(p) - 1 + len(c)],
                                   rtol=1e-6, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_hybrid_samplers(family):
    """Hybrids in every sampler: each draft node continues its parent's recurrent state and convolution
    inputs, and a row's cache continues from its last accepted token. Greedy, both samplers and both
    speculative samplers (their drafts branching off the greedy path at its start, after 3 and after 6
    tokens) give transformers' generate's tokens; sampled, the speculative twins draw the same tokens
    from one generator."""
    model = tiny_family_model(family, torch.float64)
    prompts = [GRPO[0][:5], GRPO[3][:9]]  # rows of different lengths: the shorter one's window is padded
    want = [
        model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p) :].tolist()
        for p in prompts
    ]
    for sampler in (dta_ref.sample, dta_fast.sample):
        assert sampler(model, prompts, 12, temperature=0.0).completions == want, sampler.__module__
    for sampler in (dta_ref.speculative_sample, dta_fast.speculative_sample):
        cache = dta_ref.RolloutCache()
        for prompt, greedy in zip(prompts, want, strict=True):
            for at in (0, 3, 6):  # a draft tree that leaves the greedy path at these depths
                cache.add(prompt, greedy[:at] + [(greedy[at] + 1) % TINY_VOCAB] * 4)
        out = sampler(model, prompts, 12, cache=cache, temperature=0.0)
        assert out.completions == want, sampler.__module__
        assert 0 < out.stats["accepted_tokens"] < out.stats["drafted_tokens"], out.stats
    caches = dta_ref.RolloutCache(), dta_ref.RolloutCache()
    for seed in range(3):
        ref, fast = (
            sampler(model, prompts * 2, 8, cache=c, generator=torch.Generator().manual_seed(seed))
            for sampler, c in zip((dta_ref.speculative_sample, dta_fast.speculative_sample), caches, strict=True)
        )
        assert ref.completions == fast.completions
        for x, y in zip(ref.logprobs, fast.logprobs, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_a_hybrid_forward_without_linear_mixing_is_refused():
    """The adapter's seam: a forward over a hybrid that brings attention but no linear-attention mixing is
    refused by name at the first Gated DeltaNet layer, not run as if each row were one sequence."""
    from dta_ref.attention import masked_attend

    model = tiny_family_model("qwen3.5", torch.float64)
    tree = PrefixTree.from_sequences(GRPO)
    attend = masked_attend(tree.subtree_end, torch.arange(tree.num_tokens), tree.position_ids)
    with pytest.raises(ValueError, match="passed no linear-attention mixing"):
        dta_ref.adapt(model).hidden_states(tree.tokens[None], tree.position_ids[None], attend)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hybrid_on_cuda(monkeypatch):
    """A hybrid on CUDA, packed and in chunks (states and convolution inputs entering from earlier
    chunks): logprobs and every gradient of each rollout alone through the model's own forward. Where
    flash-linear-attention is installed (the kernel transformers then uses), each level of segments is
    one variable-length call."""
    import transformers

    import dta_fast.linear_attention as linear

    config = transformers.AutoConfig.for_model(
        "qwen3_5_text", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
        initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().cuda().eval()
    calls = []
    monkeypatch.setattr(linear, "levels", lambda segs, f=linear.levels: calls.append(len(segs)) or f(segs))
    trees = {name: PrefixTree.from_sequences(s) for name, s in ROLLOUT_SETS.items()}
    with torch.no_grad():  # the forward alone (scoring), which runs wherever the model's kernels run
        for name, tree in trees.items():
            calls.clear()
            got = dta_fast.tree_logprobs(model, tree)
            assert bool(calls) == linear.fla_available(), "levels batched only with flash-linear-attention"
            want = dta_ref.flat_logprobs(model, ROLLOUT_SETS[name])
            torch.testing.assert_close(got.double(), want.double(), rtol=5e-3, atol=5e-3)
    try:
        each_rollout_alone(model, GRPO, trees["grpo"])
    except RuntimeError as error:  # flash-linear-attention refuses its gated backward on some GPU/Triton pairs
        pytest.skip(f"the model's own backward does not run here: {error}")
    for name, tree in trees.items():
        want_lp, want_grads = each_rollout_alone(model, ROLLOUT_SETS[name], tree)
        for chunk in (None, 7):
            calls.clear()
            model.zero_grad(set_to_none=True)
            logprobs, _ = dta_fast.tree_backward(model, tree, WeightedLoss(tree), max_chunk_tokens=chunk)
            assert bool(calls) == linear.fla_available(), "levels batched only with flash-linear-attention"
            assert_same(logprobs, grads(model), want_lp, want_grads, 5e-3, f"CUDA, {name}, chunks of {chunk}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_hybrid_samplers_on_cuda(family):
    """The KV-cached samplers on CUDA (the tree kernel, states kept on the device): greedy, the plain and
    the speculative sampler (drafts branching off the greedy path) give the reference sampler's tokens."""
    model = tiny_family_model(family, torch.float32).cuda()
    prompts = [GRPO[0][:5], GRPO[3][:9]]
    want = dta_ref.sample(model, prompts, 12, temperature=0.0).completions
    assert dta_fast.sample(model, prompts, 12, temperature=0.0).completions == want
    cache = dta_ref.RolloutCache()
    for prompt, greedy in zip(prompts, want, strict=True):
        for at in (0, 3, 6):
            cache.add(prompt, greedy[:at] + [(greedy[at] + 1) % TINY_VOCAB] * 4)
    out = dta_fast.speculative_sample(model, prompts, 12, cache=cache, temperature=0.0)
    assert out.completions == want and 0 < out.stats["accepted_tokens"] < out.stats["drafted_tokens"]


def test_an_attention_keyword_the_tree_does_not_compute_is_refused():
    """A layer that passes its attention function a keyword the tree does not compute (a chunked-attention
    size, a non-causal call) is refused by name, never run as if it were plain attention."""
    from transformers import AttentionInterface

    from dta_ref.hf import route_attention

    route_attention("eager")
    routed = AttentionInterface._global_mapping["eager"]
    module = torch.nn.Module()
    module.layer_idx = 0
    q = torch.randn(1, 2, 3, 4)
    attend = lambda *args, **kwargs: q  # noqa: E731
    with pytest.raises(TypeError, match="passes attention_chunk_size to its attention function"):
        routed(module, q, q, q, None, dta_attend=attend, attention_chunk_size=4)
    with pytest.raises(TypeError, match="is_causal=False"):
        routed(module, q, q, q, None, dta_attend=attend, is_causal=False)
    assert routed(module, q, q, q, None, dta_attend=attend, position_ids=None, use_cache=False)[0].shape == (1, 3, 2, 4)
