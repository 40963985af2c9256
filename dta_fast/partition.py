"""Split a rollout batch across data-parallel ranks, balancing prefix-tree cost.

Every rank trains on the prefix tree of its own sequences, so a rank's work is
the cost of that tree, not the sum of its sequences' lengths: rollouts that
share a prompt are cheap together and expensive apart. :func:`partition`
gives every sequence to one rank so that the most expensive rank is as cheap
as it can make it under a :class:`CostModel`, keeping prefixes together where
that does not hurt the balance.

Cost of a set S of sequences, the cost of its own prefix tree::

    cost(S) = token * unique_tokens + pair * attention_pairs + sequence * |S| + constant
    attention_pairs = sum_j (subtree_end[j] - j) = sum_i (position_ids[i] + 1)

(the query-key pairs tree attention computes: each token attends to itself
and its ancestors). An empty S costs 0.

How shard costs are computed without building a trie per shard. Sort the
batch lexicographically (this is the preorder of the sequences' last tokens)
and record ``lcp[p]``, the common prefix length of sequences p-1 and p. For a
subset S listed in that order, its distinct prefixes are the tokens of its
tree, so ``unique_tokens(S) = sum len - sum lcp(consecutive members)`` and
``attention_pairs(S) = sum tri(len) - sum tri(lcp(consecutive members))``
with ``tri(x) = x (x + 1) / 2``; the common prefix of two non-adjacent
sequences is the minimum of ``lcp`` between them (a sparse-table range
minimum). A shard's cost is O(|S|) numpy work, exact.

The algorithm:

1. Pieces. Each tree of the forest (the sequences of one first token) is a
   piece. A piece that costs more than ``slack * cost(batch) / world_size``
   is split at the first node below its shared ancestor chain where it
   branches: one piece per child subtree, the sequences that end on the chain
   itself joining the first child's piece. Split pieces are split again while
   they are too expensive. A piece duplicates only its ancestor chain. A chain
   of sequences that are prefixes of one another (and repeats) is never split.
   Coarse pieces share more, fine pieces balance better, and neither wins
   everywhere, so LPT runs once per slack in ``SLACKS`` and keeps its best run.
2. Candidates, each scored by its true maximum shard cost (pieces of one tree
   on one rank share their ancestors again):

   - ``"lpt"``: longest processing time first: the most expensive piece first,
     each onto the rank where the resulting shard costs least. That is the
     least-loaded rank, unless a rank holding part of the same tree shares
     enough of the piece's ancestors to end lower.
   - ``"dfs_contiguous"``: the sequences in preorder cut into at most
     ``world_size`` contiguous runs, with the smallest maximum run cost found
     by bisection on a threshold (greedy filling is optimal for a fixed
     threshold because a run's cost grows with the run). Cutting single
     sequences rather than pieces includes every cut between pieces. Ranks
     left empty get a cut of the most expensive run.
   - ``"token_greedy"``: the tree-unaware baseline: single sequences, longest
     first, each onto the rank with the fewest flat tokens.

3. The candidate with the smallest maximum cost wins (ties: smaller total,
   then the order above).

Guarantees (tested): with ``piece_costs`` the cost of each piece of the
reported LPT run alone,
``candidates["lpt"] <= sum(piece_costs) / world_size + max(piece_costs)``
(a piece lands no higher than on the least-loaded rank, whose load is at most
the mean). When no tree was split, pieces share nothing, so
``sum(piece_costs) = cost(batch) + (len(pieces) - 1) * constant``, the rule
above is classic LPT, and LPT is within ``4/3 - 1/(3 world_size)`` of the
best assignment of those pieces.

Limits: whole sequences are assigned (no sequence is cut across ranks); the
cost model is linear and does not see memory; the splitting rule only cuts
at branch points, so the balance of one huge unbranched chain cannot improve.
"""

from __future__ import annotations

import bisect
import itertools
import math
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from dta_ref.checks import as_float, check_int
from dta_ref.tree import PrefixTree

