"""Depth-first chunked execution: exact gradients with memory bounded by the path.

The preorder forest is cut into chunks of consecutive packed tokens, visited
in order (depth-first). A chunk's keys outside itself are exactly the
ancestors of its first token, which live in the chunks still *open* (with
unfinished descendants); a chunk closes when all of them are done: its
backward runs, seeded by its loss terms and by the dK/dV its descendants left
on its K/V. docs/chunked_execution.md derives all of it.

Three parts, read in order:

- :class:`ChunkPlan` (:func:`plan_chunks`): the chunking of a forest and
  every per-chunk fact, built once per step with array operations: each
  chunk's bounds and subtree end, the order of forwards and closes, the
  pieces of open chunks that form its cached prefix, its logprob span, and
  what is alive at its worst moment, which :class:`MemoryModel` turns into
  :func:`estimated_step_bytes`.
- :class:`_Engine`: a loop over the plan's steps. Attention reaches the
  stored K/V through an autograd Function (:class:`_AttendedKV`) that
  reads and writes the chunks' gradient accumulators when autograd runs
  it, so the engine stays exact when a layer's forward runs twice
  (gradient checkpointing).
- :func:`tree_backward`: checks its arguments, picks the plan (given chunk
  size, memory budget, or on CUDA the device's free memory), runs the loss.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from dta_ref.attention import as_float, attention, mask_from_subtree_end
from dta_ref.adapter import adapt
from dta_ref.logprobs import check_temperature, logprob_dtype
from dta_ref.losses import TokenLoss
from dta_ref.tree import PrefixTree

from .attention import build_schedule, tree_attention
from .logprobs import HeadRows, LogprobPairs, head_logprobs, head_weight, window_rows

# ------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class _Forest:
    """The size-independent arrays of a forest that planning reads (CPU, int64)."""

    end: np.ndarray  # [T] subtree_end
    depth: np.ndarray  # [T] position_ids: the number of ancestors
    parent: np.ndarray  # [T] -1 at a root
    run_start: np.ndarray  # [T] first token of the parent-child chain ending at i

    @classmethod
    def of(cls, tree: PrefixTree) -> "_Forest":
        parent = tree.parent.cpu().numpy().astype(np.int64, copy=False)
        index = np.arange(parent.size, dtype=np.int64)
        chain_break = parent != index - 1
        if parent.size:
            chain_break[0] = True
        run_start = np.maximum.accumulate(np.where(chain_break, index, 0)) if parent.size else index
        return cls(
            tree.subtree_end.cpu().numpy().astype(np.int64, copy=False),
            tree.position_ids.cpu().numpy().astype(np.int64, copy=False),
            parent,
            run_start,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.end.size)

    @cached_property
    def neg_end(self) -> np.ndarray:
        """-end: non-decreasing along a parent-child chain, for searchsorted."""
        return -self.end


class Step(NamedTuple):
    """One move of the engine: run chunk ``chunk``'s forward, or close it (its backward). A named tuple:
    a plan of small chunks makes thousands."""

    chunk: int
    forward: bool


@dataclass(frozen=True)
class PrefixPiece:
    """Tokens ``[lo, hi)`` of open chunk ``owner`` (chunk-local positions): part of a cached prefix."""

    owner: int
    lo: int
    hi: int


@dataclass
class ChunkPlan:
    """The chunking of one forest and every per-chunk fact the engine and the estimate read.

    Arrays are indexed by chunk, in forward order. ``held``, ``saved`` and
    ``graded`` are taken when the chunk closes; the open chunks are then the
    chunk and everything under it, as right after its forward.
    """

    size: int  # the chunk-size limit it was built with
    recompute: bool
    start: np.ndarray  # [C] first packed token
    stop: np.ndarray  # [C] one past the last
    max_end: np.ndarray  # [C] one past the last token below any of its tokens
    prefix_tokens: np.ndarray  # [C] cached prefix length: the ancestors of its first token
    held: np.ndarray  # [C] tokens of the open chunks, its own included
    saved: np.ndarray  # [C] prefix tokens of the open chunks, its own included
    graded: np.ndarray  # [C] tokens of the open chunks holding gradient accumulators (a descendant has closed)
    first_close: int  # the chunk whose backward runs first: no parameter gradient exists before it
    keeps_graph: np.ndarray  # [C] bool: its forward keeps the autograd graph until it closes
    steps: list[Step]  # forwards and closes, in order
    # chunk c's prefix pieces are piece_*[piece_ptr[c] : piece_ptr[c + 1]] (None: planned without)
    piece_ptr: np.ndarray | None  # [C + 1]
    piece_owner: np.ndarray | None
    piece_lo: np.ndarray | None  # chunk-local
    piece_hi: np.ndarray | None
    logits_rows: int | None = None  # rows of the vocabulary head's logits window (None: the default)
    checkpoint_layers: bool = False  # every layer runs under activation checkpointing (ours or the model's)

    @property
    def num_chunks(self) -> int:
        return int(self.start.size)

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """(start, stop) of every chunk."""
        return list(zip(self.start.tolist(), self.stop.tolist()))

    @property
    def lengths(self) -> np.ndarray:
        return self.stop - self.start

    @property
    def recomputed_tokens(self) -> int:
        """Tokens whose forward runs twice: those of chunks that stay open across others."""
        return int(self.lengths[~self.keeps_graph].sum())

    def prefix(self, c: int) -> list[PrefixPiece]:
        """Chunk ``c``'s cached prefix, ancestors in packed order."""
        lo, hi = self.piece_ptr[c], self.piece_ptr[c + 1]
        return [
            PrefixPiece(o, a, b)
            for o, a, b in zip(
                self.piece_owner[lo:hi].tolist(), self.piece_lo[lo:hi].tolist(), self.piece_hi[lo:hi].tolist()
            )
        ]


_PIECE_FIELDS = ("piece_ptr", "piece_owner", "piece_lo", "piece_hi")  # ChunkPlan's prefix pieces


def plan_chunks(
    tree: PrefixTree | _Forest, size: int, recompute: bool = False, with_prefix: bool = True,
    logits_rows: int | None = None, checkpoint_layers: bool = False,
) -> ChunkPlan:  # fmt: skip
    """Chunks of at most ``size`` tokens and their facts (docs/chunked_execution.md, "Where chunks stop").

    A chunk runs on while its tokens' subtrees stay within the ``max_end``
    of the open chunk under it, so open chunks never hold older ones open
    longer than their own tokens need. With ``recompute``, chunks that stay
    open pay a second forward, so chunk ends move where that costs least
    (:func:`_recompute_friendly_length`).
    """
    forest = tree if isinstance(tree, _Forest) else _Forest.of(tree)
    facts = _chunk_bounds(forest, size, recompute)  # start, stop, max_end, held, saved, graded, steps, ...
    start, stop = facts["start"], facts["stop"]
    plan = ChunkPlan(
        size=size,
        recompute=recompute,
        prefix_tokens=forest.depth[start],
        keeps_graph=(facts["max_end"] <= stop) | (not recompute),
        **facts,
        **dict.fromkeys(_PIECE_FIELDS),
        logits_rows=logits_rows,
        checkpoint_layers=checkpoint_layers,
    )
    return _with_prefix(forest, plan) if with_prefix else plan


def _with_prefix(forest: _Forest, plan: ChunkPlan) -> ChunkPlan:
    """``plan`` with its prefix pieces (the engine needs them; the memory estimate does not)."""
    if plan.piece_ptr is not None:
        return plan
    pieces = _prefix_pieces(forest, plan.start, plan.stop)
    return replace(plan, **dict(zip(_PIECE_FIELDS, pieces)))


_plan = plan_chunks  # benchmarks/tune_attention.py imports it under this name


