"""A critic's per-token values: each rollout alone, or one packed tree.

A PPO critic is a causal trunk with a one-output head: a Hugging Face token classifier with
``num_labels=1`` (``Qwen2ForTokenClassification``), or a causal LM with a value head beside it, passed as
``value_head=`` (a module mapping final hidden states [.., hidden] to [.., 1], as TRL and OpenRLHF
build them). Both functions return values [N, Lmax]: entry [i, t] is the value at token t of rollout i,
0 past its length. A token's value depends on its path only, so a shared prefix is computed once and
gathered per (sequence, position), and autograd sums its gradient over the rollouts that hold it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .adapter import adapt
from .linear_attention import CAUSAL
from .logprobs import packed_hidden
from .model import causal_attend
from .tree import PrefixTree, _as_token_list


def value_head_of(model, value_head=None) -> nn.Module:
    """The module giving one value per token: ``value_head`` where given, else the value model's own."""
    adapter = adapt(model)
    if value_head is not None:
        if not isinstance(value_head, nn.Module):
            raise TypeError(f"value_head must be a torch.nn.Module, got {type(value_head).__name__}")
        return value_head
    if adapter.value_head is None:
        raise TypeError(
            f"{type(adapter.core).__name__} has no value head: pass value_head= (the module mapping its final "
            "hidden states to one value per token), or a token classifier with num_labels=1"
        )
    return adapter.value_head


def token_values(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """[...] values from hidden states [..., hidden] through a one-output head."""
    out = head(hidden)
    if out.shape[-1:] != (1,):
        raise ValueError(f"the value head gives {out.shape[-1]} outputs per token, not one")
    return out[..., 0]


def gather_tree_values(hidden: torch.Tensor, head: nn.Module, tree: PrefixTree) -> torch.Tensor:
    """Per-rollout values [N, Lmax] from the packed hidden states [T, hidden] of ``tree``."""
    values = token_values(head, hidden)  # [T]
    index = tree.seq_index.to(values.device)
    return values[index.clamp(min=0)].masked_fill(index < 0, 0.0)


def tree_values(model, tree: PrefixTree, *, value_head=None) -> torch.Tensor:
    """Values of every rollout [N, Lmax] from one packed forward over the tree (explicit mask)."""
    head = value_head_of(model, value_head)
    hidden, tree, _ = packed_hidden(model, tree)
    return gather_tree_values(hidden, head, tree)


def flat_values(model, sequences, *, value_head=None) -> torch.Tensor:
    """Values of every rollout [N, Lmax], each run alone through the model's own forward (ground truth)."""
    if isinstance(sequences, PrefixTree):
        sequences = [sequences.sequence(i) for i in range(sequences.num_sequences)]
    if isinstance(sequences, (torch.Tensor, np.ndarray)) and sequences.ndim == 2:
        sequences = list(sequences)
    if not isinstance(sequences, (list, tuple)) or not sequences:
        raise TypeError("sequences must be a non-empty list of token sequences")
    adapter = adapt(model)
    head = value_head_of(model, value_head)
    seqs = [_as_token_list(s, i) for i, s in enumerate(sequences)]
    rows = []
    for s in seqs:
        ids = torch.tensor(s, device=adapter.device)[None]
        if not adapter.is_hf:
            positions = torch.arange(len(s), device=adapter.device)[None]
            hidden = adapter.hidden_states(ids, positions, causal_attend, linear=CAUSAL)
            values = token_values(head, hidden[0])
        elif value_head is None:  # a token classifier: its own forward, head included
            values = adapter.core(input_ids=ids).logits[0, :, 0]
        else:  # a causal LM and a value head beside it: the LM's own final hidden states
            out = adapter.core(input_ids=ids, output_hidden_states=True, use_cache=False)
            values = token_values(head, out.hidden_states[-1][0])
        rows.append(torch.nn.functional.pad(values, (0, max(map(len, seqs)) - len(s))))
    return torch.stack(rows)
