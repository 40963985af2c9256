"""Packed tree logprobs with the Triton tree kernel.

Same result as ``dta_ref.tree_logprobs``, whose signature it extends with ``attention_impl``
(dta_fast.dispatch): one packed forward
over the whole forest, no T x T mask anywhere. The vocabulary projection runs
in row chunks under activation checkpointing, so at most one chunk of logits
is alive at a time, in the forward and in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from dta_ref.adapter import adapt
from dta_ref.attention import refuse_create_graph
from dta_ref.checks import check_flag
from dta_ref.logprobs import (
    LogprobsAndEntropy,
    check_logprob_mask,
    check_packed_hidden,
    check_temperature,
    entropy_of,
    logprob_dtype,
    next_token_targets,
    scaled_log_softmax,
)
from dta_ref.multimodal import check_images
from dta_ref.tree import PrefixTree

from .dispatch import tree_attend, uses_kernel
from .linear_attention import TreeLinearMixing

LOGITS_CHUNK_ELEMENTS = 2**27  # logits per chunk: 512 MiB in float32


def head_weight(head) -> torch.Tensor:
    """The output head's [vocab, hidden] weight, which the fast path sizes its logits windows and its
    memory estimate by (dta_ref runs any head)."""
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(
            f"the output head must be a linear layer with a [vocab, hidden] weight on the fast path, got "
            f"{type(head).__name__}"
        )
    return weight


def window_rows(vocab: int) -> int:
    """Rows of the head's default logits window: LOGITS_CHUNK_ELEMENTS logits."""
    return max(1, LOGITS_CHUNK_ELEMENTS // vocab)


@dataclass
class LogprobPairs:
    """The (sequence, step) slots that hold a logprob (or a value, :meth:`of_values`), sorted by the
    packed row they read."""

    rows: torch.Tensor  # [P] packed index of seq_i[t]
    targets: torch.Tensor  # [P] token seq_i[t+1]
    seq: torch.Tensor  # [P] i
    step: torch.Tensor  # [P] t

    @classmethod
    def of(cls, tree: PrefixTree, mask: torch.Tensor | None = None) -> LogprobPairs:
        """Every (sequence, step) with a next-token logprob, or those where ``mask`` [N, Lmax-1] is True."""
        rows, targets, valid = next_token_targets(tree)
        if mask is not None:
            valid = valid & mask.to(valid.device)
        seq, step = valid.nonzero(as_tuple=True)
        r = rows[seq, step]
        order = torch.argsort(r, stable=True)
        return cls(r[order], targets[seq, step][order], seq[order], step[order])

    @classmethod
    def of_values(cls, tree: PrefixTree) -> LogprobPairs:
        """Every (sequence, step) with a value (a critic's output at each token): the row is the step's own
        token; ``targets`` are unused (0)."""
        valid = tree.seq_index >= 0
        seq, step = valid.nonzero(as_tuple=True)
        r = tree.seq_index[seq, step]
        order = torch.argsort(r, stable=True)
        return cls(r[order], torch.zeros_like(r), seq[order], step[order])

    def span(self, start: int, stop: int) -> slice:
        """The pairs whose row lies in [start, stop)."""
        bounds = torch.searchsorted(self.rows, torch.tensor([start, stop], device=self.rows.device)).tolist()
        return slice(bounds[0], bounds[1])


def _scaled_logits(hidden, weight, temperature):
    logits = (hidden @ weight.T).to(logprob_dtype(hidden.dtype))  # [rows, V]
    return logits.div_(temperature) if temperature != 1.0 else logits


class _Window(NamedTuple):
    """Rows ``rows[row_lo:row_hi]`` of the head's input and the (sequence, step) pairs
    ``[pair_lo, pair_hi)`` that read them: one window of logits."""

    row_lo: int
    row_hi: int
    pair_lo: int
    pair_hi: int


class _HeadLogprobs(torch.autograd.Function):
    """log_softmax(hidden[rows] @ weight.T / temperature) at the (row, target) pairs, window by window, and
    each row's entropy: one autograd node for every window of a call.

    Keeps no logits: the forward saves the rows' log-sum-exp (and entropy),
    the backward recomputes a window's logits once and forms
    d/dz = g_lp (onehot - p) - g_H p (log p + H) in place, a few passes over
    [rows, V] instead of autograd's dozen. The windows' weight gradients are
    summed into one buffer as they come (``addmm_``), so the backward holds
    one weight-sized gradient and one window, not a running sum beside each
    window's product (docs/chunked_execution.md, "Memory budget").
    ``rows`` [U] are the distinct rows read, ``inverse`` [P] each pair's place in them.
    """

    @staticmethod
    def forward(ctx, hidden, weight, rows, inverse, targets, windows, temperature: float, with_entropy: bool):
        lse, picked, entropy = [], [], []
        for u0, u1, lo, hi in windows:
            z = _scaled_logits(hidden[rows[u0:u1]], weight, temperature)  # [R, V], float32 for half precision
            inv = inverse[lo:hi] - u0
            if with_entropy:
                lse.append(torch.logsumexp(z, dim=-1))  # [R]
                picked.append(z[inv, targets[lo:hi]] - lse[-1][inv])
                logp = z.sub_(lse[-1][:, None])
                entropy.append(-(logp.exp() * logp).sum(-1))
            else:  # logsumexp in place: no second window of logits
                raw = z[inv, targets[lo:hi]]
                top = z.amax(-1)
                top = torch.where(top.isinf(), 0.0, top)  # as torch.logsumexp: an infinite max stays infinite
                lse.append(z.sub_(top[:, None]).exp_().sum(-1).log_().add_(top))
                picked.append(raw - lse[-1][inv])
            del z
        lse = torch.cat(lse)
        entropy = torch.cat(entropy) if with_entropy else None
        ctx.save_for_backward(hidden, weight, rows, inverse, targets, lse, entropy)
        ctx.windows, ctx.temperature = windows, temperature
        ctx.set_materialize_grads(False)
        return torch.cat(picked), entropy[inverse] if with_entropy else lse.new_zeros(0)

    @staticmethod
    def backward(ctx, g_picked, g_entropy):
        refuse_create_graph("the fused vocabulary head")  # it works in place on recomputed logits
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):  # as the forward ran
            return _HeadLogprobs._backward(ctx, g_picked, g_entropy)

    @staticmethod
    def _backward(ctx, g_picked, g_entropy):
        hidden, weight, rows, inverse, targets, lse, entropy = ctx.saved_tensors
        with_entropy = g_entropy is not None and entropy is not None
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        for u0, u1, lo, hi in ctx.windows:
            h = hidden[rows[u0:u1]]
            inv, tgt = inverse[lo:hi] - u0, targets[lo:hi]
            logp = _scaled_logits(h, weight, ctx.temperature).sub_(lse[u0:u1, None])  # [R, V]
            g_rows = torch.zeros(u1 - u0, dtype=logp.dtype, device=logp.device)
            if g_picked is not None:
                g_rows.index_add_(0, inv, g_picked[lo:hi].to(logp.dtype))
            if with_entropy:
                grad = logp.exp()  # p
                h_rows = torch.zeros_like(g_rows).index_add_(0, inv, g_entropy[lo:hi].to(logp.dtype))
                # dH/dz = -p (log p + H): fold into one factor with the -p g_lp term
                logp.add_(entropy[u0:u1, None]).mul_(h_rows[:, None]).add_(g_rows[:, None])
                grad.mul_(logp).neg_()
            else:
                grad = logp.exp_().mul_(-g_rows[:, None])  # in place: one float32 window, not two
            del logp
            if g_picked is not None:
                grad.index_put_((inv, tgt), g_picked[lo:hi].to(grad.dtype), accumulate=True)
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            grad = grad.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[rows[u0:u1]] = grad @ weight  # rows are distinct
            if ctx.needs_input_grad[1]:
                grad_weight = grad.T @ h if grad_weight is None else grad_weight.addmm_(grad.T, h)
            del grad  # before the next window's logits
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _fusable(head) -> bool:
    """A plain bias-free linear head with an ordinary weight (not a sharded DTensor, not a LoRA layer)."""
    return (
        type(head) is torch.nn.Linear and head.bias is None and type(head.weight) in (torch.Tensor, torch.nn.Parameter)
    )


