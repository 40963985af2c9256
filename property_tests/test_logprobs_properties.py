"""Tree logprobs and parameter gradients equal the per-sequence ones, for generated rollout sets.

- Reference decoder in float64: equal to ~1e-10 (it is pure float64).
- Reference decoder in float32: the tree's error against the float64 ground
  truth is at most a small multiple of the per-sequence run's error.
- Tiny Hugging Face models (Llama, Qwen2, Qwen3; eager and sdpa) in float64.
  transformers computes RMSNorm (and eager softmax) in float32 even in a
  float64 model, so: on a copy that computes in float64 throughout, tree ==
  flat to ~1e-10; on the model as built, the tree's error against that copy
  is at most a small multiple of the per-sequence run's error.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dta_ref
from dta_ref import PrefixTree
from property_tests.strategies import rollout_sets, seeds
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

NORMALIZATIONS = ("token_mean", "sequence_mean", "sum")

# The reference decoder is cheap: twice the profile's examples. Hugging Face
# models cost several times more per example: two fifths of them.
decoder_settings = settings(max_examples=2 * settings.default.max_examples)
hf_settings = settings(max_examples=max(2, 2 * settings.default.max_examples // 5))

_hf_models: dict[tuple[str, str], tuple[torch.nn.Module, torch.nn.Module]] = {}


def hf_models(family: str, impl: str):
    """The tiny float64 model as built with ``impl``, and its float64-throughout copy."""
    key = (family, impl)
    if key not in _hf_models:
        model = tiny_hf_model(family, torch.float64, impl, seed=0)
        _hf_models[key] = (model, hf_exact_float64_copy(model))
    return _hf_models[key]


def loss_inputs(base_logprobs: torch.Tensor, tree: PrefixTree, seed: int):
    """Random upstream weights, old logprobs near ``base_logprobs`` and per-sequence advantages.

    Log-ratios are drawn from |x| in [0, 0.1], [0.35, 0.6] or [1.3, 1.6] with a
    random sign: well inside or well outside the clip range [log 0.8, log 1.28]
    and the dual-clip bound log 3, never near a kink where float rounding could
    pick a different branch of the loss.
    """
    gen = torch.Generator().manual_seed(seed)
    N, L = base_logprobs.shape
    mask = tree.logprob_mask
    upstream = torch.randn(N, L, generator=gen, dtype=torch.float64) * mask
    lows = torch.tensor([0.0, 0.35, 1.3], dtype=torch.float64)
    band = torch.randint(0, 3, (N, L), generator=gen)
    magnitude = lows[band] + torch.rand(N, L, generator=gen, dtype=torch.float64) * torch.where(band == 0, 0.1, 0.25)
    sign = torch.randint(0, 2, (N, L), generator=gen).to(torch.float64) * 2 - 1
    old = (base_logprobs.detach().to(torch.float64) - sign * magnitude) * mask
    advantages = torch.randn(N, generator=gen, dtype=torch.float64)
    return upstream, old, advantages


def loss_functions(tree: PrefixTree, upstream, old, advantages, dtype):
    """name -> loss(logprobs): plain sum, randomly weighted sum, PG loss under every normalization."""
    mask = tree.logprob_mask
    up, old, adv = upstream.to(dtype), old.to(dtype), advantages.to(dtype)
    losses = {"sum": lambda lp: lp.sum(), "weighted_sum": lambda lp: (lp * up).sum()}
    for norm in NORMALIZATIONS:
        losses[f"pg_{norm}"] = lambda lp, norm=norm: dta_ref.policy_gradient_loss(
            lp, old, adv, mask, clip_low=0.2, clip_high=0.28, normalization=norm, dual_clip=3.0
        )
    return losses


def max_abs(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def all_grads(model, logprobs, losses) -> dict[str, dict[str, torch.Tensor]]:
    return {name: param_grads(model, fn(logprobs), retain_graph=True) for name, fn in losses.items()}


@decoder_settings
@given(sequences=rollout_sets(), seed=seeds())
def test_decoder_tree_logprobs_equal_flat_float64(sequences, seed):
    model = tiny_decoder(torch.float64, seed=seed % 1000)
    tree = PrefixTree.from_sequences(sequences)
    with torch.no_grad():
        tree_lp = dta_ref.tree_logprobs(model, tree)
        flat_lp = dta_ref.flat_logprobs(model, sequences)
    assert tree_lp.dtype == flat_lp.dtype == torch.float64
    assert_close_report(tree_lp, flat_lp, atol=1e-10, rtol=1e-10, name="tree vs flat logprobs")
    assert bool((tree_lp[~tree.logprob_mask] == 0).all()), "padding must be exactly 0"
    assert bool((tree_lp[tree.logprob_mask] < 0).all()), "a logprob over 64 tokens is negative"


@decoder_settings
@given(sequences=rollout_sets(), seed=seeds(), chunk_rows=st.integers(1, 8), data=st.data())
def test_masked_scoring_of_both_twins(sequences, seed, chunk_rows, data):
    """Packed hidden states to logprobs and entropies under any mask (True past a rollout's end too): both
    twins give, where the mask and the rollout have a logprob, the log-softmax of the head at the row of
    the rollout's token t for its token t+1, 0 elsewhere, and those entries' exact gradients."""
    import dta_fast

    tree = PrefixTree.from_sequences(sequences)
    shape = (tree.num_sequences, tree.max_length - 1)
    bits = data.draw(st.lists(st.booleans(), min_size=shape[0] * shape[1], max_size=shape[0] * shape[1]))
    mask = torch.tensor(bits, dtype=torch.bool).view(shape)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tree.num_tokens, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(8, 64, bias=False).double()
    weights = torch.randn((2,) + shape, generator=gen, dtype=torch.float64)
    want_lp, want_ent = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    for i, s in enumerate(sequences):  # by hand, entry by entry
        for t in range(len(s) - 1):
            if mask[i, t]:
                logp = torch.log_softmax(head(hidden[int(tree.seq_index[i, t])]), -1)
                want_lp[i, t], want_ent[i, t] = logp[s[t + 1]], -(logp.exp() * logp).sum()
    params = [hidden, head.weight]

    def grads(lp, ent):  # zeros for a parameter nothing depends on, as param_grads gives them
        total = (lp * weights[0] + ent * weights[1]).sum()
        got = torch.autograd.grad(total, params, allow_unused=True) if total.requires_grad else [None, None]
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, got)]

    want_g = grads(want_lp, want_ent)
    for name, twin in (
        ("dta_ref", dta_ref.gather_tree_logprobs),
        ("dta_fast", functools.partial(dta_fast.gather_logprobs_chunked, chunk_rows=chunk_rows)),
    ):
        got = twin(hidden, head, tree, entropy=True, mask=mask)
        assert_close_report(got.logprobs, want_lp, atol=1e-12, rtol=1e-12, name=f"{name} logprobs")
        assert_close_report(got.entropy, want_ent, atol=1e-12, rtol=1e-12, name=f"{name} entropies")
        kept = mask & tree.logprob_mask
        assert bool((got.logprobs[~kept] == 0).all() and (got.entropy[~kept] == 0).all()), name
        for g, w, what in zip(grads(got.logprobs, got.entropy), want_g, ("hidden", "head")):
            assert_close_report(g, w, atol=1e-12, rtol=1e-12, name=f"{name} {what} grad")


@decoder_settings
@given(sequences=rollout_sets(), seed=seeds())
def test_decoder_gradients_equal_flat_float64(sequences, seed):
    model = tiny_decoder(torch.float64, seed=seed % 1000)
    tree = PrefixTree.from_sequences(sequences)
    tree_lp = dta_ref.tree_logprobs(model, tree)
    flat_lp = dta_ref.flat_logprobs(model, sequences)
    losses = loss_functions(tree, *loss_inputs(flat_lp, tree, seed), torch.float64)
    for name, fn in losses.items():
        assert_close_report(fn(tree_lp), fn(flat_lp), atol=1e-12, rtol=1e-10, name=f"{name} value")
    tree_g = all_grads(model, tree_lp, losses)
    flat_g = all_grads(model, flat_lp, losses)
    for name in losses:
        assert_grads_close(tree_g[name], flat_g[name], rel=1e-10, name=f"{name} grad")


@decoder_settings
@given(sequences=rollout_sets(), seed=seeds())
def test_decoder_float32_tree_error_within_flat_error(sequences, seed):
    """err32(tree) <= 4 * err32(flat) + floor, both measured against the float64 run of the same weights.

    The floor, 32 float32 ulps of the largest true value, covers examples where
    the per-sequence run happens to round almost exactly; a wrong mask or a
    wrong target is off by orders of magnitude more.
    """
    model32 = tiny_decoder(torch.float32, seed=seed % 1000)
    model64 = copy.deepcopy(model32).to(torch.float64)
    tree = PrefixTree.from_sequences(sequences)

    truth_lp = dta_ref.flat_logprobs(model64, sequences)
    upstream, old, advantages = loss_inputs(truth_lp, tree, seed)
    truth_g = all_grads(model64, truth_lp, loss_functions(tree, upstream, old, advantages, torch.float64))

    losses32 = loss_functions(tree, upstream, old, advantages, torch.float32)
    tree_lp = dta_ref.tree_logprobs(model32, tree)
    flat_lp = dta_ref.flat_logprobs(model32, sequences)
    assert tree_lp.dtype == flat_lp.dtype == torch.float32
    check_against_truth("logprobs", tree_lp, flat_lp, truth_lp)
    tree_g = all_grads(model32, tree_lp, losses32)
    flat_g = all_grads(model32, flat_lp, losses32)
    for name in losses32:
        check_against_truth(f"{name} grad", tree_g[name], flat_g[name], truth_g[name])


def check_against_truth(label, tree_x, flat_x, truth_x):
    """err(tree) <= 4 * err(flat) + 32 float32 ulps of the largest true value (tensors or grad dicts)."""
    if isinstance(truth_x, dict):
        tree_x, flat_x, truth_x = flatten_grads(tree_x), flatten_grads(flat_x), flatten_grads(truth_x)
    floor = 32 * EPS32 * max_abs(truth_x.detach())
    assert_no_worse_than(tree_x, flat_x, truth_x, factor=4, floor=floor, name=label)


@pytest.mark.parametrize("impl", HF_ATTN_IMPLEMENTATIONS)
@pytest.mark.parametrize("family", HF_FAMILIES)
@hf_settings
@given(sequences=rollout_sets(), seed=seeds())
def test_hf_tree_equals_flat_float64(family, impl, sequences, seed):
    """Exact to ~1e-10 on a float64-throughout copy; as built, no worse than per-sequence against it."""
    model, exact = hf_models(family, impl)
    tree = PrefixTree.from_sequences(sequences)

    truth_lp = dta_ref.flat_logprobs(exact, sequences)
    exact_tree_lp = dta_ref.tree_logprobs(exact, tree)
    assert_close_report(exact_tree_lp, truth_lp, atol=1e-10, rtol=1e-10, name=f"{family} exact logprobs")
    losses = loss_functions(tree, *loss_inputs(truth_lp, tree, seed), torch.float64)
    truth_g = all_grads(exact, truth_lp, losses)
    exact_tree_g = all_grads(exact, exact_tree_lp, losses)
    for name in losses:
        assert_grads_close(exact_tree_g[name], truth_g[name], rel=1e-10, name=f"{family} exact {name} grad")

    tree_lp = dta_ref.tree_logprobs(model, tree)
    assert model.config._attn_implementation == impl, "the tree path must restore the attention implementation"
    flat_lp = dta_ref.flat_logprobs(model, sequences)
    check_against_truth(f"{family}-{impl} logprobs", tree_lp, flat_lp, truth_lp)
    tree_g = all_grads(model, tree_lp, losses)
    flat_g = all_grads(model, flat_lp, losses)
    for name in losses:
        # sanity: the exact copy is the same function (the float32 casts cost ~1e-5 relative, not more)
        assert_grads_close(flat_g[name], truth_g[name], rel=1e-3, name=f"{family}-{impl} flat {name} grad")
        check_against_truth(f"{family}-{impl} {name} grad", tree_g[name], flat_g[name], truth_g[name])


@decoder_settings
@given(
    seed=seeds(),
    n=st.integers(1, 30),
    pairs=st.integers(1, 50),
    chunk_rows=st.integers(1, 12),
    temperature=st.sampled_from([1.0, 0.6, 1.7]),
    entropy=st.booleans(),
)
def test_fused_head_matches_log_softmax(seed, n, pairs, chunk_rows, temperature, entropy):
    """The vocabulary head in windows (rows read by several pairs, any window size): logprobs, entropies
    and the gradients of the hidden states and of the weight equal a plain log_softmax's in float64."""
    from dta_fast.logprobs import rows_logprobs

    g = torch.Generator().manual_seed(seed)
    V, H = 37, 8
    head = torch.nn.Linear(H, V, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=torch.float64))
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64, requires_grad=True)
    rows = torch.randint(0, n, (pairs,), generator=g).sort().values
    targets = torch.randint(0, V, (pairs,), generator=g)
    got = rows_logprobs(hidden, head, rows, targets, chunk_rows=chunk_rows, temperature=temperature, entropy=entropy)
    logp = torch.log_softmax(head(hidden) / temperature, -1)
    want = logp[rows, targets]
    if entropy:
        want = torch.stack([want, -(logp.exp() * logp).sum(-1)[rows]])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    upstream = torch.randn(want.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((got * upstream).sum(), [hidden, head.weight])
    expected = torch.autograd.grad((want * upstream).sum(), [hidden, head.weight])
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@settings(max_examples=200, deadline=None)
@given(
    seed=seeds(),
    tokens=st.integers(0, 60),
    cuts=st.lists(st.integers(0, 60), max_size=6),
    reads=st.integers(0, 3),
    chunk_rows=st.integers(1, 9),
)
def test_head_rows_planned_for_all_chunks_equal_each_chunks_own(seed, tokens, cuts, reads, chunk_rows):
    """The head rows and windows the engine plans on the host for every chunk at once equal those each
    chunk would compute from its own pairs on the device (rows read by several pairs, rows no pair
    reads, chunks without pairs)."""
    import numpy as np

    from dta_fast.logprobs import HeadRows

    g = torch.Generator().manual_seed(seed)
    rows = torch.cat([torch.arange(tokens)] * reads + [torch.randint(0, max(tokens, 1), (tokens,), generator=g)])
    rows = rows[rows < tokens].sort().values
    starts = sorted({0, *(c for c in cuts if c < tokens)}) if tokens else [0]
    stops = starts[1:] + [tokens]
    bounds = np.searchsorted(rows.numpy(), starts).tolist() + [rows.numel()]
    planned = HeadRows.of_chunks(rows.numpy(), bounds, starts, chunk_rows, "cpu")
    assert len(planned) == len(starts)
    for c, (start, stop) in enumerate(zip(starts, stops)):
        own = HeadRows.of(rows[bounds[c] : bounds[c + 1]] - start, chunk_rows)
        assert torch.equal(planned[c].unique, own.unique) and torch.equal(planned[c].inverse, own.inverse)
        assert planned[c].windows == own.windows
        assert bool((planned[c].unique < stop - start).all())