from .sorted_batch import SortedBatch, TreeStats, token_arrays, tri

__all__ = ["CostModel", "Partition", "TreeStats", "partition", "tree_stats"]

METHODS = ("lpt", "dfs_contiguous", "token_greedy")
# LPT runs once per slack (pieces split while dearer than slack * cost(batch) / world_size); ties go to the first.
SLACKS = (1.0, 0.75, 1.5, 0.5, 2.0)

# The default cost model: a 1.5B-parameter decoder of 28 layers with 16 query heads of 128.
DEFAULT_NUM_PARAMS = 1.5e9
DEFAULT_NUM_LAYERS = 28
DEFAULT_NUM_HEADS = 16
DEFAULT_HEAD_DIM = 128


def _pair_weight(num_params, num_layers, num_heads, head_dim) -> float:
    """Attention flops per query-key pair over dense flops per token, both forward + backward."""
    return 12.0 * head_dim * num_heads * num_layers / (6.0 * num_params)


# ------------------------------------------------------------------ statistics


def tree_stats(x) -> TreeStats:
    """:class:`TreeStats` of a batch given as token sequences, a :class:`~dta_ref.PrefixTree` or a TreeStats."""
    if isinstance(x, TreeStats):
        return x.checked()
    if isinstance(x, PrefixTree):
        span = x.subtree_end - torch.arange(x.num_tokens, device=x.subtree_end.device)
        return TreeStats(x.num_tokens, int(span.sum()), x.num_sequences)
    batch = SortedBatch(token_arrays(x))
    return batch.stats(np.arange(batch.n))


# ------------------------------------------------------------------ cost model