def _runs_as_linear(head) -> bool:
    """``head(x)`` is ``x @ weight.T``: no forward of its own (TRL's cast_lm_head_to_fp32 sets one, in
    float32) and no hooks, which a fused head computing from the weight would skip."""
    return "forward" not in vars(head) and not (head._forward_hooks or head._forward_pre_hooks)


def _window_logprobs(hidden, head, inverse, targets, temperature, entropy):
    logp = scaled_log_softmax(head(hidden), temperature)  # [rows, V]
    picked = logp[inverse, targets]
    return picked, entropy_of(logp)[inverse] if entropy else picked.new_zeros(0)


class HeadRows(NamedTuple):
    """What one call of the head reads: the distinct rows (``unique`` [U], ascending), each (sequence,
    step) pair's place among them (``inverse`` [P]), and the windows over both."""

    unique: torch.Tensor
    inverse: torch.Tensor
    windows: list[_Window]

    @classmethod
    def of(cls, rows: torch.Tensor, chunk_rows: int) -> HeadRows:
        """From ``rows`` [P] sorted ascending, on their device (it waits for the GPU: the window bounds
        are read back)."""
        unique, inverse = torch.unique_consecutive(rows, return_inverse=True)
        num = unique.numel()
        if num > 1 and not bool((unique[1:] > unique[:-1]).all()):
            # the head's backward writes each window's rows' gradients in place: a row twice would lose one
            raise ValueError("rows must be sorted ascending")
        chunk_rows = min(chunk_rows, max(num, 1))  # no window is larger than all rows (sys.maxsize: one window)
        bounds = torch.arange(0, num + chunk_rows, chunk_rows, device=rows.device).clamp(max=num)
        return cls(unique, inverse, _windows(bounds.tolist(), torch.searchsorted(inverse, bounds).tolist()))

    @classmethod
    def of_chunks(
        cls, rows: np.ndarray, bounds: list[int], offsets: list[int], chunk_rows: int, device
    ) -> list[HeadRows]:
        """Those of the calls of a chunked pass, planned on the host: ``rows`` [P] sorted, call c reads
        the pairs ``bounds[c]:bounds[c + 1]`` (``bounds`` from 0 to P) with rows counted from
        ``offsets[c]``; no row is read by two calls. One copy to ``device`` for all of them, so the calls
        read nothing back."""
        starts, sizes = np.asarray(bounds[:-1], dtype=np.int64), np.diff(bounds)
        is_new = np.ones(rows.size, dtype=bool)
        is_new[1:] = rows[1:] != rows[:-1]
        place = np.cumsum(is_new) - 1  # each pair's row among all distinct rows
        # each call's first distinct row (a call without pairs: any, it takes none)
        first = place[np.minimum(starts, rows.size - 1)] if rows.size else np.zeros(sizes.size, dtype=np.int64)
        unique_all = torch.from_numpy(rows[is_new] - np.repeat(offsets, sizes)[is_new]).to(device)
        inverse_host = place - np.repeat(first, sizes)
        inverse_all = torch.from_numpy(inverse_host).to(device)
        out = []
        for c, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            inverse = inverse_host[lo:hi]
            u = int(inverse[-1]) + 1 if hi > lo else 0
            window_bounds = list(range(0, u, chunk_rows)) + [u]
            pair_bounds = np.searchsorted(inverse, window_bounds).tolist()
            unique = unique_all[first[c] : first[c] + u] if hi > lo else unique_all[:0]
            out.append(cls(unique, inverse_all[lo:hi], _windows(window_bounds, pair_bounds)))
        return out


