"""Packed tree logprobs with the Triton tree kernel.

Same signature and result as ``dta_ref.tree_logprobs``: one packed forward
over the whole forest, no T x T mask anywhere. The vocabulary projection runs
in row chunks under activation checkpointing, so at most one chunk of logits
is alive at a time, in the forward and in the backward.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from dta_ref.logprobs import hidden_states, logprob_dtype, model_device, next_token_targets, output_head
from dta_ref.tree import PrefixTree

from .attention import build_schedule, tree_attention

LOGITS_CHUNK_ELEMENTS = 2**27  # logits per chunk: 512 MiB in float32


def _chunk_logprobs(hidden, head, local_rows, targets):
    logits = head(hidden)  # [rows, V]
    logp = torch.log_softmax(logits.to(logprob_dtype(logits.dtype)), dim=-1)
    return logp[local_rows, targets]


def gather_logprobs_chunked(hidden: torch.Tensor, head, tree: PrefixTree, chunk_rows: int | None = None):
    """Per-sequence logprobs [N, Lmax-1] from packed hidden states [T, hidden], in row chunks."""
    rows, targets, valid = next_token_targets(tree)
    N, width = rows.shape
    flat_pos = valid.flatten().nonzero().squeeze(1)  # (sequence, step) slots that hold a logprob
    pair_rows, pair_targets = rows.flatten()[flat_pos], targets.flatten()[flat_pos]
    order = torch.argsort(pair_rows, stable=True)
    pair_rows, pair_targets, flat_pos = pair_rows[order], pair_targets[order], flat_pos[order]

    T = hidden.shape[0]
    if chunk_rows is None:
        chunk_rows = max(1, LOGITS_CHUNK_ELEMENTS // head.weight.shape[0])
    bounds = torch.arange(0, T + chunk_rows, chunk_rows, device=hidden.device).clamp(max=T)
    pair_bounds = torch.searchsorted(pair_rows, bounds).tolist()
    bounds = bounds.tolist()
    pieces = []
    for c in range(len(bounds) - 1):
        lo, hi = pair_bounds[c], pair_bounds[c + 1]
        if lo == hi:
            continue
        r0, r1 = bounds[c], bounds[c + 1]
        args = (hidden[r0:r1], head, pair_rows[lo:hi] - r0, pair_targets[lo:hi])
        if torch.is_grad_enabled() and hidden.requires_grad:
            pieces.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(*args))
    dtype = logprob_dtype(hidden.dtype)
    out = torch.zeros(N * width, dtype=dtype, device=hidden.device)
    if pieces:
        out = out.index_put((flat_pos,), torch.cat(pieces).to(dtype))
    else:  # no next-token logprob at all: still return a tensor attached to the graph, as dta_ref does
        out = out + 0.0 * hidden.sum()
    return out.view(N, width)


def tree_logprobs(model, tree: PrefixTree) -> torch.Tensor:
    """Logprobs of every rollout [N, Lmax-1] from one packed forward with the Triton tree kernel."""
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"expected a PrefixTree, got {type(tree).__name__}")
    head = output_head(model)  # also rejects unsupported models
    tree = tree.to(model_device(model))
    schedule = build_schedule(tree.subtree_end)

    def attend(layer_idx, q, k, v, scale):
        return tree_attention(q, k, v, scale=scale, schedule=schedule)

    hidden = hidden_states(model, tree.tokens[None], tree.position_ids[None], attend)[0]
    return gather_logprobs_chunked(hidden, head, tree)
