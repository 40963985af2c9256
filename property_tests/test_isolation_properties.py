"""Isolation: a NaN that belongs to one rollout reaches no other rollout.

Poison the embedding row of a token only rollout r uses. Then, with a loss
that leaves r out, every other rollout's logprobs and every gradient row of
the embedding of a token r never uses must equal the clean run's, bit for
bit. That is as far as exactness can go in any packed computation (and in
per-sequence training too, once r's own backward runs): the other parameters'
gradients sum over all rows, r's included (dW = X^T dY with a NaN row of X),
and the rows r shares with others (a common prompt) receive r's NaN
gradient through its attention (docs/prefix_tree.md, "Isolation").
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dta_ref
from property_tests.strategies import rollout_sets, seeds
from tests.helpers import tiny_decoder

POISON = 62  # tiny_decoder's vocabulary is 64; the drawn rollouts use ids below it
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
few = settings(max_examples=max(3, settings.default.max_examples // 5))


@st.composite
def poisoned_batches(draw):
    """(sequences, r): rollout r gets the token POISON (used by no other rollout) and one more after it."""
    sequences = draw(rollout_sets(max_sequences=5, max_len=8, vocab_size=POISON))
    r = draw(st.integers(0, len(sequences) - 1))
    sequences = [list(s) for s in sequences]
    sequences[r] = sequences[r] + [POISON, draw(st.integers(0, POISON - 1))]
    return sequences, r


class _WeightedLogprobs(dta_ref.TokenLoss):
    """sum(weights * logprobs)."""

    def _term(self, seq, step, logprobs):
        return logprobs


def _run(model, tree, r, entry, weights):
    """Logprobs and the embedding gradient for the loss sum(weights * logprobs) over every rollout but r."""
    import dta_fast

    model.zero_grad(set_to_none=True)
    keep = tree.logprob_mask & (torch.arange(tree.num_sequences) != r)[:, None]
    if entry.startswith("tree_backward"):
        loss = _WeightedLogprobs(torch.where(keep, weights, 0))
        impl = "kernel" if entry.endswith("kernel") else "reference"
        logprobs, _ = dta_fast.tree_backward(model, tree, loss, max_chunk_tokens=5, attention_impl=impl)
    else:
        if entry == "reference":
            logprobs = dta_ref.tree_logprobs(model, tree)
        else:
            logprobs = dta_fast.tree_logprobs(model, tree, attention_impl="kernel")
        keep, weights = keep.to(logprobs.device), weights.to(logprobs.device, logprobs.dtype)
        (torch.where(keep, logprobs, 0) * weights).sum().backward()
    return logprobs.detach().cpu(), model.embed.weight.grad.cpu()


def _check(sequences, r, entry, seed, dtype):
    tree = dta_ref.PrefixTree.from_sequences(sequences)
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(tree.logprob_mask.shape, generator=g, dtype=torch.float64)
    device = "cpu" if entry.endswith("reference") else DEVICE
    clean = tiny_decoder(dtype, seed=seed % 1000).to(device)
    poisoned = tiny_decoder(dtype, seed=seed % 1000).to(device)
    with torch.no_grad():
        poisoned.embed.weight[POISON] = float("nan")
    lp_clean, grad_clean = _run(clean, tree, r, entry, weights)
    lp, grad = _run(poisoned, tree, r, entry, weights)
    others = torch.arange(tree.num_sequences) != r
    assert torch.equal(lp[others], lp_clean[others]), "another rollout's logprobs changed"
    assert torch.isnan(lp[r, len(sequences[r]) - 2])  # r's logprob read at the poisoned token
    unused = sorted(set(range(grad.shape[0])) - set(sequences[r]))
    assert torch.equal(grad[unused], grad_clean[unused]), "an embedding gradient of a token r never uses changed"


@few
@given(batch=poisoned_batches(), seed=seeds(), entry=st.sampled_from(["reference", "tree_backward_reference"]))
def test_poisoned_rollout_is_isolated(batch, seed, entry):
    sequences, r = batch
    _check(sequences, r, entry, seed, torch.float64)


@pytest.mark.kernel
@settings(max_examples=max(2, settings.default.max_examples // 10))
@given(batch=poisoned_batches(), seed=seeds(), entry=st.sampled_from(["fast", "tree_backward_kernel"]))
def test_poisoned_rollout_is_isolated_kernel(batch, seed, entry):
    pytest.importorskip("triton")
    sequences, r = batch
    _check(sequences, r, entry, seed, torch.float32)
