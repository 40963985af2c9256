"""Critics on the tree: per-token values and a PPO value loss, against each rollout run alone through the
model's own forward, values and every parameter gradient (the value head's included)."""

from __future__ import annotations

import functools

import pytest
import torch

import dta_fast
import dta_ref
from dta_ref import PrefixTree
from tests.helpers import TINY_VOCAB, tiny_decoder, tiny_family_model

SEQUENCES = dta_ref.grpo_batch(num_groups=2, prompt_len=6, num_responses=3, response_len=5, vocab_size=TINY_VOCAB)
TREE = PrefixTree.from_sequences(SEQUENCES)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TWINS = {"ref": dta_ref.tree_values, "kernel": functools.partial(dta_fast.tree_values, attention_impl="kernel")}


def token_classifier(family: str = "qwen2-sliding", dtype=torch.float64):
    """A tiny critic: the family's trunk and a one-output token head (AutoModelForTokenClassification)."""
    import transformers

    lm = tiny_family_model(family, dtype)
    config = lm.config
    config.num_labels = 1
    config.classifier_dropout = 0.0  # as verl builds its critic: in train mode a dropout masks shared tokens once
    torch.manual_seed(1)
    return transformers.AutoModelForTokenClassification.from_config(config).to(dtype).eval()


def critics(dtype):
    """(name, model, value_head): a token classifier, and a causal LM with a value head beside it."""
    lm = tiny_family_model("llama", dtype)
    torch.manual_seed(2)
    head = torch.nn.Linear(lm.config.hidden_size, 1).to(dtype)
    decoder = tiny_decoder(dtype)
    decoder_head = torch.nn.Linear(decoder.config.hidden_size, 1).to(dtype)
    return [
        ("qwen2-token-classifier", token_classifier("qwen2-sliding", dtype), None),
        ("gemma2-token-classifier", token_classifier("gemma2", dtype), None),
        ("llama-with-value-head", lm, head),
        ("decoder-with-value-head", decoder, decoder_head),
    ]


def value_loss_and_grads(values, model, head):
    g = torch.Generator().manual_seed(0)
    returns = torch.randn(values.shape, generator=g, dtype=torch.float64).to(values)
    old = (values.detach() + 0.1 * torch.randn(values.shape, generator=g, dtype=torch.float64).to(values)).detach()
    mask = TREE.seq_index >= 0
    loss = dta_ref.value_loss(values, old, returns, mask.to(values.device), clip=0.05)
    params = [p for p in model.parameters()] + ([] if head is None else list(head.parameters()))
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), torch.cat(
        [(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)]
    )


@pytest.mark.parametrize("twin", ["ref", pytest.param("kernel", marks=pytest.mark.kernel)])
@pytest.mark.parametrize("index", range(4), ids=lambda i: ["qwen2", "gemma2", "llama+head", "decoder+head"][i])
def test_tree_values_equal_each_rollout_alone(index, twin):
    """Values [N, Lmax] and a clipped value loss's gradients: the tree's are each rollout alone's."""
    dtype = torch.float64 if twin == "ref" else torch.float32
    name, model, head = critics(dtype)[index]
    if twin == "kernel":  # compiled on CUDA, interpreted on the CPU
        model, head = model.to(DEVICE), None if head is None else head.to(DEVICE)
    want = dta_ref.flat_values(model, SEQUENCES, value_head=head)
    got = TWINS[twin](model, TREE, value_head=head)
    assert got.shape == (TREE.num_sequences, TREE.max_length)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    padding = (TREE.seq_index < 0).to(got.device)
    assert torch.equal(got[padding], torch.zeros_like(got[padding]))
    want_loss, want_grads = value_loss_and_grads(want, model, head)
    got_loss, got_grads = value_loss_and_grads(got, model, head)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-7)
    assert want_grads.norm() > 0
    assert float((got_grads - want_grads).norm() / want_grads.norm()) < 1e-5, name


def test_critics_are_told_apart_from_policies():
    """A value model has values, not logprobs; a policy without a value head has no values: both refused by
    name before any forward."""
    critic = token_classifier()
    with pytest.raises(TypeError, match="value model.*tree_values"):
        dta_ref.tree_logprobs(critic, TREE)
    with pytest.raises(TypeError, match="value model.*tree_values"):
        dta_fast.tree_logprobs(critic, TREE)
    with pytest.raises(TypeError, match="has no value head: pass value_head="):
        dta_ref.tree_values(tiny_family_model("llama"), TREE)
    with pytest.raises(TypeError, match="value_head must be a torch.nn.Module"):
        dta_fast.tree_values(tiny_family_model("llama"), TREE, value_head=lambda h: h)
    with pytest.raises(ValueError, match="gives 64 outputs per token, not one"):
        lm = tiny_family_model("llama")
        dta_ref.tree_values(lm, TREE, value_head=lm.lm_head)