def _chunk_bounds(forest: _Forest, size: int, recompute: bool):
    """The chunk bounds, the open-stack facts and the steps (ChunkPlan's fields of those names): one
    pass, one short loop per chunk."""
    depth, T = forest.depth, forest.num_tokens
    starts, stops, max_ends, helds, saveds, gradeds, steps = [], [], [], [], [], [], []
    prefixes = []  # the prefix length of every chunk
    stack: list[int] = []  # open chunks
    held = saved = graded = a = 0
    first_close = None
    while a < T:
        while stack and max_ends[stack[-1]] <= a:
            done = stack.pop()
            held, saved = held - (stops[done] - starts[done]), saved - prefixes[done]
            # its backward sent dK/dV to every open chunk: they all hold ancestors of its first token
            graded = held
            first_close = done if first_close is None else first_close
            steps.append(Step(done, forward=False))
        # the chunk under holds a token whose subtree ends at ``limit``; a <= i < limit lies in that
        # subtree, so end[i] <= limit: the chunk may run to limit, and no further
        limit = max_ends[stack[-1]] if stack else T
        n = min(size, limit - a)
        if recompute and a + n < T:
            n = _recompute_friendly_length(forest, a, n)
        b = a + n
        c = len(starts)
        max_end = _max_end(forest, a, b)
        starts.append(a), stops.append(b), max_ends.append(max_end), prefixes.append(int(depth[a]))
        held, saved = held + n, saved + prefixes[c]
        # when it closes, its descendants (if any) have closed and graded it and everything under it
        helds.append(held), saveds.append(saved), gradeds.append(held if max_end > b else graded)
        stack.append(c)
        steps.append(Step(c, forward=True))
        a = b
    steps.extend(Step(done, forward=False) for done in reversed(stack))
    arrays = dict(start=starts, stop=stops, max_end=max_ends, held=helds, saved=saveds, graded=gradeds)
    facts = {name: np.array(values, dtype=np.int64) for name, values in arrays.items()}
    return facts | dict(steps=steps, first_close=first_close if first_close is not None else (stack or [0])[-1])


def _recompute_friendly_length(forest: _Forest, a: int, n: int) -> int:
    """Length, at most ``n``, of a chunk starting at ``a`` in recompute mode (``a + n`` < T).

    Back to the last point where the chunk would close at once (all its
    descendants inside), if there is one; else the chunk starts with
    ancestors of token ``a + n`` (a shared prompt): to just after the last
    of them that branches, so that mostly shared prefixes stay open and are
    recomputed, and the next chunk may hold one branch whole.

    A chunk [a, p) closes at once when no token in it is an ancestor of p,
    that is when p's parent is before a. Those p are end[a], end[end[a]],
    ...: each jump passes a subtree whole. Constant work per chunk but for
    long jump chains (many small subtrees) and a chunk of one chain.
    """
    end, parent, run_start = forest.end, forest.parent, forest.run_start
    x = a + n
    p = int(end[a])
    if p <= x:
        for _ in range(_JUMPS):
            q = int(end[p])
            if q > x:
                return p - a
            p = q
        # many small subtrees: the last p <= x whose parent is before a
        later = np.flatnonzero(parent[p + 1 : x + 1] < a)
        return p + (int(later[-1]) + 1 if later.size else 0) - a
    # a is an ancestor of x; the chunk's leading tokens are x's ancestors down to the last one in a's
    # parent-child chain (found run by run). It branches there, unless that is x's parent.
    cur = int(parent[x])
    while run_start[cur] > a:
        cur = int(parent[run_start[cur]])
    if cur + 1 < x:
        return cur + 1 - a
    # all n tokens are x's ancestors, a chain, along which subtree ends do not grow: end after its last
    # token with a second child, the last before the ends reach x's own
    last = int(forest.neg_end[a : x + 1].searchsorted(-end[x]))
    return last if last else n


def _max_end(forest: _Forest, a: int, b: int) -> int:
    """One past the last token below any token of [a, b): the end of the chunk's first ancestor of b,
    if it has one (tokens whose subtrees run past b are ancestors of b), else b."""
    end, parent, run_start = forest.end, forest.parent, forest.run_start
    if b == end.size or parent[b] < a:
        return b
    cur = int(parent[b])
    for _ in range(_JUMPS):
        top = int(run_start[cur])
        if top <= a:
            return int(end[a])
        if parent[top] < a:
            return int(end[top])
        cur = int(parent[top])
    return int(end[a:b].max())


_JUMPS = 16  # jumps tried one at a time before a scan


def _prefix_pieces(forest: _Forest, start: np.ndarray, stop: np.ndarray):
    """Every chunk's cached prefix as pieces of open chunks, for all chunks at once.

    The ancestors of a token form a few runs of consecutive packed positions
    (a chain of first children is consecutive in preorder); walk up run by
    run for every chunk start together, then cut the runs at chunk bounds.
    """
    C = start.size
    chunk_of, run_lo, run_hi = [], [], []
    active = np.flatnonzero(forest.parent[start] >= 0) if C else np.zeros(0, dtype=np.int64)
    cur = forest.parent[start[active]]  # deepest ancestor not yet taken
    while active.size:
        lo = forest.run_start[cur]
        chunk_of.append(active), run_lo.append(lo), run_hi.append(cur + 1)
        cur = forest.parent[lo]
        more = cur >= 0
        active, cur = active[more], cur[more]
    if not chunk_of:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros(C + 1, dtype=np.int64), empty, empty, empty
    chunk_of, run_lo, run_hi = np.concatenate(chunk_of), np.concatenate(run_lo), np.concatenate(run_hi)
    first = np.searchsorted(stop, run_lo, side="right")  # chunk holding each run's first token
    last = np.searchsorted(stop, run_hi - 1, side="right")
    count = last - first + 1
    run = np.repeat(np.arange(count.size), count)
    owner = first[run] + np.arange(run.size) - np.repeat(np.cumsum(count) - count, count)
    lo = np.maximum(run_lo[run], start[owner])
    hi = np.minimum(run_hi[run], stop[owner])
    order = np.lexsort((lo, chunk_of[run]))  # by chunk, then packed order
    chunk, owner, lo, hi = chunk_of[run][order], owner[order], lo[order], hi[order]
    ptr = np.zeros(C + 1, dtype=np.int64)
    np.cumsum(np.bincount(chunk, minlength=C), out=ptr[1:])
    return ptr, owner, lo - start[owner], hi - start[owner]


# ----------------------------------------------------------- memory estimate


