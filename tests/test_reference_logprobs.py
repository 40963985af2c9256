"""Tree vs per-sequence logprobs on hand-made rollout sets: reference decoder and tiny HF models."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import dta_ref
from dta_ref import PrefixTree
from tests.helpers import (
    EPS32,
    HF_ATTN_IMPLEMENTATIONS,
    HF_FAMILIES,
    assert_close_report,
    assert_grads_close,
    assert_no_worse_than,
    flatten_grads,
    hf_exact_float64_copy,
    param_grads,
    tiny_decoder,
    tiny_hf_model,
)

V = 64
EDGE_CASES = {
    "single-sequence": [[5, 9, 2, 33, 7]],
    "single-token": [[11]],
    "all-length-one": [[0], [63], [0]],
    "duplicates": [[4, 8, 15, 16], [4, 8, 15, 16], [4, 8, 15, 16]],
    "prefix-of-another": [[1, 2, 3, 4, 5, 6], [1, 2, 3]],
    "branch-point": [[7, 1, 2], [7, 1, 3], [7, 1, 63], [7, 0]],
    "forest": [[3, 1, 4], [1, 5, 9], [2, 6], [63, 0, 63]],
    "vocab-edges": [[0, 63, 0, 63], [0, 63, 63], [63, 0]],
    "grpo-like": [[9] * 6 + [i, i + 1, i + 2] for i in range(10, 50, 8)],
}


def weighted_sum(logprobs, tree, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(logprobs.shape, generator=gen, dtype=torch.float64).to(logprobs.dtype)
    return (logprobs * w * tree.logprob_mask).sum()


def test_next_token_targets_at_a_branch_point():
    tree = PrefixTree.from_sequences([[1, 2, 3], [1, 2, 4], [1, 5]])
    rows, targets, valid = dta_ref.next_token_targets(tree)
    # packed: 1 2 3 4 5 -> the row of token "2" (packed 1) predicts 3 for one rollout and 4 for the other
    assert rows.tolist() == [[0, 1], [0, 1], [0, 0]]
    assert targets.tolist() == [[2, 3], [2, 4], [5, 0]]
    assert valid.tolist() == [[True, True], [True, True], [True, False]]
    assert torch.equal(valid, tree.logprob_mask)


def test_flat_logprobs_are_log_softmax_of_causal_logits():
    model = tiny_decoder(seed=1)
    seqs = [[3, 4, 5, 6], [3, 9]]
    lp = dta_ref.flat_logprobs(model, seqs)
    assert lp.shape == (2, 3) and lp.dtype == torch.float64
    for i, s in enumerate(seqs):
        logits = model(torch.tensor([s]))[0]
        expected = torch.log_softmax(logits, -1)[torch.arange(len(s) - 1), torch.tensor(s[1:])]
        assert torch.equal(lp[i, : len(s) - 1], expected)
        assert bool((lp[i, len(s) - 1 :] == 0).all())


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_decoder_tree_equals_flat_float64(name):
    seqs = EDGE_CASES[name]
    model = tiny_decoder(seed=2)
    tree = PrefixTree.from_sequences(seqs)
    tree_lp = dta_ref.tree_logprobs(model, tree)
    flat_lp = dta_ref.flat_logprobs(model, seqs)
    assert tree_lp.shape == flat_lp.shape == (len(seqs), max(map(len, seqs)) - 1)
    assert_close_report(tree_lp, flat_lp, atol=1e-12, rtol=1e-12, name=f"{name} logprobs")
    tree_g = param_grads(model, weighted_sum(tree_lp, tree))
    flat_g = param_grads(model, weighted_sum(flat_lp, tree))
    assert_grads_close(tree_g, flat_g, rel=1e-11, name=f"{name} grad")


def test_duplicates_get_identical_rows():
    model = tiny_decoder(seed=3)
    seqs = EDGE_CASES["duplicates"]
    lp = dta_ref.tree_logprobs(model, PrefixTree.from_sequences(seqs))
    assert torch.equal(lp[0], lp[1]) and torch.equal(lp[0], lp[2])


def test_prefix_rollout_rows_are_a_prefix_of_the_long_rows():
    model = tiny_decoder(seed=4)
    lp = dta_ref.tree_logprobs(model, PrefixTree.from_sequences(EDGE_CASES["prefix-of-another"]))
    assert torch.equal(lp[1, :2], lp[0, :2])
    assert lp[1, 2:].abs().sum() == 0


def test_shared_positions_sum_their_gradients():
    """A rollout set with a duplicate has exactly twice the gradient of that rollout alone."""
    model = tiny_decoder(seed=5)
    seq = [2, 7, 1, 8, 2, 8]
    once = param_grads(model, dta_ref.tree_logprobs(model, PrefixTree.from_sequences([seq])).sum())
    twice = param_grads(model, dta_ref.tree_logprobs(model, PrefixTree.from_sequences([seq, seq])).sum())
    assert_grads_close(twice, {n: 2 * g for n, g in once.items()}, rel=1e-12, name="duplicate")


def test_gather_tree_logprobs_from_hidden_states():
    model = tiny_decoder(seed=6)
    seqs = EDGE_CASES["branch-point"]
    tree = PrefixTree.from_sequences(seqs)
    mask = dta_ref.tree_attention_mask(tree)
    hidden = model.hidden_states(
        tree.tokens[None], tree.position_ids[None], lambda i, q, k, v, s: dta_ref.attention(q, k, v, mask, s)
    )[0]
    lp = dta_ref.gather_tree_logprobs(hidden, model.lm_head, tree)
    assert torch.equal(lp, dta_ref.tree_logprobs(model, tree))


@pytest.mark.parametrize(
    "as_input",
    [
        pytest.param(lambda s: s, id="lists"),
        pytest.param(lambda s: PrefixTree.from_sequences(s), id="prefix-tree"),
        pytest.param(lambda s: [torch.tensor(x) for x in s], id="list-of-tensors"),
        pytest.param(lambda s: torch.tensor(s), id="2d-tensor"),
        pytest.param(lambda s: np.array(s), id="2d-numpy"),
        pytest.param(lambda s: tuple(np.array(x, dtype=np.int32) for x in s), id="tuple-of-numpy"),
    ],
)
def test_flat_logprobs_input_forms(as_input):
    model = tiny_decoder(seed=7)
    seqs = [[1, 2, 3], [1, 2, 4], [5, 6, 7]]
    expected = dta_ref.flat_logprobs(model, seqs)
    assert torch.equal(dta_ref.flat_logprobs(model, as_input(seqs)), expected)


def test_tied_embeddings():
    torch.manual_seed(8)
    cfg = dta_ref.DecoderConfig(vocab_size=V, hidden_size=16, num_heads=2, num_kv_heads=1, tie_embeddings=True)
    model = dta_ref.Decoder(cfg).double()
    seqs = EDGE_CASES["forest"]
    tree = PrefixTree.from_sequences(seqs)
    tree_lp, flat_lp = dta_ref.tree_logprobs(model, tree), dta_ref.flat_logprobs(model, seqs)
    assert_close_report(tree_lp, flat_lp, atol=1e-12, rtol=1e-12, name="tied logprobs")
    tree_g = param_grads(model, weighted_sum(tree_lp, tree))
    flat_g = param_grads(model, weighted_sum(flat_lp, tree))
    assert_grads_close(tree_g, flat_g, rel=1e-11, name="tied grad")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_model_gives_float32_logprobs(dtype):
    model = tiny_decoder(seed=9).to(dtype)
    model64 = copy.deepcopy(model).to(torch.float64)  # the same rounded weights
    seqs = EDGE_CASES["branch-point"]
    tree = PrefixTree.from_sequences(seqs)
    with torch.no_grad():
        tree_lp, flat_lp = dta_ref.tree_logprobs(model, tree), dta_ref.flat_logprobs(model, seqs)
        truth = dta_ref.flat_logprobs(model64, seqs)
    assert tree_lp.dtype == flat_lp.dtype == torch.float32
    err_tree = float((tree_lp.double() - truth).abs().max())
    err_flat = float((flat_lp.double() - truth).abs().max())
    assert err_tree <= 4 * err_flat + 8 * torch.finfo(dtype).eps, (err_tree, err_flat)


@pytest.mark.parametrize("impl", HF_ATTN_IMPLEMENTATIONS)
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_tree_equals_flat(family, impl):
    model = tiny_hf_model(family, torch.float64, impl, seed=10)
    exact = hf_exact_float64_copy(model)
    seqs = EDGE_CASES["branch-point"] + EDGE_CASES["forest"] + EDGE_CASES["prefix-of-another"]
    tree = PrefixTree.from_sequences(seqs)

    # float64 throughout: tree and per-sequence agree to float64 precision
    truth_lp = dta_ref.flat_logprobs(exact, seqs)
    exact_lp = dta_ref.tree_logprobs(exact, tree)
    assert_close_report(exact_lp, truth_lp, atol=1e-12, rtol=1e-12, name=f"{family} exact logprobs")
    truth_g = param_grads(exact, weighted_sum(truth_lp, tree))
    assert_grads_close(
        param_grads(exact, weighted_sum(exact_lp, tree)), truth_g, rel=1e-11, name=f"{family} exact grad"
    )

    # as built (float32 casts inside transformers): the tree is no worse than each sequence alone
    tree_lp = dta_ref.tree_logprobs(model, tree)
    assert model.config._attn_implementation == impl
    flat_lp = dta_ref.flat_logprobs(model, seqs)
    assert_no_worse_than(tree_lp, flat_lp, truth_lp, factor=4, floor=32 * EPS32, name=f"{family}-{impl} logprobs")
    tree_g = flatten_grads(param_grads(model, weighted_sum(tree_lp, tree)))
    flat_g = flatten_grads(param_grads(model, weighted_sum(flat_lp, tree)))
    truth = flatten_grads(truth_g)
    floor = 32 * EPS32 * float(truth.abs().max())
    assert_no_worse_than(tree_g, flat_g, truth, factor=4, floor=floor, name=f"{family}-{impl} grad")


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_flat_logprobs_are_the_models_own_logits(family):
    model = tiny_hf_model(family, torch.float64, "sdpa", seed=11)
    seq = [4, 0, 63, 17, 17]
    lp = dta_ref.flat_logprobs(model, [seq])[0]
    logits = model(input_ids=torch.tensor([seq])).logits[0]
    expected = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    assert_close_report(lp, expected, atol=1e-12, rtol=1e-12, name="HF flat logprobs")


def test_hf_tree_path_leaves_the_model_as_built(monkeypatch):
    model = tiny_hf_model("llama", torch.float64, "eager", seed=12)
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(input_ids=ids).logits
    tree = PrefixTree.from_sequences([[1, 2, 3]])
    bad = tree.to("cpu")
    object.__setattr__(bad, "tokens", torch.tensor([1, 2, V + 5]))  # out of the vocabulary
    monkeypatch.setattr(dta_ref.adapter.ModelAdapter, "check_token_ids", lambda *args: None)  # fail inside
    with pytest.raises(IndexError):
        dta_ref.tree_logprobs(model, bad)
    dta_ref.tree_logprobs(model, tree)
    assert model.config._attn_implementation == "eager"
    assert torch.equal(model(input_ids=ids).logits, before)


@pytest.mark.parametrize("family", ["decoder", "llama"])
def test_token_ids_outside_the_vocabulary(family):
    model = tiny_decoder(torch.float64) if family == "decoder" else tiny_hf_model("llama", torch.float64, "sdpa")
    sequences = [[1, 2, 3], [1, V]]
    with pytest.raises(ValueError, match=f"token id {V} is out of range for a vocabulary of {V}"):
        dta_ref.flat_logprobs(model, sequences)
    with pytest.raises(ValueError, match="out of range"):
        dta_ref.tree_logprobs(model, PrefixTree.from_sequences(sequences))