def _windows(bounds: list[int], pair_bounds: list[int]) -> list[_Window]:
    return [_Window(*bounds[c : c + 2], *pair_bounds[c : c + 2]) for c in range(len(bounds) - 1)]


def rows_logprobs(
    hidden: torch.Tensor,
    head,
    rows: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows=None,
    temperature: float = 1.0,
    entropy: bool = False,
):
    """log p(targets[p] | hidden[rows[p]]) for ``rows`` sorted ascending ([2, P] with entropies, with ``entropy``).

    Only the rows some pair reads are projected, each once however many
    (sequence, step) pairs read it (at a branch point several do), in windows
    of ``chunk_rows`` rows, so at most one window of logits is alive in the
    forward and in the backward.
    """
    if chunk_rows is None:
        chunk_rows = window_rows(head_weight(head).shape[0])
    return head_logprobs(hidden, head, HeadRows.of(rows, chunk_rows), targets, temperature, entropy)


def head_logprobs(
    hidden: torch.Tensor,
    head,
    head_rows: HeadRows,
    targets: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
):
    """:func:`rows_logprobs` with the rows and windows given (:class:`HeadRows`)."""
    dtype = logprob_dtype(hidden.dtype)
    unique, inverse, windows = head_rows
    if inverse.numel() == 0:
        out = hidden.new_zeros((2, 0) if entropy else (0,), dtype=dtype)
        # attached to the graph, as dta_ref's is: a zero gradient for the hidden states and the head, not None
        for x in (hidden, *(head.parameters() if isinstance(head, torch.nn.Module) else ())):
            out = out + 0.0 * x.sum() if torch.is_grad_enabled() and x.requires_grad else out
        return out
    if _fusable(head) and _runs_as_linear(head):
        # in the weight's dtype, autocast or not: the backward recomputes the logits as the forward made them
        with torch.autocast(hidden.device.type, enabled=False):
            out, ent = _HeadLogprobs.apply(hidden, head.weight, unique, inverse, targets, windows, temperature, entropy)
        return (torch.stack([out, ent]) if entropy else out).to(dtype)
    # a window's logits are recomputed in the backward rather than kept, whenever there is one: also
    # when only the head trains (the hidden states then need no gradient)
    trains = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    picked, entropies = [], []
    for u0, u1, lo, hi in windows:
        args = (hidden[unique[u0:u1]], head, inverse[lo:hi] - u0, targets[lo:hi], temperature, entropy)
        lp, ent = checkpoint(_window_logprobs, *args, use_reentrant=False) if trains else _window_logprobs(*args)
        picked.append(lp)
        entropies.append(ent)
    out = torch.cat(picked)
    return (torch.stack([out, torch.cat(entropies)]) if entropy else out).to(dtype)