@dataclass(frozen=True)
class MemoryModel:
    """What a step keeps alive beyond the weights and their gradients: bytes per token from the model's
    shape, and the vocabulary head's transients (docs/chunked_execution.md, "Memory budget")."""

    activation: int  # what autograd saves per chunk token, all layers
    kv: int  # one token's K/V, all layers
    kv_grad: int  # its gradient accumulators (at least float32)
    head_row: int  # the head's backward, per row of its logits window
    head_weight: int  # ... and beside the window: the weight-sized gradient the windows add into
    logits_rows: int  # rows of the default window (a plan may run a smaller one)
    closing: int  # the end of a chunk's backward: the embedding's weight-sized gradients
    new_grads: int = 0  # parameter gradients the step creates: none exists yet when its first backward starts
    # with every layer under activation checkpointing (docs/chunked_execution.md, "Checkpointed layers"):
    checkpointed: int = 0  # what a chunk's graph keeps per token: each layer's input
    layer: int = 0  # one layer's activations and backward temporaries per token, while its backward recomputes it
    layer_kv: int = 0  # one layer's K/V per token: its copies for attention live as long
    model_checkpoints: bool = False  # the model checkpoints every layer itself (plans can only be so)

    @classmethod
    def of(cls, model) -> "MemoryModel":
        adapter = adapt(model)
        shape, weight = adapter.shape, head_weight(adapter.head)
        vocab, w = weight.shape[0], weight.element_size()
        W = weight.numel() * w
        z = torch.finfo(logprob_dtype(weight.dtype)).bits // 8
        # a window's backward: its float32 gradient, formed in place of its log-probabilities, and the
        # gradient's cast (z + w per logit), beside the one buffer the windows' weight gradients are
        # summed into (W)
        cast = w if w != z else 0
        kv, size = shape.layers * 2 * shape.kv_heads * shape.head_dim, shape.bytes_per_element
        layer, trunk, own = _layer_bytes_per_token(shape), _trunk_bytes_per_token(shape), adapter.checkpointed_layers
        checkpointed = shape.layers * shape.hidden * size + trunk + 2 * shape.head_dim * size  # + RoPE's cos, sin
        return cls(
            # 2% over the closed form: autograd saved 0.2-1.6% more at six measured shapes
            activation=((shape.layers - own) * layer + own * shape.hidden * size + trunk) * 51 // 50,
            kv=kv * size,
            kv_grad=kv * max(size, 4),
            head_row=(z + cast) * vocab,
            head_weight=W,
            logits_rows=window_rows(vocab),
            closing=2 * W,
            new_grads=_unset_grad_bytes(model),
            checkpointed=checkpointed * 51 // 50,
            # ... and its backward's temporaries: about three MLP-intermediate-sized gradients
            layer=(layer + 3 * shape.intermediate * size) * 51 // 50,
            layer_kv=kv * size // shape.layers,
            model_checkpoints=own == shape.layers,
        )

    def head(self, logits_rows: int | None = None) -> int:
        """The head's backward with a full window of ``logits_rows`` rows (None: the default)."""
        return self.head_row * (logits_rows or self.logits_rows) + self.head_weight

    def step_bytes(self, plan: ChunkPlan) -> int:
        """The largest, over chunks, of what is alive when the chunk's backward starts (the head's) or ends.

        Its graph holds its K/V copies: the concatenation of prefix and own K/V and the copy of its
        value rows that isolation makes (P + L tokens). With recompute, the graph is the running
        chunk's, and a chunk that stays open holds its own K/V twice (from its first forward, and in
        the recomputed graph); without, every open chunk keeps its graph. The head's window holds at
        most the chunk's rows.
        """
        if plan.num_chunks == 0:
            return self.head_weight
        L, P = plan.lengths, plan.prefix_tokens
        head = self.head_row * np.minimum(L, plan.logits_rows or self.logits_rows) + self.head_weight
        if plan.checkpoint_layers:
            # the graphs keep each layer's input. After the head's backward, a layer's activations and
            # K/V copies (P + L tokens) live while its backward recomputes it, beside the head's
            # weight-sized gradient (held until the tied embedding's joins it, or the embedding's own
            # comes). In the step's first backward the parameter gradients appear layer by layer: at
            # the last layer most exist and most inputs are gone, so the inputs count only where they
            # outweigh the gradients still missing.
            inputs = self.checkpointed * (L if plan.recompute else plan.held)
            heads = inputs + head
            layers = inputs + self.head_weight
            heads[plan.first_close] -= self.new_grads
            layers[plan.first_close] = max(layers[plan.first_close] - self.new_grads, 0)
            alive = self.kv * plan.held + np.maximum(heads, layers + self.layer * L + self.layer_kv * (P + L))
        elif plan.recompute:
            alive = self.activation * L + self.kv * (plan.held - L * plan.keeps_graph + P + L)
        else:
            alive = self.activation * plan.held + self.kv * (plan.held + plan.saved)
        if not plan.checkpoint_layers:
            alive = alive + head
            alive[plan.first_close] -= self.new_grads
        alive = alive + self.kv_grad * plan.graded
        # the end of its backward: the open chunks' K/V, the accumulators it filled (those of every open
        # chunk under it, when it has a prefix) or found, and the embedding's gradients
        graded = np.where(P > 0, np.maximum(plan.graded, plan.held - L), plan.graded)
        ending = self.kv * plan.held + self.kv_grad * graded + self.closing
        return int(max(alive.max(), ending.max()))

    def floor_bytes(
        self, path: int, recompute: bool, logits_rows: int | None = None, checkpoint_layers: bool = False
    ) -> int:
        """A lower bound on :meth:`step_bytes` over every chunk size, for a forest whose longest path
        holds ``path`` tokens (docs/chunked_execution.md, "Choosing the chunk size").

        When the chunk (L tokens) of a deepest token closes, the P ancestors of its first token are in
        open chunks and P >= path - L, so ``held`` >= P + L >= path. With recompute what is alive is
        then at least activation L + kv (2 path - L) with the head's window of min(L, rows) rows,
        concave in L in [1, path], so least at an end; without, (activation + kv) path and a window of
        at least one row; with checkpointed layers, at least one token's layer inputs, kv path and one
        row. Less the gradients not yet created, if it closes first; and the end of its backward holds
        kv path.
        """
        if path == 0:
            return self.head_weight
        rows = logits_rows or self.logits_rows
        one_row = self.activation + self.kv * (2 * path - 1) + self.head_row
        if checkpoint_layers:
            start = self.checkpointed + self.kv * path + self.head_row
        elif recompute:
            start = min(one_row, (self.activation + self.kv) * path + self.head_row * min(path, rows))
        else:
            start = (self.activation + self.kv) * path + self.head_row
        return max(start + self.head_weight - self.new_grads, self.kv * path + self.closing)


