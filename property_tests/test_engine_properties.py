"""dta_fast.tree_backward equals per-sequence training for generated trees and chunk budgets."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import dta_fast
import dta_ref
from dta_fast.chunked import MemoryModel, plan_chunks
from dta_ref import PolicyGradientLoss, PrefixTree
from property_tests.strategies import rollout_sets, seeds
from tests.helpers import assert_grads_close, param_grads, tiny_decoder, tiny_hf_model
from tests.test_engine import check_plan

_decoders: dict[int, torch.nn.Module] = {}


def _model(seed):
    if seed not in _decoders:
        _decoders[seed] = tiny_decoder(torch.float64, seed=seed)
    return _decoders[seed]


@given(
    sequences=rollout_sets(max_sequences=8, max_len=14),
    chunk=st.one_of(st.none(), st.integers(1, 40)),
    recompute=st.booleans(),
    normalization=st.sampled_from(["token_mean", "sequence_mean", "sum"]),
    seed=seeds(),
)
def test_tree_backward_matches_flat(sequences, chunk, recompute, normalization, seed):
    model = _model(seed % 3)
    tree = PrefixTree.from_sequences(sequences)
    g = torch.Generator().manual_seed(seed)
    flat = dta_ref.flat_logprobs(model, sequences)
    old = flat.detach() + 0.3 * torch.randn(flat.shape, generator=g, dtype=torch.float64)
    adv = torch.randn(tree.num_sequences, generator=g, dtype=torch.float64)
    mask = tree.logprob_mask
    loss = dta_ref.policy_gradient_loss(flat, old, adv, mask, 0.2, 0.3, normalization)
    expected = param_grads(model, loss)

    # gradients are added to whatever .grad holds
    start = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = start[n].clone()
    lp, total = dta_fast.tree_backward(
        model,
        tree,
        PolicyGradientLoss(old, adv, mask, 0.2, 0.3, normalization),
        max_chunk_tokens=chunk,
        recompute=recompute,
    )
    got = {n: p.grad - start[n] for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    torch.testing.assert_close(lp, flat.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(total, loss.detach(), rtol=1e-12, atol=1e-13)
    assert_grads_close(got, expected, rel=1e-10)


@settings(max_examples=max(2, settings.default.max_examples // 5))
@given(
    sequences=rollout_sets(max_sequences=6, max_len=10),
    chunk=st.integers(1, 20),
    family=st.sampled_from(["llama", "qwen2", "qwen3"]),
)
def test_tree_backward_hf_matches_flat(sequences, chunk, family):
    model = tiny_hf_model(family, torch.float64, "sdpa")
    tree = PrefixTree.from_sequences(sequences)
    flat = dta_ref.flat_logprobs(model, sequences)
    expected = param_grads(model, dta_ref.sft_loss(flat, tree.logprob_mask, "sequence_mean"))
    lp, _ = dta_fast.tree_backward(
        model, tree, dta_ref.SFTLoss(tree.logprob_mask, "sequence_mean"), max_chunk_tokens=chunk
    )
    torch.testing.assert_close(lp, flat.detach(), rtol=0, atol=1e-6)
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, expected, rel=1e-6)


@given(sequences=rollout_sets(max_sequences=12, max_len=30), size=st.integers(1, 80), recompute=st.booleans())
def test_plan_prefix_is_the_path(sequences, size, recompute):
    """The plan's prefix pieces of every chunk are its first token's ancestors, in open chunks."""
    check_plan(PrefixTree.from_sequences(sequences), size, recompute)


@given(
    sequences=rollout_sets(max_sequences=12, max_len=30),
    recompute=st.booleans(),
    checkpoint=st.booleans(),
    seed=seeds(),
)
def test_memory_floor_bounds_every_plan(sequences, recompute, checkpoint, seed):
    """MemoryModel.floor_bytes, which lets chunk_tokens_for_budget refuse a budget without planning,
    is at most every chunk size's estimate, with checkpointed layers or without."""
    tree = PrefixTree.from_sequences(sequences)
    memory = MemoryModel.of(_model(seed % 3))  # gradients unset: the step creates them in its first backward
    if seed % 2:
        memory = dataclasses.replace(memory, new_grads=0)  # ... or set by an earlier step
    floor = memory.floor_bytes(int(tree.lengths.max()), recompute, checkpoint_layers=checkpoint)
    plans = (plan_chunks(tree, size, recompute, checkpoint_layers=checkpoint) for size in range(1, tree.num_tokens + 1))
    assert floor <= min(memory.step_bytes(plan) for plan in plans)


@given(
    sequences=rollout_sets(max_sequences=12, max_len=30),
    recompute=st.booleans(),
    seed=seeds(),
    pick=st.floats(0, 1),
    nudge=st.integers(-1, 1),
)
# nothing fits below 7 tokens: the search found 7 past its first guess (the whole forest), and stopped
# there without trying 8, which fits too
@example(sequences=[[0]] * 5 + [[0] * 7, [63, 0]], recompute=True, seed=0, pick=0.0, nudge=0)
def test_budget_search_finds_the_largest_fitting_size(sequences, recompute, seed, pick, nudge):
    """chunk_tokens_for_budget against every chunk size's estimate, for budgets at and around the
    estimates themselves: a size that fits where the next size up does not (the largest fitting size
    where the estimate grows with the size, which it does but for small steps), or a ValueError only
    when no size fits."""
    tree = PrefixTree.from_sequences(sequences)
    model = _model(seed % 3)
    estimates = [dta_fast.estimated_step_bytes(model, tree, size, recompute) for size in range(1, tree.num_tokens + 1)]
    budget = sorted(estimates)[round(pick * (len(estimates) - 1))] + nudge
    fitting = [size for size, estimate in enumerate(estimates, 1) if estimate <= budget]
    if not fitting:
        with pytest.raises(ValueError, match="too small"):
            dta_fast.chunk_tokens_for_budget(model, tree, budget, recompute)
    else:
        chosen = dta_fast.chunk_tokens_for_budget(model, tree, budget, recompute)
        assert chosen in fitting and (chosen == tree.num_tokens or chosen + 1 not in fitting)


@settings(max_examples=60, deadline=None)
@given(sequences=rollout_sets(max_sequences=8, max_len=14), size=st.integers(1, 30), recompute=st.booleans())
def test_exported_states_are_those_the_chunks_hand_on(sequences, size, recompute):
    """plan.exported_held, which the memory estimate charges a hybrid's recurrent states by: per chunk, the
    tokens of the open chunks (itself and those under it) with a child in a later chunk, as the engine's
    links find them, counted by brute force over the open chunks."""
    from dta_fast.chunked.linear import ChunkLinks

    tree = PrefixTree.from_sequences(sequences)
    plan = plan_chunks(tree, size, recompute)
    links = ChunkLinks(tree.parent.numpy(), plan.start, plan.stop)
    for c in range(plan.num_chunks):
        open_chunks = [u for u in range(c) if plan.max_end[u] > plan.start[c]] + [c]
        assert plan.exported_held[c] == sum(len(links.exports[u]) for u in open_chunks), c