def gather_logprobs_chunked(
    hidden: torch.Tensor,
    head,
    tree: PrefixTree,
    chunk_rows: int | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    mask: torch.Tensor | None = None,
    vocab_head=None,
):
    """Per-sequence logprobs [N, Lmax-1] from packed hidden states [T, hidden], in row windows.

    With ``entropy``, a :class:`dta_ref.logprobs.LogprobsAndEntropy` of both;
    with ``mask``, only the masked-in entries are computed (0 elsewhere).
    ``vocab_head(hidden_rows, weight, targets, temperature)``, when given and
    the head is a plain linear map, computes the (logprob, entropy) of each
    (sequence, step) from its row instead (a trainer's own fused kernel).
    """
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"tree must be a PrefixTree, got {type(tree).__name__}")
    tree.validate()  # free for a tree from the builders
    check_packed_hidden(hidden, tree)
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, (int, np.integer))):
        raise TypeError(f"chunk_rows must be an int or None, got {type(chunk_rows).__name__}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    chunk_rows = None if chunk_rows is None else int(chunk_rows)
    temperature, mask = check_temperature(temperature), check_logprob_mask(mask, tree)
    pairs = LogprobPairs.of(tree, mask)
    if vocab_head is not None and _fusable(head):
        values = torch.stack(vocab_head(hidden[pairs.rows], head.weight, pairs.targets, temperature))
        values = values.to(logprob_dtype(hidden.dtype))[: 2 if entropy else 1]
        values = values if entropy else values[0]
    else:
        values = rows_logprobs(hidden, head, pairs.rows, pairs.targets, chunk_rows, temperature, entropy)
    values = values if entropy else values[None]
    out = []
    for v in values:
        padded = torch.zeros(tree.num_sequences, tree.max_length - 1, dtype=v.dtype, device=hidden.device)
        out.append(padded.index_put((pairs.seq, pairs.step), v))
    return LogprobsAndEntropy(*out) if entropy else out[0]


def packed_hidden(
    model, tree: PrefixTree, attention_impl: str = "auto", router_aux_loss: bool = False, images=None
):  # fmt: skip
    """The last hidden states [T, hidden] of the packed forest from one forward, the tree on the model's
    device, and the router auxiliary loss over the rollouts (or None); ``images`` as in dta_ref's."""
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"expected a PrefixTree, got {type(tree).__name__}")
    tree.validate()
    adapter = adapt(model)
    images = check_images(images, tree, adapter.device)
    kernel = uses_kernel(adapter.device, attention_impl)
    adapter.check_token_ids(tree.tokens)
    tree = tree.to(adapter.device)
    attend = tree_attend(tree.subtree_end, tree.num_tokens, kernel, tree.position_ids)  # tree.validate() checked it
    out = adapter.hidden_states(
        tree.tokens[None], tree.position_ids[None], attend, output_router_logits=router_aux_loss,
        linear=TreeLinearMixing(tree.parent), images=images,
    )  # fmt: skip
    if not router_aux_loss:
        return out[0], tree, None
    return out[0][0], tree, adapter.router_aux_loss(out[1], tree.multiplicity)


def tree_logprobs(
    model, tree: PrefixTree, *, temperature: float = 1.0, mask=None, images=None, attention_impl: str = "auto"
):  # fmt: skip
    """Logprobs of every rollout [N, Lmax-1] from one packed forward (the tree kernel on CUDA)."""
    temperature, mask = check_temperature(temperature), check_logprob_mask(mask, tree)
    head = adapt(model).head  # before the forward: a value model has none
    hidden, tree, _ = packed_hidden(model, tree, attention_impl, images=images)
    return gather_logprobs_chunked(hidden, head, tree, temperature=temperature, mask=mask)


def tree_logprobs_and_entropy(
    model, tree: PrefixTree, *, temperature: float = 1.0, mask=None, router_aux_loss: bool = False,
    images=None, attention_impl: str = "auto",
) -> LogprobsAndEntropy:  # fmt: skip
    """:func:`tree_logprobs` and the entropy of every next-token distribution, from one packed forward;
    ``router_aux_loss`` as ``dta_ref.tree_logprobs_and_entropy`` says."""
    temperature, mask = check_temperature(temperature), check_logprob_mask(mask, tree)
    head = adapt(model).head
    hidden, tree, aux = packed_hidden(
        model, tree, attention_impl, check_flag("router_aux_loss", router_aux_loss), images
    )  # fmt: skip
    out = gather_logprobs_chunked(hidden, head, tree, temperature=temperature, entropy=True, mask=mask)
    out.aux_loss = aux
    return out
