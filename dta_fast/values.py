"""A critic's per-token values from one packed forward with the tree kernel.

Same result as ``dta_ref.tree_values``, whose signature it extends with ``attention_impl``
(dta_fast.dispatch).
"""

from __future__ import annotations

import torch

from dta_ref.tree import PrefixTree
from dta_ref.values import gather_tree_values, value_head_of

from .logprobs import packed_hidden


def tree_values(model, tree: PrefixTree, *, value_head=None, attention_impl: str = "auto") -> torch.Tensor:
    """Values of every rollout [N, Lmax] from one packed forward (the tree kernel on CUDA): a token
    classifier with ``num_labels=1``, or a causal LM and the ``value_head`` beside it."""
    head = value_head_of(model, value_head)
    hidden, tree, _ = packed_hidden(model, tree, attention_impl)
    return gather_tree_values(hidden, head, tree)
