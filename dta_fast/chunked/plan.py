"""The plan of a depth-first chunked step: which tokens each chunk holds, in which order the chunks run
forward and close, and what each chunk's cached prefix is (docs/chunked_execution.md, "The plan").

Built once per step from the forest's arrays (:class:`Forest`) with array operations; the memory model
(memory.py) and the engine (engine.py) read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple

import numpy as np

from dta_ref.tree import PrefixTree


@dataclass(frozen=True)
class Forest:
    """The size-independent arrays of a forest that planning reads (CPU, int64)."""

    end: np.ndarray  # [T] subtree_end
    depth: np.ndarray  # [T] position_ids: the number of ancestors
    parent: np.ndarray  # [T] -1 at a root
    run_start: np.ndarray  # [T] first token of the parent-child chain ending at i

    @classmethod
    def of(cls, tree: PrefixTree) -> Forest:
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


@dataclass(frozen=True)
class PrefixPieces:
    """Every chunk's cached prefix as pieces of open chunks: chunk c's are entries ``ptr[c] : ptr[c + 1]``
    of ``owner``, ``lo`` and ``hi`` (chunk-local token ranges), in packed order."""

    ptr: np.ndarray  # [C + 1]
    owner: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def of(self, c: int) -> list[PrefixPiece]:
        a, b = self.ptr[c], self.ptr[c + 1]
        return [
            PrefixPiece(*piece) for piece in zip(self.owner[a:b].tolist(), self.lo[a:b].tolist(), self.hi[a:b].tolist())
        ]


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
    pieces: PrefixPieces | None  # every chunk's cached prefix (None: planned without, for the estimate alone)
    logits_rows: int | None = None  # rows of the vocabulary head's logits window (None: the default)
    checkpoint_layers: bool = False  # every layer runs under activation checkpointing (ours or the model's)
    forest: Forest | None = field(default=None, repr=False, compare=False)  # what it chunks

    @cached_property
    def exported_held(self) -> np.ndarray:
        """[C] exported tokens of the open chunks, its own included, taken when the chunk closes: tokens with a
        child in a later chunk, whose recurrent state a linear-attention layer keeps for that chunk."""
        parent, C = self.forest.parent, self.num_chunks
        chunk_of = np.searchsorted(self.stop, np.arange(parent.size), side="right")
        crossing = (parent >= 0) & (chunk_of[np.maximum(parent, 0)] != chunk_of)
        exported = np.zeros(parent.size, dtype=bool)
        exported[parent[crossing]] = True
        own = np.bincount(chunk_of[exported], minlength=C)
        held, stack = np.zeros(C, dtype=np.int64), []  # (chunk, its running total) of the open chunks
        for c in range(C):
            while stack and self.max_end[stack[-1][0]] <= self.start[c]:
                stack.pop()
            held[c] = own[c] + (stack[-1][1] if stack else 0)
            stack.append((c, int(held[c])))
        return held

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
        return self.pieces.of(c)


def plan_chunks(
    tree: PrefixTree | Forest,
    size: int,
    recompute: bool = False,
    with_prefix: bool = True,
    logits_rows: int | None = None,
    checkpoint_layers: bool = False,
) -> ChunkPlan:
    """Chunks of at most ``size`` tokens and their facts (docs/chunked_execution.md, "Where chunks stop").

    A chunk runs on while its tokens' subtrees stay within the ``max_end``
    of the open chunk under it, so open chunks never hold older ones open
    longer than their own tokens need. With ``recompute``, chunks that stay
    open pay a second forward, so chunk ends move where that costs least
    (:func:`_recompute_friendly_length`).
    """
    forest = tree if isinstance(tree, Forest) else Forest.of(tree)
    facts = _chunk_bounds(forest, size, recompute)  # start, stop, max_end, held, saved, graded, steps, ...
    start, stop = facts["start"], facts["stop"]
    plan = ChunkPlan(
        size=size,
        recompute=recompute,
        prefix_tokens=forest.depth[start],
        keeps_graph=(facts["max_end"] <= stop) | (not recompute),
        **facts,
        pieces=None,
        logits_rows=logits_rows,
        checkpoint_layers=checkpoint_layers,
        forest=forest,
    )
    return with_prefix_pieces(forest, plan) if with_prefix else plan


def with_prefix_pieces(forest: Forest, plan: ChunkPlan) -> ChunkPlan:
    """``plan`` with its prefix pieces (the engine needs them; the memory estimate does not)."""
    if plan.pieces is not None:
        return plan
    return replace(plan, pieces=_prefix_pieces(forest, plan.start, plan.stop))


def _chunk_bounds(forest: Forest, size: int, recompute: bool):
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


def _recompute_friendly_length(forest: Forest, a: int, n: int) -> int:
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


def _max_end(forest: Forest, a: int, b: int) -> int:
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


def _prefix_pieces(forest: Forest, start: np.ndarray, stop: np.ndarray):
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
        return PrefixPieces(np.zeros(C + 1, dtype=np.int64), empty, empty, empty)
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
    return PrefixPieces(ptr, owner, lo - start[owner], hi - start[owner])