def _unset_grad_bytes(model) -> int:
    """Bytes of the parameter gradients a step will create: those that train and are still unset."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None)


def activation_bytes_per_token(model) -> int:
    """Estimated bytes autograd saves per packed token for one forward + backward (all layers, none of
    them checkpointed)."""
    shape = adapt(model).shape
    return shape.layers * _layer_bytes_per_token(shape) + _trunk_bytes_per_token(shape)


def _layer_bytes_per_token(shape) -> int:
    """What autograd saves per token in one decoder layer: two RMSNorms over the hidden size (each a
    float32 copy of its input and its output), the inputs of the attention and MLP projections, the
    queries and attention output, the chunk's own K/V, four MLP intermediates, and the query/key norms'
    float32 copies where the model has them (Qwen3)."""
    hidden, size = shape.hidden, shape.bytes_per_element
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = 2 * hidden * (4 + size) + 2 * hidden * size + 2 * q * size + 2 * kv * size + 4 * shape.intermediate * size
    if shape.qk_norm:
        per_layer += (q + kv) * (4 + size)
    return per_layer


def _trunk_bytes_per_token(shape) -> int:
    """... and outside the layers (the final norm)."""
    return 4 * shape.hidden * shape.bytes_per_element


def _check_chunk_tokens(chunk_tokens, name: str = "chunk_tokens") -> int:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(chunk_tokens).__name__}")
    if chunk_tokens < 1:
        raise ValueError(f"{name} must be at least 1 token, got {chunk_tokens}")
    return int(chunk_tokens)


def _check_bytes(value, name: str, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of bytes, got {type(value).__name__}")
    if not math.isfinite(as_float(value)) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite {'non-negative' if allow_zero else 'positive'} number of bytes, got {value}")
    return int(value)


def estimated_step_bytes(
    model, tree: PrefixTree, chunk_tokens: int, recompute: bool = True, checkpoint_layers: bool | None = None
) -> int:
    """Estimated activation memory of tree_backward with chunks of ``chunk_tokens``.

    Counts what the step allocates beyond the model's parameters, their
    gradients and optimizer state: the vocabulary head's backward, the K/V of
    every open chunk with the gradient accumulators its descendants filled,
    and what autograd saves: with ``recompute``, the running chunk's
    activations and K/V copies; without, those of every open chunk. Taken at
    the plan's worst moment. Gradients still unset (``None``) on the model
    are counted only from the end of the step's first backward, as the step
    creates them then. ``checkpoint_layers``: every layer under activation
    checkpointing (None: as the model runs them; layers it checkpoints itself
    through Hugging Face's ``gradient_checkpointing_enable()`` are counted so).
    benchmarks/bench_training.py measures the real peak.
    """
    _check_tree(tree)
    recompute = _check_recompute(recompute)
    size = _check_chunk_tokens(chunk_tokens)
    memory = MemoryModel.of(model)
    checkpoint_layers = _check_checkpoint_layers(checkpoint_layers, memory)
    return memory.step_bytes(plan_chunks(tree, size, recompute, checkpoint_layers=bool(checkpoint_layers)))


def _check_checkpoint_layers(checkpoint_layers, memory: MemoryModel) -> bool | None:
    """None (the plan decides) or a bool; True where the model checkpoints every layer itself: False adds
    no checkpointing but cannot undo the model's own."""
    checkpoint_layers = checked_options(checkpoint_layers=checkpoint_layers).checkpoint_layers
    return True if memory.model_checkpoints else None if checkpoint_layers is None else bool(checkpoint_layers)


# Below this many tokens a budget that the first sizes tried miss is checked against every size.
EXHAUSTIVE_SEARCH_TOKENS = 1024


def _largest_fitting_plan(
    memory: MemoryModel, forest: _Forest, budget: int, recompute: bool, tolerance: float = 0.0,
    logits_rows: int | None = None, checkpoint_layers: bool = False, smallest: int = 1,
) -> ChunkPlan:  # fmt: skip
    """The plan (without prefix pieces) of the largest chunk size whose estimate fits ``budget``, or of
    one within ``tolerance`` (relative) of it where the next size up does not fit; ValueError when none
    fits. Its head runs windows of ``logits_rows`` rows (None: the default), its layers under activation
    checkpointing with ``checkpoint_layers``. Sizes under ``smallest`` are not tried.

    Every plan holds a deepest token's whole path open at some moment, which
    bounds the estimate from below and, with one chunk's worth of tokens on
    top, gives a first guess. From there the sizes double or halve until they
    bracket the budget. Then each step guesses where the estimate meets the
    budget: along its own slope where two fitting sizes have the same chunks
    (there it grows linearly with the chunks the size bounds), along the
    bracket's chord, or, once that stalls on a step of the estimate (a chunk
    end flipping), by bisection after trying the size just above the largest
    fit. 4 to 7 plans on the forests of docs/benchmarks.md, up to ~17 where
    the estimate is flat up to a step. The estimate grows with the size but
    for small steps down (fewer chunks save fewer prefix copies), so "largest"
    is local: the next size up does not fit.
    """
    T = forest.num_tokens
    memo: dict[int, int] = {}  # size -> estimate
    plans: dict[int, ChunkPlan] = {}

    def fits(size):
        if size not in memo:
            plans[size] = plan_chunks(
                forest, size, recompute, with_prefix=False, logits_rows=logits_rows, checkpoint_layers=checkpoint_layers
            )
            memo[size] = memory.step_bytes(plans[size])
        return memo[size] <= budget

    path = int(forest.depth.max()) + 1 if T else 0  # some moment holds a deepest token and its ancestors
    # a first guess: the path open with its K/V (stored and copied) and accumulators, then chunk tokens
    head, floor_bytes = memory.head(logits_rows), memory.floor_bytes(path, recompute, logits_rows, checkpoint_layers)
    activation = memory.checkpointed if checkpoint_layers else memory.activation
    open_path = head + (2 * memory.kv + memory.kv_grad) * path + (0 if recompute else activation * path)
    floor = max(1, T >> 14, smallest)  # smaller chunks are never worth their planning time on a large forest
    lo = hi = None  # fits(lo); hi does not fit
    if floor_bytes <= budget:  # else nothing fits: no plan needed to say so
        per_token = activation + 2 * memory.kv + memory.kv_grad
        # not below 1024 tokens: plans of small chunks cost the most, and halving finds them
        first = size = min(T, max(floor, 1024, (budget - open_path) // per_token))
        if fits(size):
            lo = size
        else:
            hi = size
            while lo is None and size > floor:
                above, size = size, max(floor, size // 2)
                if fits(size):
                    lo = size
                else:
                    hi = size
                    if memo[size] > memo[above] and plans[size].num_chunks > 256:
                        # many chunks and halving raised the estimate (the open chunks' K/V and prefix
                        # copies outgrow the chunk's own activations): ever smaller chunks cost more to
                        # plan than they are likely to fit (down to a token a chunk, keep mode took
                        # half a second on 10K tokens)
                        break
            # not found below: the estimate is not monotone in the size (fewer chunks, fewer saved
            # prefix copies), so other sizes may still fit: all of them on a small forest, else a
            # ladder of ratio 2^(1/4) above the first guess (not for a search bounded below: the plan
            # it could find is one that a cheaper one already beats but for such flukes)
            if lo is None and smallest == 1:
                ladder = range(floor, T + 1) if T <= EXHAUSTIVE_SEARCH_TOKENS else sorted(
                    {min(T, int(first * 2 ** (k / 4))) for k in range(1, 4 * T.bit_length() + 1)} - {first}
                )
                lo = next((size for size in ladder if fits(size)), None)
        if lo is not None and hi is not None and hi <= lo:
            hi = None  # found above every size known not to fit (the ladder): bracket again from there
        while lo is not None and lo < T and hi is None:
            if fits(min(2 * lo, T)):
                lo = min(2 * lo, T)
            else:
                hi = min(2 * lo, T)
    if lo is None:
        if memo:
            smallest = f"the smallest estimate among the {len(memo)} chunk sizes tried is {_size(min(memo.values()))}"
        else:
            smallest = f"every chunk size's estimate is at least {_size(floor_bytes)}"
        raise ValueError(
            f"memory budget of {_size(budget)} is too small: {smallest} (the open chunks' K/V, the "
            "vocabulary head's backward and "
            f"{_size(activation)} of activations per chunk token"
            + ("" if recompute else "; try recompute=True") + ")"
        )
    fitted = [lo]  # sizes that fit, in the order found (increasing)
    interpolate, lo_moved = True, True
    while hi is not None and hi - lo > max(1, int(tolerance * lo)):  # fits(lo) and not fits(hi)
        below = fitted[-2] if len(fitted) > 1 else None
        if lo_moved and below is not None and plans[below].num_chunks == plans[lo].num_chunks and memo[lo] > memo[below]:
            # two fitting sizes with the same chunk count: the estimate's own slope here, where it
            # grows with the chunks that the size bounds
            slope = (memo[lo] - memo[below]) / (lo - below)
        elif interpolate:
            slope = (memo[hi] - memo[lo]) / (hi - lo)
        else:
            slope = None
        guess = (lo + hi) // 2 if slope is None else lo + int((budget - memo[lo]) // slope)
        guess = min(hi - 1, max(lo + 1, guess))
        width = hi - lo
        lo_moved = fits(guess)
        if lo_moved:
            lo = guess
            fitted.append(lo)
        else:
            hi = guess
        if interpolate and 2 * (hi - lo) > width:
            # the estimate is a step function here (chunk ends set by the tree, not the size): bisect,
            # after trying whether the step is right after lo, as it often is where a chunk's end flips
            interpolate = False
            if hi - lo > max(1, int(tolerance * lo)):
                lo_moved = fits(lo + 1)
                if lo_moved:
                    lo = lo + 1
                    fitted.append(lo)
                else:
                    hi = lo + 1
    return plans[lo]


def chunk_tokens_for_budget(
    model, tree: PrefixTree, memory_budget_bytes: int, recompute: bool = True, checkpoint_layers: bool | None = None
) -> int:
    """Largest chunk size whose :func:`estimated_step_bytes` fits the budget (a ValueError if none does);
    ``recompute`` and ``checkpoint_layers`` as there (None: the layers as the model runs them).

    The estimate grows with the size but for small steps down, so "largest" is local: the size returned
    fits and the next size up does not (docs/chunked_execution.md, "Memory budget and the automatic
    default")."""
    _check_tree(tree)
    recompute = _check_recompute(recompute)
    budget = _check_bytes(memory_budget_bytes, "memory_budget_bytes")
    memory = MemoryModel.of(model)
    checkpoint_layers = bool(_check_checkpoint_layers(checkpoint_layers, memory))
    return _largest_fitting_plan(memory, _Forest.of(tree), budget, recompute, checkpoint_layers=checkpoint_layers).size


def _size(num_bytes: float) -> str:
    """A byte count as people read it: 512 B, 3.25 MiB, 1.500 GiB."""
    for unit, digits, scale in (("GiB", 3, 2**30), ("MiB", 2, 2**20), ("KiB", 1, 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.{digits}f} {unit}"
    return f"{int(num_bytes)} B"


def _check_tree(tree) -> None:
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"expected a PrefixTree, got {type(tree).__name__}")


def _check_recompute(recompute, allow_none: bool = False) -> bool | None:
    if (recompute is None and allow_none) or isinstance(recompute, (bool, np.bool_)):
        return None if recompute is None else bool(recompute)
    raise TypeError(f"recompute must be True, False{' or None' if allow_none else ''}, got {recompute!r}")


# A chunk costs a fixed overhead (kernel launches, prefix gathers, logits windows, Python) worth about
# this many tokens of forward work: measured 70-170 ms a chunk at the Qwen2-0.5B shape on an H100,
# where a token's forward takes ~7 us; the automatic choice weighs it against recomputed tokens.
CHUNK_OVERHEAD_TOKENS = 8192
# A window of the vocabulary head costs a dozen launches each way: a fraction of a millisecond.
WINDOW_OVERHEAD_TOKENS = 64
# The head's windows the automatic choice tries: the default, then halved, at most this many times, on
# plans of at most this many chunks (one chunk less saves most there, and their plans are quick: a
# search over plans of ~700 chunks takes ~35 ms on a 1M-token forest, which a second would double).
WINDOW_HALVINGS = 3
WINDOW_TRADE_MAX_CHUNKS = 256


def _step_cost(memory: MemoryModel, plan: ChunkPlan) -> float:
    """Relative step time in token forwards: a cost per token and per chunk (:func:`_cost_rates`),
    recomputed forwards, and the overheads of the head's windows (a chunk's rows are at most its tokens;
    a recomputed chunk runs its windows twice)."""
    windows = -(-plan.lengths // (plan.logits_rows or memory.logits_rows))
    num_windows = int(windows.sum() + windows[~plan.keeps_graph].sum())
    per_token, per_chunk = _cost_rates(plan.checkpoint_layers)
    return (
        per_token * int(plan.lengths.sum()) + plan.recomputed_tokens
        + per_chunk * plan.num_chunks + WINDOW_OVERHEAD_TOKENS * num_windows
    )  # fmt: skip


def _cost_rates(checkpoint_layers: bool) -> tuple[int, int]:
    """Token forwards a plan costs per token (forward and backward: 3) and per chunk. Checkpointed layers
    run every chunk's forward once more in its backward: one more per token, and a third more per
    chunk (a forward of every layer on the host)."""
    if checkpoint_layers:
        return 4, CHUNK_OVERHEAD_TOKENS * 4 // 3
    return 3, CHUNK_OVERHEAD_TOKENS


def _plan_for_budget(
    memory: MemoryModel, forest: _Forest, budget: int, recompute: bool | None, strict: bool,
    checkpoint_layers: bool | None = None,
) -> ChunkPlan:  # fmt: skip
    """The cheapest plan (:func:`_step_cost`) whose estimate fits ``budget``, over keep and recompute, over
    the head's logits window and, unless ``checkpoint_layers`` says, with or without checkpointed layers.

    The window starts at the default and halves while that makes the plan
    cheaper: where the budget is tight, the memory a smaller window frees
    lets larger chunks fit, and fewer chunks save more than the extra
    windows cost (docs/chunked_execution.md, "Memory budget"). Checkpointed
    layers keep a fraction of the activations, so where the budget cuts the
    forest into many chunks, few larger ones may cost less, their forwards
    run twice included. With ``strict`` a budget nothing fits is a
    ValueError; without (the automatic CUDA budget), the plan with the
    smallest estimate is tried.
    """
    modes = (False, True) if recompute is None else (bool(recompute),)
    T = forest.num_tokens
    found, errors = [], []
    # checkpointed layers first: their few large chunks bound how small a chunk the search without them
    # need try, as a plan of chunks of s tokens has at least T / s of them (planning many small chunks is
    # what costs time)
    for checkpoint in (True, False) if checkpoint_layers is None else (checkpoint_layers,):
        smallest = 1
        if found:
            per_token, per_chunk = _cost_rates(checkpoint)
            room = _step_cost(memory, found[0]) - per_token * T  # what its chunks may cost, at most
            if room <= per_chunk:
                continue
            smallest = T * per_chunk // room + 1
        plan = _cheapest_over_windows(memory, forest, budget, modes, checkpoint, errors, smallest)
        if plan is not None:
            found.append(plan)
    if found:  # a tie goes to the plan without checkpointed layers
        return _with_prefix(forest, min(found, key=lambda plan: (_step_cost(memory, plan), plan.checkpoint_layers)))
    if strict:
        raise errors[-1]  # the last search's smallest window: the estimate closest to the budget
    sizes = {T} | {2**i for i in range(8, T.bit_length())}
    checkpoint = checkpoint_layers is not False
    rows = max(1, memory.logits_rows >> WINDOW_HALVINGS)
    plans = (
        plan_chunks(forest, size, True, with_prefix=False, logits_rows=rows, checkpoint_layers=checkpoint)
        for size in sorted(sizes)
    )
    return _with_prefix(forest, min(plans, key=memory.step_bytes))


def _cheapest_over_windows(memory, forest, budget, modes, checkpoint_layers, errors, smallest=1) -> ChunkPlan | None:
    """The cheapest fitting plan of chunks of at least ``smallest`` tokens over ``modes`` and the head's
    windows (the default, then halved while that makes the plan cheaper); None where none fits, the
    reasons added to ``errors``."""
    best = None

    def cost(plan):
        return _step_cost(memory, plan)

    for halvings in range(WINDOW_HALVINGS + 1):
        rows = max(1, memory.logits_rows >> halvings)
        plans = []
        for mode in modes:
            try:
                # a size within 3% of the largest runs as fast: spare the last bisection steps
                plans.append(_largest_fitting_plan(
                    memory, forest, budget, mode, 1 / 32, rows, checkpoint_layers, smallest
                ))  # fmt: skip
            except ValueError as error:
                errors.append(error)
        cheapest = min(plans, key=cost, default=None)
        if cheapest is not None and (best is None or cost(cheapest) < cost(best)):
            best = cheapest
        elif best is not None and (cheapest is None or cost(cheapest) > cost(best)):
            break  # smaller windows would only add more of them (a tie goes on: it may free room later)
        if rows == 1 or (best is not None and not 1 < best.num_chunks <= WINDOW_TRADE_MAX_CHUNKS):
            break
    return best


# Share of the free device memory the automatic budget gives the estimate: headroom for the caching
# allocator's fragmentation and for models unlike the measured ones (on those the estimate was
# 0.986-1.025x of the peak, docs/benchmarks.md).
AUTO_BUDGET_FRACTION = 0.8


def _free_device_bytes(model, device: torch.device) -> int:
    """Memory a step may still allocate: free on the device and in the caching allocator, less the
    parameter gradients the backward will create."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached - _unset_grad_bytes(model)


# ------------------------------------------------------------- the engine


@dataclass
class _LayerKV:
    """One layer's detached K/V of an open chunk, and the gradient its descendants leave on them."""

    keys: torch.Tensor  # [1, Hkv, n, D]
    values: torch.Tensor
    dkeys: torch.Tensor | None = None  # at least float32, allocated on the first gradient
    dvalues: torch.Tensor | None = None

    def add_grad(self, lo: int, hi: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        if self.dkeys is None:
            dtype = torch.promote_types(self.keys.dtype, torch.float32)
            self.dkeys = torch.zeros(self.keys.shape, dtype=dtype, device=self.keys.device)
            self.dvalues = torch.zeros(self.values.shape, dtype=dtype, device=self.values.device)
        self.dkeys[:, :, lo:hi] += dk
        self.dvalues[:, :, lo:hi] += dv


class _AttendedKV(torch.autograd.Function):
    """The keys and values a chunk's queries attend in one layer: its cached prefix, gathered from the
    open chunks' stores (detached), then its own k, v.

    The backward adds each prefix piece's gradient into its owner's
    accumulators, and passes the gradient of the own k, v on with the dK/dV
    the chunk's descendants accumulated on them. The accumulators are read
    when autograd runs this backward, which happens once, in whichever graph
    autograd actually runs (the forward's, or a gradient-checkpointing
    recompute's); the chunk closes only after every descendant, so they are
    complete by then.
    """

    @staticmethod
    def forward(ctx, k, v, own: _LayerKV, prefix: list[tuple[_LayerKV, int, int]]):
        ctx.own, ctx.prefix = own, prefix
        if not prefix:
            return k.view_as(k), v.view_as(v)
        keys = torch.cat([store.keys[:, :, lo:hi].to(k.dtype) for store, lo, hi in prefix] + [k], dim=2)
        values = torch.cat([store.values[:, :, lo:hi].to(v.dtype) for store, lo, hi in prefix] + [v], dim=2)
        return keys, values

    @staticmethod
    def backward(ctx, dkeys, dvalues):
        offset = 0
        for store, lo, hi in ctx.prefix:
            n = hi - lo
            store.add_grad(lo, hi, dkeys[:, :, offset : offset + n], dvalues[:, :, offset : offset + n])
            offset += n
        dk, dv = dkeys[:, :, offset:], dvalues[:, :, offset:]
        own = ctx.own
        if own.dkeys is not None:
            dk, dv = dk + own.dkeys.to(dk.dtype), dv + own.dvalues.to(dv.dtype)
        return dk, dv, None, None


@dataclass
class _ChunkPass:
    """What one forward of a chunk leaves: the roots of its backward."""

    hidden: torch.Tensor  # [n, hidden] final hidden states
    logprobs: torch.Tensor  # [pairs] logprobs of its (sequence, step) pairs


@dataclass
class _OpenChunk:
    layers: dict  # layer index -> _LayerKV
    graph: _ChunkPass | None = None  # kept from the forward when the plan says so
    rng: "_RngState | None" = None  # where its forward began drawing, when it will be redone (dropout)


class _RngState(NamedTuple):
    """The random generators a model's forward draws from (dropout): the CPU's and those of the CUDA
    devices its parameters are on."""

    cpu: torch.Tensor
    cuda: tuple  # (device, state) pairs

    @classmethod
    def now(cls, devices: tuple) -> "_RngState":
        return cls(torch.get_rng_state(), tuple((d, torch.cuda.get_rng_state(d)) for d in devices))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in self.cuda:
            torch.cuda.set_rng_state(state, device)

    @contextlib.contextmanager
    def replayed(self):
        """The generators at this state inside, as they were outside after: a forward redone here draws
        the dropout masks of the first (what torch.utils.checkpoint's preserve_rng_state does)."""
        with torch.random.fork_rng(devices=[d for d, _ in self.cuda]):
            self.restore()
            yield


class _Engine:
    """Runs a :class:`ChunkPlan`: forwards and closes in the plan's order."""

    def __init__(
        self, model, tree: PrefixTree, plan: ChunkPlan, attention_impl: str, out_logprobs: torch.Tensor,
        temperature: float = 1.0,
    ):  # fmt: skip
        self.adapter, self.tree, self.plan, self.temperature = adapt(model), tree, plan, temperature
        self.head = self.adapter.head
        self.attention_impl = attention_impl
        self.pairs = LogprobPairs.of(tree)
        rows = self.pairs.rows.cpu().numpy()
        self.span_lo = np.searchsorted(rows, plan.start).tolist()
        self.span_hi = np.searchsorted(rows, plan.stop).tolist()
        # every chunk's head rows and windows at once: no chunk waits for the GPU to learn its own
        window = plan.logits_rows or window_rows(head_weight(self.head).shape[0])
        self.head_rows = HeadRows.of_chunks(
            rows, self.span_lo + [rows.size], plan.start.tolist(), window, self.pairs.rows.device
        )
        self.out = out_logprobs
        self.open: dict[int, _OpenChunk] = {}
        self.cuda_devices = tuple(sorted({p.device for p in model.parameters() if p.is_cuda}, key=str))

    def rng_state(self) -> _RngState:
        return _RngState.now(self.cuda_devices)

    def run(self, seed) -> None:
        """Forward and backward over the whole plan; ``seed(span, logprobs)`` is a chunk's loss."""
        for step in self.plan.steps:
            if step.forward:
                self.forward(step.chunk)
            else:
                self.close(step.chunk, seed)

    def run_forward_only(self) -> None:
        """Every logprob, no graphs: the first pass for a loss that is not a TokenLoss."""
        with torch.no_grad():
            for step in self.plan.steps:
                if step.forward:
                    self.open[step.chunk] = _OpenChunk({})
                    self.record(step.chunk, self.run_chunk(step.chunk, grad=False))
                else:
                    del self.open[step.chunk]

    def forward(self, c: int) -> None:
        keep = bool(self.plan.keeps_graph[c])
        chunk = self.open[c] = _OpenChunk({}, rng=None if keep else self.rng_state())
        chunk_pass = self.run_chunk(c, grad=keep)
        self.record(c, chunk_pass)
        if keep:
            chunk.graph = chunk_pass

    def close(self, c: int, seed) -> None:
        """Backward of a chunk whose descendants have all closed."""
        chunk = self.open[c]
        if chunk.graph is not None:
            chunk_pass = chunk.graph
        else:  # redone with its first forward's dropout masks: the K/V its descendants saw, the same graph
            with chunk.rng.replayed():
                chunk_pass = self.run_chunk(c, grad=True)
        chunk.graph = None
        # the hidden states with a zero gradient reach every layer even without loss terms, so the
        # K/V seeds of _AttendedKV always run
        roots, grads = [chunk_pass.hidden], [torch.zeros_like(chunk_pass.hidden)]
        if chunk_pass.logprobs.numel():
            loss = seed(self.span(c), chunk_pass.logprobs)
            roots.append(loss)
            grads.append(torch.ones_like(loss))
        # a root that needs no gradient is left out: the hidden states when only the head trains, all of
        # them when nothing in the model does
        trained = [(root, grad) for root, grad in zip(roots, grads) if root.requires_grad]
        if trained:  # not under a caller's autocast: a backward runs in its forward's dtypes
            with torch.autocast(chunk_pass.hidden.device.type, enabled=False):
                torch.autograd.backward(*zip(*trained))
        del self.open[c]

    def span(self, c: int) -> slice:
        return slice(self.span_lo[c], self.span_hi[c])

    def record(self, c: int, chunk_pass: _ChunkPass) -> None:
        span = self.span(c)
        self.out[self.pairs.seq[span], self.pairs.step[span]] = chunk_pass.logprobs.detach().to(self.out.dtype)

    def run_chunk(self, c: int, grad: bool) -> _ChunkPass:
        """Chunk ``c``'s forward with its ancestors' K/V as a cached prefix."""
        a, b = int(self.plan.start[c]), int(self.plan.stop[c])
        pieces = self.plan.prefix(c)
        end = self.tree.subtree_end
        starts = [int(self.plan.start[p.owner]) for p in pieces]
        prefix_end = [end[s + p.lo : s + p.hi] for s, p in zip(starts, pieces)]
        P = int(self.plan.prefix_tokens[c])
        key_end = torch.cat(prefix_end + [end[a:b]]).clamp(max=b) - a + P  # chunk-local key coordinates
        if self.attention_impl == "kernel":
            schedule = build_schedule(key_end, b - a, validate=False)
        else:
            mask = mask_from_subtree_end(key_end, torch.arange(P, P + b - a, device=key_end.device))
        chunk = self.open[c]

        def attend(layer, q, k, v, scale):
            if layer not in chunk.layers:  # idempotent: a checkpointed layer calls attend twice
                chunk.layers[layer] = _LayerKV(k.detach(), v.detach())
            prefix = [(self.open[p.owner].layers[layer], p.lo, p.hi) for p in pieces]
            k, v = _AttendedKV.apply(k, v, chunk.layers[layer], prefix)
            if self.attention_impl == "kernel":
                return tree_attention(q, k, v, scale=scale, schedule=schedule)
            return attention(q, k, v, mask, scale)

        with torch.set_grad_enabled(grad), warnings.catch_warnings():
            # reentrant checkpointing warns of a forward without gradients; this one needs none
            warnings.filterwarnings("ignore", "None of the inputs have requires_grad", UserWarning)
            ids, positions = self.tree.tokens[a:b][None], self.tree.position_ids[a:b][None]
            hidden = self.adapter.hidden_states(ids, positions, attend, self.plan.checkpoint_layers)[0]
            span = self.span(c)
            logprobs = head_logprobs(hidden, self.head, self.head_rows[c], self.pairs.targets[span], self.temperature)
        return _ChunkPass(hidden, logprobs)


# ------------------------------------------------------------ tree_backward


def _choose_plan(
    model, tree, device, max_chunk_tokens, memory_budget_bytes, memory_margin_bytes, recompute, checkpoint_layers
):  # fmt: skip
    """The plan of this step: a given chunk size, a given budget, or on CUDA the free memory."""
    forest = _Forest.of(tree)
    T = forest.num_tokens
    memory = MemoryModel.of(model)
    checkpoint_layers = _check_checkpoint_layers(checkpoint_layers, memory)
    if max_chunk_tokens is not None or (memory_budget_bytes is None and device.type != "cuda"):
        # a given size, or on CPU one chunk (one packed forward and backward); layers as the model runs them
        size, checkpoint = min(max_chunk_tokens or T, T), bool(checkpoint_layers)
        if recompute is None and max_chunk_tokens is not None:  # on when chunked
            plan = plan_chunks(forest, size, False, checkpoint_layers=checkpoint)
            return plan if plan.num_chunks == 1 else plan_chunks(forest, size, True, checkpoint_layers=checkpoint)
        return plan_chunks(forest, size, bool(recompute), checkpoint_layers=checkpoint)
    if memory_budget_bytes is not None:
        return _plan_for_budget(memory, forest, memory_budget_bytes, recompute, True, checkpoint_layers)
    total = torch.cuda.get_device_properties(device).total_memory
    margin = total // 20 if memory_margin_bytes is None else memory_margin_bytes
    budget = int(AUTO_BUDGET_FRACTION * (_free_device_bytes(model, device) - margin))
    return _plan_for_budget(memory, forest, max(budget, 1), recompute, False, checkpoint_layers)


def tree_backward(
    model,
    tree: PrefixTree,
    loss_fn,
    *,
    max_chunk_tokens: int | None = None,
    memory_budget_bytes: int | None = None,
    memory_margin_bytes: int | None = None,
    recompute: bool | None = None,
    checkpoint_layers: bool | None = None,
    attention_impl: str = "auto",
    temperature: float = 1.0,
    grad_scaler: torch.amp.GradScaler | None = None,
):
    """Forward and backward over the whole forest, depth-first in chunks; gradients added to ``.grad``.

    ``loss_fn(i, logprobs_i)`` returns sequence i's scalar loss term; the total
    loss is their sum. Pass ``dta_ref.PolicyGradientLoss`` / ``dta_ref.SFTLoss``
    for the losses of dta_ref (one pass), or any callable (two passes; a term
    that also depends on parameters directly gets that gradient too, as
    ``loss.backward()`` would give it).

    How the forest is chunked:

    - ``max_chunk_tokens``: chunks of at most this many packed tokens.
    - ``memory_budget_bytes``: the chunk size and ``recompute`` whose
      :func:`estimated_step_bytes` fits this activation budget, cheapest first.
    - neither, on CUDA: the budget is the device's free memory (with what the
      caching allocator holds free, less the parameter gradients still to be
      created), less ``memory_margin_bytes`` (default 5% of the device; leave
      room for what comes after the backward: optimizer state on its first
      step, other models), of which 80% goes to the estimate.
    - neither, on CPU: one chunk (the packed forest in one forward).

    ``recompute``: redo each chunk's forward at its backward, so memory is
    the open chunks' K/V plus one chunk's activations; without it the open
    chunks keep their graphs. Default: on when chunked by ``max_chunk_tokens``;
    chosen with the chunk size under a budget.
    ``checkpoint_layers``: run every decoder layer under activation
    checkpointing (non-reentrant, this call only): a chunk keeps each layer's
    input and its backward recomputes the layer, so much larger chunks fit a
    budget for a second forward. Default: off with ``max_chunk_tokens`` and
    on CPU, chosen with the chunk size under a budget. Layers the model
    checkpoints itself (Hugging Face's ``gradient_checkpointing_enable()``, in
    training mode) stay checkpointed, and the estimate counts them so.
    ``attention_impl``: "kernel" (Triton), "reference" (explicit mask, any
    dtype, for CPU tests) or "auto" (kernel on CUDA, reference elsewhere).
    ``temperature``: the logprobs are those of ``logits / temperature``, as
    an RL trainer scores its samples at the sampling temperature.
    ``grad_scaler``: float16 mixed precision's ``torch.amp.GradScaler``. The
    backward runs on its scaled loss, as ``scaler.scale(loss).backward()``
    would, so ``scaler.step(optimizer)`` unscales the gradients as usual
    (without it they would arrive unscaled and be divided by the scale).

    Exact under gradient checkpointing of the model's layers (reentrant or
    not). Needs gradients enabled, as ``loss.backward()`` does: under
    ``torch.no_grad()`` or ``torch.inference_mode()`` it raises. Returns ``(logprobs, loss)``: detached per-sequence logprobs
    [N, Lmax-1] (the layout of ``tree_logprobs``) and the detached total loss.
    Parameters the forward runs get a gradient (zero where no term reaches
    them); others (a value head beside the model) keep ``.grad`` None, as
    ``loss.backward()`` leaves them. A call that raises partway (a loss that
    raises, running out of memory) leaves in ``.grad`` what the chunks before
    it added, as a failed ``loss.backward()`` does: zero the gradients before
    trying again (``distributed_tree_backward`` restores them itself).
    """
    _check_tree(tree)
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        # the chunks' forwards would enable gradients, but not the loss terms: every .grad would stay 0
        raise RuntimeError(
            "tree_backward computes gradients, but gradients are disabled here (torch.no_grad() or "
            "torch.inference_mode()): call it outside them, as loss.backward() would need"
        )
    options = checked_options(max_chunk_tokens=max_chunk_tokens, memory_budget_bytes=memory_budget_bytes,
                              memory_margin_bytes=memory_margin_bytes, recompute=recompute,
                              checkpoint_layers=checkpoint_layers, attention_impl=attention_impl,
                              temperature=temperature, grad_scaler=grad_scaler)  # fmt: skip
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(i, logprobs_i), got {type(loss_fn).__name__}")
    if isinstance(loss_fn, type):
        raise TypeError(f"loss_fn is the class {loss_fn.__name__}: pass an instance (e.g. SFTLoss(tree.logprob_mask))")
    tree.validate(loss_fn)
    adapter = adapt(model)  # rejects unsupported models with a clear error
    if adapter.data_parallel is not None:
        raise TypeError(
            "tree_backward runs one forward per chunk, which DistributedDataParallel does not allow before its "
            "backward: use dta_fast.distributed_tree_backward, or pass model.module and reduce the gradients"
        )
    adapter.check_token_ids(tree.tokens)
    max_chunk_tokens, memory_budget_bytes, memory_margin_bytes, recompute, checkpoint_layers, attention_impl, \
        temperature, grad_scaler = options  # fmt: skip

    device = adapter.device
    plan = _choose_plan(
        model, tree, device, max_chunk_tokens, memory_budget_bytes, memory_margin_bytes, recompute, checkpoint_layers
    )
    tree = tree.to(device)
    if attention_impl == "auto":
        attention_impl = "kernel" if device.type == "cuda" else "reference"
    dtype = logprob_dtype(adapter.dtype)
    logprobs = torch.zeros(tree.num_sequences, tree.max_length - 1, dtype=dtype, device=device)
    engine = _Engine(model, tree, plan, attention_impl, logprobs, temperature)
    scaled = _unscaled if grad_scaler is None else grad_scaler.scale  # what the backward runs on
    if isinstance(loss_fn, TokenLoss):
        total = _run_token_loss(engine, loss_fn, scaled)
    else:
        total = _run_linearised_loss(engine, loss_fn, scaled)
    for p in adapter.forward_parameters():  # as loss.backward() leaves them: a zero gradient, not None, for a
        if p.requires_grad and p.grad is None:  # parameter the forward runs that no term reached
            p.grad = torch.zeros_like(p)
    return logprobs, total.to(dtype)


class TreeBackwardOptions(NamedTuple):
    """:func:`tree_backward`'s options as :func:`checked_options` returns them."""

    max_chunk_tokens: int | None
    memory_budget_bytes: int | None
    memory_margin_bytes: int | None
    recompute: bool | None
    checkpoint_layers: bool | None
    attention_impl: str
    temperature: float
    grad_scaler: torch.amp.GradScaler | None


def checked_options(
    *, max_chunk_tokens=None, memory_budget_bytes=None, memory_margin_bytes=None, recompute=None,
    checkpoint_layers=None, attention_impl="auto", temperature=1.0, grad_scaler=None,
) -> TreeBackwardOptions:  # fmt: skip
    """:func:`tree_backward`'s options checked; an unknown name is a TypeError. Alone, for a caller that
    must refuse them without a tree to train (a rank whose shard is empty)."""
    max_chunk_tokens, memory_budget_bytes, memory_margin_bytes = _checked_chunking(
        max_chunk_tokens, memory_budget_bytes, memory_margin_bytes
    )
    recompute = _check_recompute(recompute, allow_none=True)
    if checkpoint_layers is not None and not isinstance(checkpoint_layers, (bool, np.bool_)):
        raise TypeError(f"checkpoint_layers must be True, False or None, got {checkpoint_layers!r}")
    if attention_impl not in ("auto", "kernel", "reference"):
        raise ValueError(f"attention_impl must be 'auto', 'kernel' or 'reference', got {attention_impl!r}")
    temperature = check_temperature(temperature)
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")
    return TreeBackwardOptions(max_chunk_tokens, memory_budget_bytes, memory_margin_bytes, recompute,
                               checkpoint_layers, attention_impl, temperature, grad_scaler)  # fmt: skip


def _checked_chunking(max_chunk_tokens, memory_budget_bytes, memory_margin_bytes, prefix: str = ""):
    """The chunking options checked; ``prefix`` is how the caller names them (``tree_`` in TreeGRPOConfig)."""
    if max_chunk_tokens is not None and memory_budget_bytes is not None:
        raise ValueError(f"give {prefix}max_chunk_tokens or {prefix}memory_budget_bytes, not both")
    if max_chunk_tokens is not None:
        max_chunk_tokens = _check_chunk_tokens(max_chunk_tokens, f"{prefix}max_chunk_tokens")
    if memory_budget_bytes is not None:
        memory_budget_bytes = _check_bytes(memory_budget_bytes, f"{prefix}memory_budget_bytes")
    if memory_margin_bytes is not None:
        memory_margin_bytes = _check_bytes(memory_margin_bytes, "memory_margin_bytes", allow_zero=True)
        if max_chunk_tokens is not None or memory_budget_bytes is not None:
            raise ValueError(
                "memory_margin_bytes sets memory aside from the automatic budget; with max_chunk_tokens or "
                "memory_budget_bytes it would do nothing: leave it out"
            )
    return max_chunk_tokens, memory_budget_bytes, memory_margin_bytes


def _unscaled(loss: torch.Tensor) -> torch.Tensor:
    """What the backward runs on without a GradScaler: the loss itself."""
    return loss


def _run_token_loss(engine: _Engine, loss_fn: TokenLoss, scaled) -> torch.Tensor:
    """One pass: each chunk backpropagates its own tokens' terms (``scaled``). Returns the total (float64)."""
    out, pairs = engine.out, engine.pairs
    if loss_fn.shape != tuple(out.shape):
        raise ValueError(f"loss_fn was built for logprobs of shape {loss_fn.shape}, the tree has {tuple(out.shape)}")
    token_loss = loss_fn.to(out.device)  # once, not at every chunk
    totals = []

    def seed(span, chunk_logprobs):
        terms = token_loss.terms(pairs.seq[span], pairs.step[span], chunk_logprobs).sum()
        totals.append(terms.detach().double())
        return scaled(terms)

    engine.run(seed)
    return torch.stack(totals).sum() if totals else torch.zeros((), dtype=torch.float64, device=out.device)


def _run_linearised_loss(engine: _Engine, loss_fn, scaled) -> torch.Tensor:
    """Two passes for any other loss: every logprob, then ``sum(g * logprobs)`` with g the gradient of
    ``scaled(total)``."""
    pairs = engine.pairs
    start = engine.rng_state()
    engine.run_forward_only()
    total, g = _linearised_loss(loss_fn, engine.tree, engine.out, scaled)
    after = engine.rng_state()  # past the forward's draws and loss_fn's own, as per-sequence training leaves it
    start.restore()  # the second pass draws the first's dropout masks: g is the gradient at its forward

    def seed(span, chunk_logprobs):
        return (g[pairs.seq[span], pairs.step[span]].to(chunk_logprobs.dtype) * chunk_logprobs).sum()

    engine.run(seed)
    after.restore()
    return total


def _linearised_loss(loss_fn, tree: PrefixTree, logprobs: torch.Tensor, scaled):
    """The total of a generic ``loss_fn`` and g = d scaled(total) / d logprobs [N, Lmax-1].

    Every term is evaluated on a leaf copy of its logprobs and the total gets
    one ``backward``: it gives g, and any part of a term that depends on
    parameters (or other tensors) directly lands in their ``.grad`` as it
    would in per-sequence training; the chunked pass then adds
    ``sum(g * logprobs)``'s gradient.
    """
    leaves, terms = [], []
    for i, n in enumerate((tree.lengths - 1).tolist()):
        lp_i = logprobs[i, :n].detach().clone().requires_grad_(True)
        term = loss_fn(i, lp_i.clone())  # not the leaf itself: a loss may change its argument in place
        if not isinstance(term, torch.Tensor) or term.numel() != 1 or term.is_complex():
            what = f"a {term.dtype} tensor of shape {tuple(term.shape)}" if isinstance(term, torch.Tensor) else type(term).__name__
            raise ValueError(f"loss_fn must return a real scalar tensor; for sequence {i} it returned {what}")
        leaves.append(lp_i)
        terms.append(term.reshape(()))
    differentiable = [t for t in terms if t.requires_grad]
    if differentiable:
        with torch.autocast(logprobs.device.type, enabled=False):  # as above: not under a caller's autocast
            torch.autograd.backward([scaled(t) for t in differentiable])
    g = torch.zeros_like(logprobs)
    for i, lp_i in enumerate(leaves):
        if lp_i.grad is not None:
            g[i, : lp_i.numel()] = lp_i.grad
    total = torch.stack([t.detach().double().to(logprobs.device) for t in terms]).sum()
    return total, g
