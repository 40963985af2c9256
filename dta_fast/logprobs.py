"""Packed tree logprobs with the Triton tree kernel.

Same signature and result as ``dta_ref.tree_logprobs``: one packed forward
over the whole forest, no T x T mask anywhere. The vocabulary projection runs
in row chunks under activation checkpointing, so at most one chunk of logits
is alive at a time, in the forward and in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from dta_ref.adapter import adapt
from dta_ref.logprobs import (
    LogprobsAndEntropy,
    check_temperature,
    entropy_of,
    logprob_dtype,
    next_token_targets,
    scaled_log_softmax,
)
from dta_ref.tree import PrefixTree

from .attention import build_schedule, tree_attention

LOGITS_CHUNK_ELEMENTS = 2**27  # logits per chunk: 512 MiB in float32


@dataclass
class LogprobPairs:
    """The (sequence, step) slots that hold a logprob, sorted by the packed row they read."""

    rows: torch.Tensor  # [P] packed index of seq_i[t]
    targets: torch.Tensor  # [P] token seq_i[t+1]
    seq: torch.Tensor  # [P] i
    step: torch.Tensor  # [P] t

    @classmethod
    def of(cls, tree: PrefixTree) -> "LogprobPairs":
        rows, targets, valid = next_token_targets(tree)
        seq, step = valid.nonzero(as_tuple=True)
        r = rows[seq, step]
        order = torch.argsort(r, stable=True)
        return cls(r[order], targets[seq, step][order], seq[order], step[order])

    def span(self, start: int, stop: int) -> slice:
        """The pairs whose row lies in [start, stop)."""
        bounds = torch.searchsorted(self.rows, torch.tensor([start, stop], device=self.rows.device)).tolist()
        return slice(bounds[0], bounds[1])


def _window_logprobs(hidden, head, local_rows, targets, temperature, entropy):
    logp = scaled_log_softmax(head(hidden), temperature)  # [rows, V]
    picked = logp[local_rows, targets]
    return torch.stack([picked, entropy_of(logp)[local_rows]]) if entropy else picked


def rows_logprobs(
    hidden: torch.Tensor, head, rows: torch.Tensor, targets: torch.Tensor, chunk_rows=None,
    temperature: float = 1.0, entropy: bool = False,
):  # fmt: skip
    """log p(targets[p] | hidden[rows[p]]) for ``rows`` sorted ascending ([2, P] with entropies, with ``entropy``).

    Every row's logits are computed once, however many (sequence, step) pairs
    read it (at a branch point several do), in windows of ``chunk_rows`` rows
    under activation checkpointing, so at most one window of logits is alive.
    """
    dtype = logprob_dtype(hidden.dtype)
    if rows.numel() == 0:
        return hidden.new_zeros((2, 0) if entropy else (0,), dtype=dtype)
    T = hidden.shape[0]
    if chunk_rows is None:
        chunk_rows = max(1, LOGITS_CHUNK_ELEMENTS // head.weight.shape[0])
    bounds = torch.arange(0, T + chunk_rows, chunk_rows, device=rows.device).clamp(max=T)
    pair_bounds = torch.searchsorted(rows, bounds).tolist()
    bounds = bounds.tolist()
    pieces = []
    for c in range(len(bounds) - 1):
        lo, hi = pair_bounds[c], pair_bounds[c + 1]
        if lo == hi:
            continue
        r0, r1 = bounds[c], bounds[c + 1]
        args = (hidden[r0:r1], head, rows[lo:hi] - r0, targets[lo:hi], temperature, entropy)
        if torch.is_grad_enabled() and hidden.requires_grad:
            pieces.append(checkpoint(_window_logprobs, *args, use_reentrant=False))
        else:
            pieces.append(_window_logprobs(*args))
    return torch.cat(pieces, dim=-1).to(dtype)


def gather_logprobs_chunked(
    hidden: torch.Tensor, head, tree: PrefixTree, chunk_rows: int | None = None,
    temperature: float = 1.0, entropy: bool = False,
):  # fmt: skip
    """Per-sequence logprobs [N, Lmax-1] from packed hidden states [T, hidden], in row windows.

    With ``entropy``, a :class:`dta_ref.logprobs.LogprobsAndEntropy` of both.
    """
    pairs = LogprobPairs.of(tree)
    values = rows_logprobs(hidden, head, pairs.rows, pairs.targets, chunk_rows, temperature, entropy)
    values = values if entropy else values[None]
    out = []
    for v in values:
        padded = torch.zeros(tree.num_sequences, tree.max_length - 1, dtype=v.dtype, device=hidden.device)
        if v.numel():
            padded = padded.index_put((pairs.seq, pairs.step), v)
        else:  # no next-token logprob at all: still return a tensor attached to the graph, as dta_ref does
            padded = padded + 0.0 * hidden.sum()
        out.append(padded)
    return LogprobsAndEntropy(*out) if entropy else out[0]


def _packed_hidden(model, tree: PrefixTree):
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"expected a PrefixTree, got {type(tree).__name__}")
    tree.validate()
    adapter = adapt(model)
    adapter.check_token_ids(tree.tokens)
    tree = tree.to(adapter.device)
    schedule = build_schedule(tree.subtree_end, validate=False)  # tree.validate() checked it

    def attend(layer_idx, q, k, v, scale):
        return tree_attention(q, k, v, scale=scale, schedule=schedule)

    return adapter.hidden_states(tree.tokens[None], tree.position_ids[None], attend)[0], adapter.head, tree


def tree_logprobs(model, tree: PrefixTree, *, temperature: float = 1.0) -> torch.Tensor:
    """Logprobs of every rollout [N, Lmax-1] from one packed forward with the Triton tree kernel."""
    temperature = check_temperature(temperature)
    hidden, head, tree = _packed_hidden(model, tree)
    return gather_logprobs_chunked(hidden, head, tree, temperature=temperature)


def tree_logprobs_and_entropy(model, tree: PrefixTree, *, temperature: float = 1.0) -> LogprobsAndEntropy:
    """:func:`tree_logprobs` and the entropy of every next-token distribution, from one packed forward."""
    temperature = check_temperature(temperature)
    hidden, head, tree = _packed_hidden(model, tree)
    return gather_logprobs_chunked(hidden, head, tree, temperature=temperature, entropy=True)
