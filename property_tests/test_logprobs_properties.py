"""Tree logprobs and parameter gradients equal the per-sequence ones, for generated rollout sets.

- Reference decoder in float64: equal to ~1e-10 (it is pure float64).
- Reference decoder in float32: the tree's error against the float64 ground
  truth is at most a small multiple of the per-sequence run's error.
- Tiny Hugging Face models (Llama, Qwen2, Qwen3; eager and sdpa) in float64:
  to float32 precision (HF_FLOAT64_REL_TOL, 64 float32 ulps relative), because
  transformers computes RMSNorm (and eager softmax) in float32 even in a
  float64 model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings

import dta_ref
from dta_ref import PrefixTree
from property_tests.strategies import rollout_sets, seeds
from tests.helpers import (
    HF_ATTN_IMPLEMENTATIONS,
    HF_FAMILIES,
    HF_FLOAT64_REL_TOL,
    assert_close_report,
    assert_grads_close,
    flatten_grads,
    param_grads,
    tiny_decoder,
    tiny_hf_model,
)

NORMALIZATIONS = ("token_mean", "sequence_mean", "sum")
EPS32 = torch.finfo(torch.float32).eps

# The reference decoder is cheap: twice the profile's examples. Hugging Face
# models cost several times more per example: two fifths of them.
decoder_settings = settings(max_examples=2 * settings.default.max_examples)
hf_settings = settings(max_examples=max(2, 2 * settings.default.max_examples // 5))

_hf_models: dict[tuple[str, str], torch.nn.Module] = {}


def hf_model(family: str, impl: str):
    key = (family, impl)
    if key not in _hf_models:
        _hf_models[key] = tiny_hf_model(family, torch.float64, impl, seed=0)
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
    """name -> loss(logprobs) for a weighted sum and the PG loss under every normalization."""
    mask = tree.logprob_mask
    up, old, adv = upstream.to(dtype), old.to(dtype), advantages.to(dtype)
    losses = {"weighted_sum": lambda lp: (lp * up).sum()}
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

    def check(label, tree_x, flat_x, truth_x):
        err_tree = max_abs(tree_x.double() - truth_x)
        err_flat = max_abs(flat_x.double() - truth_x)
        floor = 32 * EPS32 * max_abs(truth_x)
        assert err_tree <= 4 * err_flat + floor, (
            f"{label}: float32 tree error {err_tree:.3e} vs flat error {err_flat:.3e} (floor {floor:.3e})"
        )

    check("logprobs", tree_lp.detach(), flat_lp.detach(), truth_lp.detach())
    tree_g = all_grads(model32, tree_lp, losses32)
    flat_g = all_grads(model32, flat_lp, losses32)
    for name in losses32:
        check(f"{name} grad", flatten_grads(tree_g[name]), flatten_grads(flat_g[name]), flatten_grads(truth_g[name]))


@pytest.mark.parametrize("impl", HF_ATTN_IMPLEMENTATIONS)
@pytest.mark.parametrize("family", HF_FAMILIES)
@hf_settings
@given(sequences=rollout_sets(), seed=seeds())
def test_hf_tree_equals_flat_float64(family, impl, sequences, seed):
    model = hf_model(family, impl)
    tree = PrefixTree.from_sequences(sequences)
    tree_lp = dta_ref.tree_logprobs(model, tree)
    flat_lp = dta_ref.flat_logprobs(model, sequences)
    assert model.config._attn_implementation == impl, "the tree path must restore the attention implementation"
    tol = HF_FLOAT64_REL_TOL
    assert_close_report(tree_lp, flat_lp, atol=tol, rtol=tol, name=f"{family}-{impl} logprobs")
    losses = loss_functions(tree, *loss_inputs(flat_lp, tree, seed), torch.float64)
    tree_g = all_grads(model, tree_lp, losses)
    flat_g = all_grads(model, flat_lp, losses)
    for name in losses:
        assert_grads_close(tree_g[name], flat_g[name], rel=tol, name=f"{family}-{impl} {name} grad")
