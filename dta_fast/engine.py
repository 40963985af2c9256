"""Depth-first chunked execution: exact gradients with memory bounded by the path.

The preorder forest is cut into chunks of at most ``max_chunk_tokens``
consecutive packed tokens, visited in order (depth-first). The keys that a
chunk [a, b) attends outside itself are exactly the ancestors of its first
token a (docs/chunked_execution.md), so per layer we keep the K/V of the
chunks that still have unfinished descendants (a stack) and give a chunk its
ancestors' K/V as a cached prefix (``tree_attention`` with Tq < Tk).

A chunk is *open* from its forward until every chunk holding a descendant of
its tokens has run its backward; then it *closes*: its backward runs, seeded
with the loss on its own logprobs and with the dK/dV its descendants left on
its K/V, and it adds its own prefix dK/dV onto the chunks below it. Closing
is last-in first-out, so every gradient a chunk needs has arrived when it
closes. With ``recompute`` a chunk keeps only its K/V while open and redoes
its forward at close (memory ~ path K/V + one chunk's activations), unless
it holds all its descendants and so closes before any other forward: that
one keeps its graph. Without ``recompute`` every chunk keeps its autograd
graph (no second forward, memory ~ the open chunks' activations).

The loss is a sum of per-sequence terms ``loss_fn(i, logprobs_i)``. A
:class:`dta_ref.losses.TokenLoss` (the clipped policy-gradient and SFT
adapters) is a sum of per-token terms, so each chunk backpropagates its own
tokens' terms directly. Any other ``loss_fn`` is linearised exactly: a first
forward pass computes every logprob, autograd gives d loss / d logprob per
token, and the chunked pass backpropagates ``sum(g * logprob)``, which has
the same parameter gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dta_ref.attention import attention, mask_from_subtree_end
from dta_ref.logprobs import (
    check_token_ids,
    hidden_states,
    logprob_dtype,
    model_device,
    output_head,
)
from dta_ref.losses import TokenLoss
from dta_ref.tree import PrefixTree

from .attention import build_schedule, tree_attention
from .logprobs import LOGITS_CHUNK_ELEMENTS, LogprobPairs, rows_logprobs


@dataclass
class _Chunk:
    start: int
    stop: int
    max_end: int  # one past the last token below any of its tokens
    keys: list = field(default_factory=list)  # per layer [1, Hkv, n, D], detached
    values: list = field(default_factory=list)
    dkeys: list = field(default_factory=list)  # per layer float32 accumulators, or None
    dvalues: list = field(default_factory=list)
    graph: dict | None = None  # kept autograd state when not recomputing


class _Engine:
    def __init__(self, model, tree, attention_impl, recompute):
        self.model, self.tree = model, tree
        self.head = output_head(model)
        self.subtree_end = tree.subtree_end
        self.pairs = LogprobPairs.of(tree)
        self.attention_impl = attention_impl
        self.recompute = recompute

    # ---------------------------------------------------------------- forward

    def forward_chunk(self, chunk: _Chunk, below: list[_Chunk], grad: bool):
        """Run one chunk with its ancestors' K/V as prefix.

        Returns the logprobs of its (sequence, step) pairs and their span, its
        per-layer K/V, the prefix K/V leaves (with ``grad``) and which tokens
        of which open chunks the prefix holds.
        """
        a, b = chunk.start, chunk.stop
        end = self.subtree_end
        # the ancestors of token a: tokens of open chunks whose subtree reaches past a
        selections = [(c, (end[c.start : c.stop] > a).nonzero().squeeze(1)) for c in below]
        selections = [(c, sel) for c, sel in selections if sel.numel()]
        prefix_pos = [c.start + sel for c, sel in selections]
        prefix_pos = torch.cat(prefix_pos) if prefix_pos else end.new_zeros(0)
        P = prefix_pos.numel()
        key_end = torch.cat([end[prefix_pos], end[a:b]]).clamp(max=b) - a + P  # local key coordinates

        prefix_leaves: list = []
        if self.attention_impl == "kernel":
            schedule = build_schedule(key_end, b - a, validate=False)
        else:
            mask = mask_from_subtree_end(key_end, torch.arange(P, P + b - a, device=key_end.device))
        chunk_k: dict[int, torch.Tensor] = {}
        chunk_v: dict[int, torch.Tensor] = {}

        def attend(layer, q, k, v, scale):
            if selections:
                pk = torch.cat([c.keys[layer][:, :, sel] for c, sel in selections], dim=2)
                pv = torch.cat([c.values[layer][:, :, sel] for c, sel in selections], dim=2)
                if grad:
                    pk, pv = pk.requires_grad_(True), pv.requires_grad_(True)
                    prefix_leaves.append((layer, pk, pv))
                k_all, v_all = torch.cat([pk.to(k.dtype), k], dim=2), torch.cat([pv.to(v.dtype), v], dim=2)
            else:
                k_all, v_all = k, v
            chunk_k[layer], chunk_v[layer] = k, v
            if self.attention_impl == "kernel":
                return tree_attention(q, k_all, v_all, scale=scale, schedule=schedule)
            return attention(q, k_all, v_all, mask, scale)

        with torch.set_grad_enabled(grad):
            ids = self.tree.tokens[a:b][None]
            hidden = hidden_states(self.model, ids, self.tree.position_ids[a:b][None], attend)[0]
            span = self.pairs.span(a, b)
            logprobs = rows_logprobs(hidden, self.head, self.pairs.rows[span] - a, self.pairs.targets[span])
        layers = sorted(chunk_k)
        ks, vs = [chunk_k[i] for i in layers], [chunk_v[i] for i in layers]
        return logprobs, span, ks, vs, prefix_leaves, selections

    # --------------------------------------------------------------- backward

    def close(self, chunk: _Chunk, below: list[_Chunk], seed):
        """Backward of a chunk whose descendants are all done."""
        if chunk.graph is None:
            logprobs, span, ks, vs, leaves, selections = self.forward_chunk(chunk, below, grad=True)
        else:
            g = chunk.graph
            logprobs, span, ks, vs, leaves, selections = (
                g["logprobs"], g["span"], g["ks"], g["vs"], g["leaves"], g["selections"],
            )  # fmt: skip
            chunk.graph = None
        tensors, grads = [], []
        if logprobs.numel() and logprobs.requires_grad:
            tensors.append(seed(span, logprobs))
            grads.append(torch.ones_like(tensors[-1]))
        for outs, accs in ((ks, chunk.dkeys), (vs, chunk.dvalues)):
            for out, acc in zip(outs, accs):
                if acc is not None and out.requires_grad:
                    tensors.append(out)
                    grads.append(acc.to(out.dtype))
        if tensors:
            torch.autograd.backward(tensors, grads)
        # pass the prefix gradients down to the chunks that own those keys
        for layer, pk, pv in leaves:
            offset = 0
            for c, sel in selections:
                n = sel.numel()
                for grad_full, accs, store in ((pk.grad, c.dkeys, c.keys), (pv.grad, c.dvalues, c.values)):
                    if grad_full is None:
                        continue
                    if accs[layer] is None:  # at least float32, whatever the model's precision
                        acc_dtype = torch.promote_types(store[layer].dtype, torch.float32)
                        accs[layer] = torch.zeros(store[layer].shape, dtype=acc_dtype, device=store[layer].device)
                    accs[layer].index_add_(2, sel, grad_full[:, :, offset : offset + n].to(accs[layer].dtype))
                offset += n
        chunk.keys = chunk.values = chunk.dkeys = chunk.dvalues = []  # free

    def run(self, chunks: list[tuple[int, int]], seed, out_logprobs):
        open_chunks: list[_Chunk] = []
        end = self.subtree_end
        for a, b in chunks:
            while open_chunks and open_chunks[-1].max_end <= a:
                done = open_chunks.pop()
                self.close(done, open_chunks, seed)
            chunk = _Chunk(a, b, int(end[a:b].max()))
            # a chunk holding all its descendants closes before the next forward: keeping its graph
            # costs no more memory than recomputing it would, and saves the second forward
            keep_graph = not self.recompute or chunk.max_end <= b
            logprobs, span, ks, vs, leaves, selections = self.forward_chunk(chunk, open_chunks, grad=keep_graph)
            out_logprobs[self.pairs.seq[span], self.pairs.step[span]] = logprobs.detach().to(out_logprobs.dtype)
            chunk.keys = [k.detach() for k in ks]
            chunk.values = [v.detach() for v in vs]
            chunk.dkeys = [None] * len(ks)
            chunk.dvalues = [None] * len(vs)
            if keep_graph:
                chunk.graph = dict(logprobs=logprobs, span=span, ks=ks, vs=vs, leaves=leaves, selections=selections)
            open_chunks.append(chunk)
        while open_chunks:
            done = open_chunks.pop()
            self.close(done, open_chunks, seed)

    def forward_only(self, chunks, out_logprobs):
        """Every logprob, no gradients: the first pass for a loss that is not a TokenLoss."""
        open_chunks: list[_Chunk] = []
        end = self.subtree_end
        for a, b in chunks:
            while open_chunks and open_chunks[-1].max_end <= a:
                open_chunks.pop()
            chunk = _Chunk(a, b, int(end[a:b].max()))
            logprobs, span, ks, vs, _, _ = self.forward_chunk(chunk, open_chunks, grad=False)
            out_logprobs[self.pairs.seq[span], self.pairs.step[span]] = logprobs.to(out_logprobs.dtype)
            chunk.keys, chunk.values = ks, vs
            open_chunks.append(chunk)


def _shape(model):
    """(layers, hidden, heads, kv_heads, head_dim, intermediate, bytes per element) of a decoder."""
    cfg = model.config
    hidden = cfg.hidden_size
    layers = getattr(cfg, "num_layers", None) or cfg.num_hidden_layers
    heads = getattr(cfg, "num_heads", None) or cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_kv_heads", None) or getattr(cfg, "num_key_value_heads", heads)
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    return layers, hidden, heads, kv_heads, head_dim, cfg.intermediate_size, next(model.parameters()).element_size()


def activation_bytes_per_token(model) -> int:
    """Estimated bytes autograd saves per packed token for one forward + backward (all layers).

    Per layer: two RMSNorms over the hidden size (each a float32 copy of its
    input and its output), the inputs of the attention and MLP projections,
    the queries and attention output, the chunk's own K/V, four MLP
    intermediates, and the query/key norms' float32 copies where the model
    has them (Qwen3).
    """
    layers, hidden, heads, kv_heads, head_dim, inter, size = _shape(model)
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = 2 * hidden * (4 + size) + 2 * hidden * size + 2 * q * size + 2 * kv * size + 4 * inter * size
    if getattr(model.config, "model_type", "") == "qwen3":
        per_layer += (q + kv) * (4 + size)
    return layers * per_layer + 4 * hidden * size


def kv_bytes_per_token(model) -> int:
    """K/V kept per token of an open chunk, with its float32 gradient accumulators."""
    layers, _, _, kv_heads, head_dim, _, size = _shape(model)
    return layers * 2 * kv_heads * head_dim * (size + 4)


def _prefix_bytes_per_token(model) -> int:
    """What a chunk's graph saves per prefix token: the gathered K/V and its concatenation with the chunk's."""
    layers, _, _, kv_heads, head_dim, _, size = _shape(model)
    return layers * 2 * kv_heads * head_dim * size * 2


LOGITS_WORKSPACE_BYTES = 3 * LOGITS_CHUNK_ELEMENTS * 4  # a float32 window of logits, its softmax and gradient


@dataclass
class _ChunkPlan:
    chunks: list  # (start, stop) of each chunk, in order
    held: int  # most tokens of open chunks at once, the running one included
    prefix_recompute: int  # largest prefix (tokens of the open chunks under) of any chunk
    prefix_keep: int  # most prefix tokens saved by the graphs of the open chunks at once


def _plan(tree: PrefixTree, size: int, recompute: bool = False) -> _ChunkPlan:
    """Consecutive chunks of at most ``size`` tokens that never hold an older chunk open.

    A chunk stays open until the last token below any of its tokens (its
    ``max_end``), and the engine closes chunks last-in first-out, so a chunk
    whose ``max_end`` reached past that of the chunk under it would keep that
    chunk, and transitively everything before, open for longer than its own
    tokens need (say, a chunk running from the end of one branch into a long
    sibling branch). So a chunk runs on as long as its ``max_end`` stays within
    the ``max_end`` of the open chunk under it: the open chunks' ``max_end``
    never increases up the stack, each holds an ancestor of the current token,
    and a chunk may still cross from one branch into the next where the chunk
    under it is open anyway.

    With ``recompute`` the chunks that stay open across others pay a second
    forward, so chunk ends move to where that costs least: back to the last
    point where the chunk would close at once (all its descendants inside),
    if that keeps at least half of it; otherwise, when the chunk starts with
    tokens whose subtrees run past it (a shared prompt), to just after the
    deepest branch point among them, so that mostly shared prefixes stay
    open and are recomputed.
    """
    T = tree.num_tokens
    end = tree.subtree_end.cpu().numpy()
    plan = _ChunkPlan([], 0, 0, 0)
    stack, held, saved, a = [], 0, 0, 0  # stack: (max_end, tokens, prefix tokens) of the open chunks
    while a < T:
        while stack and stack[-1][0] <= a:
            _, tokens, prefix = stack.pop()
            held, saved = held - tokens, saved - prefix
        limit = stack[-1][0] if stack else T
        window = end[a : a + size]
        # end[a] <= limit: the chunk under holds a's parent, whose subtree contains a's
        over = (window > limit).nonzero()[0]
        n = int(over[0]) if over.size else window.size
        if recompute and a + n < T:
            n = _recompute_friendly_length(end, a, n)
        b = a + n
        plan.chunks.append((a, b))
        stack.append((int(end[a:b].max()), b - a, held))
        plan.prefix_recompute = max(plan.prefix_recompute, held)
        held, saved = held + b - a, saved + held
        plan.held, plan.prefix_keep = max(plan.held, held), max(plan.prefix_keep, saved)
        a = b
    return plan


def _recompute_friendly_length(end: np.ndarray, a: int, n: int) -> int:
    """Length, at most ``n``, of a chunk starting at ``a`` in recompute mode (see :func:`_plan`)."""
    ends = end[a : a + n]
    closes_at_once = np.flatnonzero(np.maximum.accumulate(ends) <= a + 1 + np.arange(n))
    close = int(closes_at_once[-1]) + 1 if closes_at_once.size else 0
    if 2 * close >= n:  # closing at once keeps at least half the chunk (or all of it)
        return close
    inside = np.flatnonzero(ends <= a + n)
    run = int(inside[0]) if inside.size else n  # leading tokens whose subtrees run past the chunk
    if run == 0:
        return close or n
    # end the long-lived part after its deepest branch point: later tokens start one branch, which
    # the next chunk may then hold whole
    t = np.arange(a, a + run)
    branching = np.flatnonzero(end[np.minimum(t + 1, len(end) - 1)] < end[t])
    return int(branching[-1]) + 1 if branching.size else run


def _chunks(tree: PrefixTree, size: int, recompute: bool = False) -> list[tuple[int, int]]:
    return _plan(tree, size, recompute).chunks


def estimated_step_bytes(model, tree: PrefixTree, chunk_tokens: int, recompute: bool = True) -> int:
    """Estimated activation memory of tree_backward with chunks of ``chunk_tokens``.

    Counts what the step allocates beyond the model's parameters, gradients
    and optimizer state: the vocabulary projection workspace, the K/V (with
    float32 gradient accumulators) of every open chunk, and what autograd
    saves: with ``recompute``, the running chunk's activations and its copies
    of the prefix K/V; without, those of every open chunk. The open chunks are
    those of the actual chunking at their worst moment.
    benchmarks/bench_training.py measures the real peak.
    """
    plan = _plan(tree, chunk_tokens, recompute)
    if recompute:
        activations, prefix = max(b - a for a, b in plan.chunks), plan.prefix_recompute
    else:
        activations, prefix = plan.held, plan.prefix_keep
    return (
        LOGITS_WORKSPACE_BYTES
        + kv_bytes_per_token(model) * plan.held
        + _prefix_bytes_per_token(model) * prefix
        + activation_bytes_per_token(model) * activations
    )


def chunk_tokens_for_budget(model, tree: PrefixTree, memory_budget_bytes: int, recompute: bool = True) -> int:
    """Largest chunk size whose :func:`estimated_step_bytes` fits the budget.

    The estimate grows with the chunk size, except that keeping graphs of many
    tiny chunks saves a prefix copy per chunk, so it also grows as chunks
    shrink. Search powers of two for the largest size that fits, then bisect
    up to the next.
    """
    T = tree.num_tokens

    def fits(size):
        return estimated_step_bytes(model, tree, size, recompute) <= memory_budget_bytes

    sizes = [min(2**i, T) for i in range(T.bit_length() + 1)]
    fitting = [size for size in sizes if fits(size)]
    if not fitting:
        best = min(estimated_step_bytes(model, tree, size, recompute) for size in sizes)
        raise ValueError(
            f"memory budget of {memory_budget_bytes / 2**30:.3f} GiB is too small: the smallest estimate over "
            f"chunk sizes is {best / 2**30:.3f} GiB (the open chunks' K/V, the logits workspace and "
            f"{activation_bytes_per_token(model) / 2**20:.2f} MiB of activations per chunk token"
            + ("" if recompute else "; try recompute=True") + ")"
        )
    lo, hi = fitting[-1], min(2 * fitting[-1], T + 1) - 1  # fits(lo); sizes above hi do not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def tree_backward(
    model,
    tree: PrefixTree,
    loss_fn,
    *,
    max_chunk_tokens: int | None = None,
    memory_budget_bytes: int | None = None,
    recompute: bool | None = None,
    attention_impl: str = "auto",
):
    """Forward and backward over the whole forest, depth-first in chunks; gradients added to ``.grad``.

    ``loss_fn(i, logprobs_i)`` returns sequence i's scalar loss term; the total
    loss is their sum. Pass ``dta_ref.PolicyGradientLoss`` / ``dta_ref.SFTLoss``
    for the losses of dta_ref (one pass), or any callable (two passes).

    ``max_chunk_tokens``: chunk size in packed tokens (None: the whole forest
    as one chunk). ``memory_budget_bytes``: choose the chunk size from an
    activation-memory budget instead: the largest whose
    :func:`estimated_step_bytes` fits.
    ``recompute``: redo each chunk's forward at its backward, so memory is
    the open chunks' K/V plus one chunk's activations; without it the open
    chunks keep their graphs (no second forward; activations of every open
    chunk). Default: on when chunked; with a budget, off when keeping graphs
    fits chunks of 8192 tokens or half the size that recomputing fits.
    ``attention_impl``: "kernel" (Triton), "reference" (explicit mask, any
    dtype, for CPU tests) or "auto" (kernel on CUDA, reference elsewhere).

    Returns ``(logprobs, loss)``: detached per-sequence logprobs [N, Lmax-1]
    (the layout of ``tree_logprobs``) and the detached total loss.
    """
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"expected a PrefixTree, got {type(tree).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(i, logprobs_i), got {type(loss_fn).__name__}")
    output_head(model)  # rejects unsupported models with a clear error
    check_token_ids(model, tree.tokens)
    if max_chunk_tokens is not None and memory_budget_bytes is not None:
        raise ValueError("give max_chunk_tokens or memory_budget_bytes, not both")
    if memory_budget_bytes is not None:
        if isinstance(memory_budget_bytes, bool) or not isinstance(memory_budget_bytes, (int, float)):
            raise TypeError(f"memory_budget_bytes must be a number, got {type(memory_budget_bytes).__name__}")
        budget = int(memory_budget_bytes)
        if recompute is None:
            # keeping the graphs saves a second forward per chunk (a third of the step); measured, that
            # outweighs more, smaller chunks while they hold 8K tokens or half the recompute size
            size_recompute = chunk_tokens_for_budget(model, tree, budget, recompute=True)
            try:
                size_keep = chunk_tokens_for_budget(model, tree, budget, recompute=False)
            except ValueError:
                size_keep = 0
            recompute = size_keep < min(size_recompute / 2, 8192)
            max_chunk_tokens = size_recompute if recompute else size_keep
        else:
            max_chunk_tokens = chunk_tokens_for_budget(model, tree, budget, recompute=bool(recompute))
    if max_chunk_tokens is not None:
        if isinstance(max_chunk_tokens, bool) or not isinstance(max_chunk_tokens, int):
            raise TypeError(f"max_chunk_tokens must be an int, got {type(max_chunk_tokens).__name__}")
        if max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be at least 1 token, got {max_chunk_tokens}")
    if attention_impl not in ("auto", "kernel", "reference"):
        raise ValueError(f"attention_impl must be 'auto', 'kernel' or 'reference', got {attention_impl!r}")

    device = model_device(model)
    tree = tree.to(device)
    if attention_impl == "auto":
        attention_impl = "kernel" if device.type == "cuda" else "reference"
    T = tree.num_tokens
    size = T if max_chunk_tokens is None else min(max_chunk_tokens, T)
    chunks = _chunks(tree, size)
    if recompute is None:
        recompute = len(chunks) > 1
    if recompute:
        chunks = _chunks(tree, size, recompute=True)
    engine = _Engine(model, tree, attention_impl, recompute)
    pairs = engine.pairs
    dtype = logprob_dtype(next(model.parameters()).dtype)
    N, width = tree.num_sequences, tree.max_length - 1
    logprobs = torch.zeros(N, width, dtype=dtype, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)

    if isinstance(loss_fn, TokenLoss):
        if loss_fn.shape != (N, width):
            raise ValueError(f"loss_fn was built for logprobs of shape {loss_fn.shape}, the tree has {(N, width)}")
        loss_fn = loss_fn.to(device)  # once, not at every chunk

        def seed(span, chunk_logprobs):
            nonlocal total
            terms = loss_fn.terms(pairs.seq[span], pairs.step[span], chunk_logprobs).sum()
            total = total + terms.detach().double()
            return terms

    else:
        engine.forward_only(chunks, logprobs)
        g = torch.zeros_like(logprobs)
        for i in range(N):
            n = int(tree.lengths[i]) - 1
            lp_i = logprobs[i, :n].detach().clone().requires_grad_(True)
            term = loss_fn(i, lp_i)
            if not isinstance(term, torch.Tensor) or term.numel() != 1:
                raise ValueError(
                    f"loss_fn must return a scalar tensor; for sequence {i} it returned "
                    f"{type(term).__name__} {tuple(getattr(term, 'shape', ()))}"
                )
            total = total + term.detach().double().reshape(())
            if term.requires_grad:
                (g_i,) = torch.autograd.grad(term.reshape(()), lp_i, allow_unused=True)
                if g_i is not None:
                    g[i, :n] = g_i

        def seed(span, chunk_logprobs):
            return (g[pairs.seq[span], pairs.step[span]].to(chunk_logprobs.dtype) * chunk_logprobs).sum()

    engine.run(chunks, seed, logprobs)
    for p in model.parameters():  # like loss.backward() on a loss that touches every parameter
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    return logprobs, total.to(dtype)
