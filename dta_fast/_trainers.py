"""What the trainer integrations (dta_fast.trl, dta_fast.verl) share."""

from __future__ import annotations

from dta_ref.losses import TokenLoss
from dta_ref.padded import PaddedLayout

from .logprobs import tree_logprobs_and_entropy
from .tree import build_tree


def block_logprobs_and_entropy(model, input_ids, attention_mask, first_column: int, temperature: float = 1.0):
    """Logprobs and entropies [B, L - first_column] of a padded batch's tokens from ``first_column`` on.

    One prefix tree of the rows, one packed forward; only the block's tokens
    are projected onto the vocabulary. Also returns the tree (its compression
    ratio is worth logging).
    """
    layout = PaddedLayout.of(attention_mask)
    tree = build_tree(layout.sequences(input_ids))
    block = attention_mask[:, first_column:].bool()
    wanted = layout.to_tree(block, first_column, fill=False)
    out = tree_logprobs_and_entropy(model, tree, temperature=temperature, mask=wanted)
    columns = input_ids.shape[1] - first_column
    return layout.from_tree(out.logprobs, first_column, columns), layout.from_tree(out.entropy, first_column, columns), tree


class LinearizedLoss(TokenLoss):
    """sum(weights * logprobs): a loss linearised at the current logprobs (weights = d loss / d logprob)."""

    def _term(self, seq, step, logprobs):
        return logprobs