def test_value_loss_by_hand():
    """0.5 (v - R)^2 and its clipped form, token-mean over the mask; masked entries never matter."""
    v = torch.tensor([[1.0, 2.0, float("nan")]], dtype=torch.float64)
    old = torch.tensor([[0.0, 2.5, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[0.0, 0.0, float("inf")]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    assert dta_ref.value_loss(v, old, ret, mask).item() == pytest.approx(0.5 * (1 + 4) / 2)
    # clipped: v_old + clip(v - v_old, -0.2, 0.2) = 0.2 and 2.3; max of squared errors: 1 and 5.29
    assert dta_ref.value_loss(v, old, ret, mask, clip=0.2).item() == pytest.approx(0.5 * (1 + 5.29) / 2)
    with pytest.raises(ValueError, match="returns is not finite"):
        dta_ref.value_loss(v, old, ret.nan_to_num(posinf=1.0).index_fill(1, torch.tensor([0]), float("nan")), mask)


def test_a_reward_model_scores_every_prefix():
    """A sequence classifier with one output (a reward model, the usual start of a critic) has the same
    one-output ``score`` head: its tree value at a rollout's last token is the model's own score of that
    rollout, and at token t the score of the rollout cut after t."""
    import transformers

    config = tiny_family_model("llama").config
    config.num_labels, config.pad_token_id = 1, 0
    torch.manual_seed(3)
    reward_model = transformers.AutoModelForSequenceClassification.from_config(config).double().eval()
    values = dta_fast.tree_values(reward_model, TREE)
    for i, seq in enumerate(SEQUENCES[:3]):
        for cut in (len(seq), len(seq) - 2):
            own = reward_model(torch.tensor([seq[:cut]])).logits[0, 0]
            torch.testing.assert_close(values[i, cut - 1], own, rtol=1e-5, atol=1e-6)


def _value_loss_inputs(dtype):
    g = torch.Generator().manual_seed(5)
    shape = (TREE.num_sequences, TREE.max_length)
    mask = TREE.seq_index >= 0
    mask[:, :6] = False  # the prompts carry no value loss
    returns = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    old = (0.3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    return old, returns, mask


def test_value_loss_per_sequence_is_the_batch_loss():
    values = torch.randn(TREE.num_sequences, TREE.max_length, dtype=torch.float64)
    old, returns, mask = _value_loss_inputs(torch.float64)
    for clip, normalization in ((None, "token_mean"), (0.1, "sequence_mean"), (0.1, "sum")):
        loss = dta_ref.ValueLoss(old, returns, mask, clip=clip, normalization=normalization)
        per_sequence = sum(loss(i, values[i, : int(n)]) for i, n in enumerate(TREE.lengths))
        want = dta_ref.value_loss(values, old, returns, mask, clip=clip, normalization=normalization)
        torch.testing.assert_close(per_sequence, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk", [None, 5, 13], ids=["one-chunk", "chunks-of-5", "chunks-of-13"])
@pytest.mark.parametrize("index", [0, 2], ids=["qwen2-token-classifier", "llama+head"])
def test_tree_backward_trains_a_critic(index, chunk):
    """A clipped value loss through tree_backward, in one chunk and in small chunks: the loss, the values
    and every parameter gradient (the value head's included) of autograd on each rollout alone."""
    name, model, head = critics(torch.float64)[index]
    old, returns, mask = _value_loss_inputs(torch.float64)
    params = list(model.parameters()) + ([] if head is None else list(head.parameters()))
    want_values = dta_ref.flat_values(model, SEQUENCES, value_head=head)
    want_loss = dta_ref.value_loss(want_values, old, returns, mask, clip=0.1)
    want = torch.autograd.grad(want_loss, params, allow_unused=True)
    for p in params:
        p.grad = None
    loss_fn = dta_ref.ValueLoss(old, returns, mask, clip=0.1)
    values, loss = dta_fast.tree_backward(model, TREE, loss_fn, max_chunk_tokens=chunk, value_head=head)
    # transformers computes its norms in float32 inside a float64 model, hence 1e-6
    torch.testing.assert_close(values, want_values.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-6, atol=1e-8)
    got = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    want = [g if g is not None else torch.zeros_like(p) for g, p in zip(want, params)]
    flat_got, flat_want = torch.cat([g.flatten() for g in got]), torch.cat([g.flatten() for g in want])
    assert flat_want.norm() > 0 and float((flat_got - flat_want).norm() / flat_want.norm()) < 1e-6, name


def test_a_loss_for_the_other_kind_of_model_is_refused():
    """A value loss on a policy, a policy loss on a critic, a temperature on values: refused by name."""
    old, returns, mask = _value_loss_inputs(torch.float64)
    value_loss = dta_ref.ValueLoss(old, returns, mask)
    sft = dta_ref.SFTLoss(TREE.logprob_mask)
    with pytest.raises(ValueError, match="loss of values .ValueLoss., but the model gives logprobs"):
        dta_fast.tree_backward(tiny_family_model("llama"), TREE, value_loss)
    with pytest.raises(ValueError, match="loss of logprobs .SFTLoss., but the model gives values"):
        dta_fast.tree_backward(token_classifier(), TREE, sft)
    with pytest.raises(ValueError, match="a critic's values have none"):
        dta_fast.tree_backward(token_classifier(), TREE, value_loss, temperature=0.7)
