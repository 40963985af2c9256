"""Rollouts: plain sampling and exact speculative sampling from a per-prompt tree cache.

Readable reference, in three modules:

- ``sampling``: :func:`sample` (plain autoregressive sampling, one forward
  over the whole context per token), the sampling distribution
  (:func:`sampling_probs`), the draws and the argument checks;
- ``cache``: :class:`RolloutCache` of earlier completions, the
  :class:`DraftTree` it proposes and the acceptance rule :func:`walk`;
- ``speculative``: :func:`speculative_sample`, which verifies each
  sequence's draft tree with one tree-masked forward per step, and
  :class:`SpeculativeRun`, the step loop it shares with dta_fast.

Both samplers draw their randomness the same way (one uniform per node whose
distribution is computed, in sequence order, inverse-CDF sampling), and
dta_fast's twins return the same tokens as these for the same generator. A
speculative run returns plain sampling's tokens only while no draft is ever
verified (a finished completion joins the cache mid-batch and drafts for its
siblings); its samples are always distributed as plain sampling's
(docs/rollout.md).
"""

from .cache import BOS, DraftBudget, Drafter, DraftTree, RolloutCache, Walk, walk
from .sampling import (
    Rollout,
    SamplingParams,
    check_int,
    check_sampling_args,
    context_logits,
    draw,
    progress_bar,
    refuse_nonfinite_draws,
    sample,
    sampling_probs,
    step_uniforms,
)
from .speculative import (
    SpeculativeRun,
    check_speculative_args,
    speculative_sample,
    tree_inputs,
)

__all__ = [
    "BOS",
    "DraftBudget",
    "DraftTree",
    "Drafter",
    "Rollout",
    "RolloutCache",
    "SamplingParams",
    "SpeculativeRun",
    "Walk",
    "check_int",
    "check_sampling_args",
    "check_speculative_args",
    "context_logits",
    "draw",
    "progress_bar",
    "refuse_nonfinite_draws",
    "sample",
    "sampling_probs",
    "speculative_sample",
    "step_uniforms",
    "tree_inputs",
    "walk",
]
