"""What the trainer integrations (dta_fast.trl, dta_fast.verl) share."""

from __future__ import annotations

import dta_ref
from dta_ref.losses import TokenLoss


def packed_logprobs_and_entropy(model, tree, temperature: float = 1.0):
    """Logprobs and entropies of a tree, one packed forward: the Triton kernel on CUDA, the explicit-mask reference elsewhere."""
    if dta_ref.adapt(model).device.type == "cuda":
        from .logprobs import tree_logprobs_and_entropy
    else:
        from dta_ref.logprobs import tree_logprobs_and_entropy
    return tree_logprobs_and_entropy(model, tree, temperature=temperature)


class LinearizedLoss(TokenLoss):
    """sum(weights * logprobs): a loss linearised at the current logprobs (weights = d loss / d logprob)."""

    def _term(self, seq, step, logprobs):
        return logprobs