@dataclass(frozen=True)
class CostModel:
    """Predicted cost of training on one prefix tree::

        token * unique_tokens + pair * attention_pairs + sequence * num_sequences + constant

    All coefficients are finite and non-negative, not all zero. The default
    counts cost in tokens of dense work (``token = 1``) for a 1.5B-parameter,
    28-layer model with 16 heads of 128 (:meth:`for_model`): one attention
    pair costs ``12 * 128 * 16 * 28 / (6 * 1.5e9) = 7.6e-5`` tokens, so
    attention equals the dense work of a token at depth ~13K. ``sequence``
    (per-sequence work such as the loss) and ``constant`` (per-shard overhead)
    default to 0; :meth:`fit` measures all four.
    """

    token: float = 1.0
    pair: float = _pair_weight(DEFAULT_NUM_PARAMS, DEFAULT_NUM_LAYERS, DEFAULT_NUM_HEADS, DEFAULT_HEAD_DIM)
    sequence: float = 0.0
    constant: float = 0.0

    def __post_init__(self):
        for name in ("token", "pair", "sequence", "constant"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(f"CostModel.{name} must be a number, got {type(value).__name__}")
            value = as_float(value)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{name} must be finite and non-negative, got {value}")
            object.__setattr__(self, name, value)
        if self.token == self.pair == self.sequence == self.constant == 0:
            raise ValueError("CostModel needs at least one positive coefficient")

    @classmethod
    def for_model(
        cls,
        num_params: float,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        sequence: float = 0.0,
        constant: float = 0.0,
    ) -> CostModel:
        """Costs in tokens of dense work for a decoder of this shape.

        A token costs ``6 * num_params`` flops forward + backward; an attention
        pair costs ``4 * head_dim * num_heads`` flops per layer forward (QK^T
        and PV) and about three times that forward + backward, so::

            pair = 12 * head_dim * num_heads * num_layers / (6 * num_params)

        ``num_heads`` counts query heads; ``num_params`` is the matmul
        parameters a token passes through (include the output head, leave out
        the embedding table).
        """
        for name, value in (
            ("num_params", num_params),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("head_dim", head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(as_float(value)) or value <= 0:
                raise ValueError(f"{name} must be finite and positive, got {value}")
        return cls(1.0, _pair_weight(num_params, num_layers, num_heads, head_dim), sequence, constant)

    def of_stats(self, stats: TreeStats) -> float:
        """The cost of a tree with these statistics (0 for no sequences)."""
        if stats.num_sequences == 0:
            return 0.0
        return (
            self.token * stats.unique_tokens
            + self.pair * stats.attention_pairs
            + self.sequence * stats.num_sequences
            + self.constant
        )

    def cost(self, x) -> float:
        """The cost of the prefix tree of ``x``: token sequences, a PrefixTree or TreeStats."""
        return self.of_stats(tree_stats(x))

    @classmethod
    def fit(cls, samples) -> CostModel:
        """Fit the four coefficients to measured times by non-negative least squares.

        ``samples`` is an iterable of ``(batch, seconds)`` pairs; ``batch`` is
        anything :func:`tree_stats` takes. Solves
        ``min ||A c - seconds||, c >= 0`` with rows ``[unique_tokens,
        attention_pairs, num_sequences, 1]`` (scipy.optimize.nnls when scipy
        is installed, else an exact numpy solver). The result predicts seconds.
        """
        rows, times = [], []
        for k, sample in enumerate(samples):
            if not isinstance(sample, (tuple, list)) or len(sample) != 2:
                raise TypeError(f"sample {k}: expected a (batch, seconds) pair, got {type(sample).__name__}")
            batch, seconds = sample
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.integer, np.floating)):
                raise TypeError(f"sample {k}: seconds must be a number, got {type(seconds).__name__}")
            if not math.isfinite(as_float(seconds)) or seconds < 0:
                raise ValueError(f"sample {k}: seconds must be finite and non-negative, got {seconds}")
            try:
                s = tree_stats(batch)
            except (TypeError, ValueError) as e:
                raise type(e)(f"sample {k}: {e}") from e
            rows.append([s.unique_tokens, s.attention_pairs, s.num_sequences, 1.0])
            times.append(float(seconds))
        if not rows:
            raise ValueError("CostModel.fit needs at least one (batch, seconds) sample")
        A = np.array(rows, dtype=np.float64)  # [S, 4]
        y = np.array(times, dtype=np.float64)  # [S]
        scale = np.abs(A).max(axis=0)
        scale[scale == 0] = 1.0
        coef = _nnls(A / scale, y) / scale
        if not np.any(coef > 0):
            raise ValueError("CostModel.fit: the best non-negative fit is all zeros (are all times zero?)")
        return cls(*coef.tolist())


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    try:
        from scipy.optimize import nnls
    except ImportError:
        return nnls_numpy(A, y)
    return nnls(A, y)[0]


def nnls_numpy(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact NNLS for a few columns: the least-squares fit on every support, the best non-negative one.

    The optimum is the unconstrained fit on its support, and some optimum
    has linearly independent support columns, so trying all 2^k supports
    (smallest first, so ties keep the sparser fit) finds it.
    """
    k = A.shape[1]
    if k > 12:
        raise ValueError(f"nnls_numpy tries every support: {k} columns is too many")
    best = np.zeros(k)
    best_res = float(y @ y)
    for mask in sorted(range(1, 1 << k), key=lambda m: (m.bit_count(), m)):
        cols = [c for c in range(k) if mask >> c & 1]
        sol = np.linalg.lstsq(A[:, cols], y, rcond=None)[0]
        if np.any(sol < 0):
            continue
        r = A[:, cols] @ sol - y
        res = float(r @ r)
        if res < best_res * (1 - 1e-12) - 1e-300:
            best = np.zeros(k)
            best[cols] = sol
            best_res = res
    return best


# ------------------------------------------------------------------ the partition


@dataclass(frozen=True, eq=False)
class Partition:
    """Which sequences each rank trains on, and what that is predicted to cost.

    shards[r]         sorted input indices of rank r's sequences (may be empty)
    costs[r]          predicted cost of rank r's own prefix tree (0 when empty)
    unique_tokens[r]  tokens of rank r's prefix tree
    flat_tokens[r]    sum of rank r's sequence lengths
    compression[r]    flat_tokens / unique_tokens (1.0 for an empty shard)
    method            the candidate used: "lpt", "dfs_contiguous" or "token_greedy" (the
                      winner, unless partition() was asked for one)
    balance           max(costs) / mean(costs), the mean over all ranks
    lower_bound       max(cost(batch) / world_size, max cost of one sequence alone): no
                      assignment of whole sequences has a smaller maximum, because shard
                      costs add up to at least the whole batch's cost (a union of trees
                      shares tokens, never adds any) and the shard holding the most
                      expensive sequence costs at least that sequence's own tree
    candidates        method -> its maximum shard cost
    pieces            the units the best LPT run assigned (sorted input indices), in preorder
    piece_costs       cost of each piece alone
    piece_target      the cost above which that run split a piece (slack * cost(batch) / world_size)
    """

    shards: list[list[int]]
    costs: list[float]
    unique_tokens: list[int]
    flat_tokens: list[int]
    compression: list[float]
    method: str
    balance: float
    lower_bound: float
    candidates: dict[str, float]
    pieces: list[list[int]]
    piece_costs: list[float]
    piece_target: float
    cost_model: CostModel = field(repr=False)

    @property
    def world_size(self) -> int:
        return len(self.shards)

    @property
    def max_cost(self) -> float:
        return max(self.costs)

    def __repr__(self) -> str:
        return (
            f"Partition(world_size={self.world_size}, method={self.method!r}, max_cost={self.max_cost:.6g}, "
            f"balance={self.balance:.4f}, lower_bound={self.lower_bound:.6g}, "
            f"candidates={{{', '.join(f'{k!r}: {v:.6g}' for k, v in self.candidates.items())}}})"
        )


def split_pieces(batch: SortedBatch, model: CostModel, target: float) -> list[tuple[int, int]]:
    """Runs of positions, in preorder: whole trees, split at branch points while dearer than ``target``."""
    pieces: list[tuple[int, int]] = []
    tree_starts = np.flatnonzero(batch.lcp == 0).tolist() + [batch.n]
    stack = [(a, b - 1) for a, b in itertools.pairwise(tree_starts)][::-1]
    while stack:
        i, j = stack.pop()
        children = None
        if j > i and model.of_stats(batch.run_stats(i, j)) > target:
            children = batch.children(i, j)
        if children is None:
            pieces.append((i, j))
        else:
            stack.extend(reversed(children))
    return pieces


def lpt_shards(
    batch: SortedBatch, model: CostModel, pieces, piece_costs, world_size
) -> tuple[list[np.ndarray], list[float]]:
    """Most expensive piece first, each onto the rank where the resulting shard costs least.

    Without sharing that is the least-loaded rank (classic LPT); a rank that
    already holds part of the piece's tree may win because it shares the
    ancestors. Either way the chosen rank ends at most at the least-loaded
    rank's load plus the piece's cost, which is what LPT's bound needs.
    Returns the shards (positions) and their costs as tracked on the way.
    """
    loads = [0.0] * world_size
    starts: list[list[int]] = [[] for _ in range(world_size)]  # sorted run starts per rank
    ends: list[list[int]] = [[] for _ in range(world_size)]
    holders: dict[int, list[int]] = {}  # tree -> ranks holding some of it
    tree_of = batch.tree_of

    def shared(g):
        return model.token * g + model.pair * (g * (g + 1) // 2)

    for k in sorted(range(len(pieces)), key=lambda k: -piece_costs[k]):
        i, j = pieces[k]
        tree = int(tree_of[i])
        best = min(range(world_size), key=loads.__getitem__)
        best_load = loads[best] + piece_costs[k] - (model.constant if starts[best] else 0.0)
        for r in holders.get(tree, ()):
            at = bisect.bisect_left(starts[r], i)
            before = ends[r][at - 1] if at > 0 else None
            after = starts[r][at] if at < len(starts[r]) else None
            gain = 0.0
            if before is not None:
                gain += shared(batch.common(before, i))
            if after is not None:
                gain += shared(batch.common(j, after))
            if before is not None and after is not None:
                gain -= shared(batch.common(before, after))
            load = loads[r] + piece_costs[k] - model.constant - gain
            if load < best_load or (load == best_load and r < best):
                best, best_load = r, load
        at = bisect.bisect_left(starts[best], i)
        starts[best].insert(at, i)
        ends[best].insert(at, j)
        loads[best] = best_load
        if best not in holders.setdefault(tree, []):
            holders[tree].append(best)
    shards = [
        np.concatenate([np.arange(a, b + 1) for a, b in zip(starts[r], ends[r])])
        if starts[r]
        else np.zeros(0, dtype=np.int64)
        for r in range(world_size)
    ]
    return shards, loads


def token_greedy_shards(batch: SortedBatch, world_size) -> list[np.ndarray]:
    """The tree-unaware baseline: longest sequence first, each onto the rank with the fewest flat tokens."""
    loads = np.zeros(world_size, dtype=np.int64)
    owner = np.empty(batch.n, dtype=np.int64)
    for p in np.lexsort((batch.order, -batch.length)).tolist():
        r = int(np.argmin(loads))
        owner[p] = r
        loads[r] += batch.length[p]
    return [np.flatnonzero(owner == r) for r in range(world_size)]


def dfs_contiguous_shards(batch: SortedBatch, model: CostModel, world_size) -> list[np.ndarray]:
    """The preorder cut into at most ``world_size`` contiguous runs of the smallest maximum cost, then idle
    ranks given a cut of the dearest run (positions per rank)."""
    n = batch.n
    length, lcp = batch.length.astype(np.float64), batch.lcp.astype(np.float64)
    added = model.token * (length - lcp) + model.pair * (tri(length) - tri(lcp)) + model.sequence
    cum = np.cumsum(added)  # cost of run i..j = base[i] + cum[j]
    base = model.token * lcp + model.pair * tri(lcp) - np.concatenate([[0.0], cum[:-1]]) + model.constant

    def run_cost(i, j):
        return base[i] + cum[j]

    def fill(threshold):
        runs, i = [], 0
        while i < n:
            if len(runs) == world_size:
                return None
            j = int(np.searchsorted(cum, threshold - base[i], side="right")) - 1
            if j < i:
                return None
            runs.append((i, j))
            i = j + 1
        return runs

    lo = float((base + cum).max())  # below the dearest single sequence nothing fits
    runs = [(0, n - 1)]
    hi = float(run_cost(0, n - 1))
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        mid = 0.5 * (lo + hi)
        attempt = fill(mid)
        if attempt is None:
            lo = mid
        else:
            hi, runs = mid, attempt
    # idle ranks: cut the most expensive run where its larger half is smallest
    while len(runs) < world_size:
        splittable = [k for k, (i, j) in enumerate(runs) if j > i]
        if not splittable:
            break
        k = max(splittable, key=lambda k: run_cost(*runs[k]))
        i, j = runs[k]
        cut = np.arange(i, j)  # last position of the left half
        left = base[i] + cum[cut]
        right = base[cut + 1] + cum[j]
        c = int(cut[np.argmin(np.maximum(left, right))])
        runs[k : k + 1] = [(i, c), (c + 1, j)]
    shards = [np.arange(i, j + 1) for i, j in runs]
    shards += [np.zeros(0, dtype=np.int64)] * (world_size - len(shards))
    return shards


def _check_slacks(slack) -> tuple[float, ...]:
    if slack is None:
        return SLACKS
    values = tuple(slack) if isinstance(slack, (tuple, list)) else (slack,)
    if not values:
        raise ValueError("slack must be a number or a non-empty list of numbers")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"slack must be a number or a list of numbers, got {type(value).__name__}")
        if not (math.isfinite(as_float(value)) and value > 0):
            raise ValueError(f"slack must be finite and positive, got {value}")
    return tuple(float(v) for v in values)


def partition(
    sequences, world_size: int, cost_model: CostModel | None = None, *, slack=None, method: str = "best"
) -> Partition:
    """Assign every sequence of ``sequences`` to one of ``world_size`` ranks, minimising the maximum shard cost.

    ``sequences`` is what :meth:`dta_ref.PrefixTree.from_sequences` takes (token lists or
    1-D integer tensors/arrays, or one 2-D one), with at least ``world_size`` of them.
    ``cost_model`` defaults to ``CostModel()``. A piece costing more than ``slack``
    times the per-rank share ``cost(batch) / world_size`` is split at branch points
    (see the module docstring); ``slack`` is a number or a list of them, each tried
    with LPT, by default ``SLACKS``. ``method``: ``"best"`` keeps the candidate with
    the smallest maximum cost; one of ``METHODS`` forces that candidate (to compare
    them, e.g. in measured step time). Returns a :class:`Partition`.
    """
    world_size = check_int("world_size", world_size, 1)
    if cost_model is None:
        cost_model = CostModel()
    elif not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel or None, got {type(cost_model).__name__}")
    slacks = _check_slacks(slack)
    if method != "best" and method not in METHODS:
        raise ValueError(f"method must be 'best' or one of {METHODS}, got {method!r}")
    arrays = token_arrays(sequences)
    if world_size > len(arrays):
        raise ValueError(
            f"world_size={world_size} is more ranks than sequences ({len(arrays)}): sequences are not split, so "
            "some rank would surely have nothing to do"
        )
    batch = SortedBatch(arrays)
    model = cost_model
    n = batch.n
    total = model.of_stats(batch.run_stats(0, n - 1))
    # every cost below lies between a share (total / world_size) and world_size * total; out of float64's
    # normal range they overflow to inf or lose their digits, and the plan would be nonsense or a crash
    if not (math.isfinite(total * world_size) and total / world_size >= sys.float_info.min):
        raise ValueError(
            f"cost_model prices this batch at {total:.3g}, too large or too small to partition "
            f"over {world_size} ranks in float64: rescale its coefficients (e.g. to token=1)"
        )

    def score(shards):
        stats = [batch.stats(s) for s in shards]
        costs = [model.of_stats(s) for s in stats]
        return max(costs), sum(costs), shards, stats, costs

    lpt_runs = []
    for k, value in enumerate(slacks):
        target = value * total / world_size
        pieces = split_pieces(batch, model, target)
        piece_costs = [model.of_stats(batch.run_stats(i, j)) for i, j in pieces]
        shards = lpt_shards(batch, model, pieces, piece_costs, world_size)[0]
        lpt_runs.append((score(shards), k, target, pieces, piece_costs))
    lpt, _, target, pieces, piece_costs = min(lpt_runs, key=lambda run: (run[0][0], run[0][1], run[1]))
    scored = {
        "lpt": lpt,
        "dfs_contiguous": score(dfs_contiguous_shards(batch, model, world_size)),
        "token_greedy": score(token_greedy_shards(batch, world_size)),
    }
    if method == "best":
        method = min(METHODS, key=lambda m: (scored[m][0], scored[m][1], METHODS.index(m)))
    _, _, positions, stats, costs = scored[method]
    flat = [int(batch.length[s].sum()) for s in positions]
    mean = sum(costs) / world_size
    singles = model.token * batch.length + model.pair * tri(batch.length) + model.sequence + model.constant
    return Partition(
        shards=[np.sort(batch.order[s]).tolist() for s in positions],
        costs=costs,
        unique_tokens=[s.unique_tokens for s in stats],
        flat_tokens=flat,
        compression=[f / s.unique_tokens if s.unique_tokens else 1.0 for f, s in zip(flat, stats)],
        method=method,
        balance=max(costs) / mean,
        lower_bound=max(total / world_size, float(singles.max())),
        candidates={m: scored[m][0] for m in METHODS},
        pieces=[np.sort(batch.order[i : j + 1]).tolist() for i, j in pieces],
        piece_costs=piece_costs,
        piece_target=target,
        cost_model=model,
    )
