"""The sorted batch: token sequences in lexicographic order, with their neighbours' common prefixes.

The tree builder (dta_fast.tree) and the partitioner (dta_fast.partition)
both start here. Sorted lexicographically, a batch lists its sequences in the
preorder of their last tokens in the prefix tree, and ``lcp[p]``, the common
prefix length of positions p-1 and p, says where each one branches off: the
common prefix of positions p < r is ``min(lcp[p+1 .. r])``, answered in O(1)
by a sparse table of range minima. docs/prefix_tree.md builds the tree from
these; dta_fast.partition's docstring derives a subset's tree statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dta_ref.tree import PrefixTree

# ------------------------------------------------------------------ token arrays


def _fast_array(seq) -> np.ndarray | None:
    """``seq`` as an int64 array when it is plainly valid; None sends it to PrefixTree's checks."""
    if isinstance(seq, torch.Tensor):
        if seq.dtype == torch.bool or seq.dtype.is_floating_point or seq.dtype.is_complex:
            return None
        if seq.dim() != 1 or seq.numel() == 0:
            return None
        arr = seq.detach().cpu().numpy()
        if arr.dtype == np.uint64:
            return None
        arr = arr.astype(np.int64, copy=False)
    elif isinstance(seq, np.ndarray):
        if not np.issubdtype(seq.dtype, np.integer) or seq.ndim != 1 or seq.size == 0 or seq.dtype == np.uint64:
            return None
        arr = seq.astype(np.int64, copy=False)
    elif isinstance(seq, Sequence) and not isinstance(seq, (str, bytes)):
        if len(seq) == 0:
            return None
        # bool is an int subclass but not a token id: exact types only, checked at C speed
        if not all(t is int or issubclass(t, np.integer) for t in set(map(type, seq))):
            return None
        try:
            arr = np.fromiter(seq, dtype=np.int64, count=len(seq))
        except (OverflowError, TypeError, ValueError):
            return None
    else:
        return None
    if arr.min() < 0:
        return None
    return arr


def plain_token_arrays(sequences) -> list[np.ndarray] | None:
    """One int64 array per sequence when the whole batch is plainly valid; None sends it to PrefixTree."""
    if isinstance(sequences, (torch.Tensor, np.ndarray)) and sequences.ndim == 2:
        sequences = list(sequences)
    if not isinstance(sequences, Sequence) or isinstance(sequences, (str, bytes)) or len(sequences) == 0:
        return None
    arrays = []
    for seq in sequences:
        arr = _fast_array(seq)
        if arr is None:
            return None
        arrays.append(arr)
    return arrays


def token_arrays(sequences) -> list[np.ndarray]:
    """Validate ``sequences`` as PrefixTree.from_sequences does and return one int64 array each."""
    arrays = plain_token_arrays(sequences)
    if arrays is not None:
        return arrays
    # Something is unusual: the reference builder either names the problem or accepts the batch.
    tree = PrefixTree.from_sequences(sequences)
    return [tree.sequence(i).numpy() for i in range(tree.num_sequences)]


# ------------------------------------------------------------------ the sort and its range minima


def sort_with_lcp(arrays: list[np.ndarray], lengths: list[int]) -> tuple[list[int], list[int]]:
    """Lexicographic order of ``arrays`` (equal ones in input order) and each one's common prefix length
    with its predecessor (0 for the first).

    Token ids are non-negative, so their big-endian bytes compare as the
    tokens do and a sequence's bytes start with those of each of its
    prefixes: Python's stable sort of the bytes orders the batch with
    ``memcmp``, in O(N log N) comparisons however the rollouts nest (a chain
    of multi-turn samples, each a prefix of the next, included). A
    neighbour's common prefix is then one numpy comparison.
    """
    width = ">u4" if max((int(a.max()) for a in arrays), default=0) < 2**32 else ">u8"
    keys = [a.astype(width).tobytes() for a in arrays]
    order = sorted(range(len(arrays)), key=keys.__getitem__)
    lcp = [0]
    for before, this in zip(order, order[1:]):
        end = min(lengths[before], lengths[this])
        diff = np.flatnonzero(arrays[this][:end] != arrays[before][:end])
        lcp.append(int(diff[0]) if diff.size else end)
    return order, lcp


def range_min_table(values: np.ndarray) -> np.ndarray:
    """Sparse table: ``table[j, q] = min(values[q : q + 2**j])`` for 2**j up to 2 * len(values), -1 for
    windows that run past the end; any range's minimum is that of two overlapping windows."""
    n = values.shape[0]
    levels = max(1, int(n).bit_length())
    table = np.full((levels + 1, n + 1 + (1 << levels)), -1, dtype=np.int64)
    table[0, :n] = values
    for j in range(1, levels + 1):
        half = 1 << (j - 1)
        table[j, :-half] = np.minimum(table[j - 1, :-half], table[j - 1, half:])
    return table


def tri(x):
    """``x (x + 1) / 2``: the attention pairs of a chain of x tokens (each sees itself and those before)."""
    return x * (x + 1) // 2


# ------------------------------------------------------------------ the record


@dataclass(frozen=True)
class TreeStats:
    """What a prefix tree costs to train: its unique tokens, attention pairs and sequences."""

    unique_tokens: int
    attention_pairs: int
    num_sequences: int

    def checked(self) -> TreeStats:
        """These counts as ints, or a clear error (for stats made by hand; the partitioner's are by
        construction)."""
        values = []
        for name in ("unique_tokens", "attention_pairs", "num_sequences"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"TreeStats.{name} must be an int, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"TreeStats.{name} must be non-negative, got {value}")
            values.append(int(value))
        return TreeStats(*values)


class SortedBatch:
    """The batch in lexicographic order (the preorder of the sequences' last tokens).

    Position p is the p-th sequence in that order and ``order[p]`` its index
    in the input; ``lcp[p]`` is its common prefix length with position p-1
    (0 at p = 0, and 0 exactly where a new tree starts). The common prefix of
    positions p < r is ``min(lcp[p+1 .. r])``.
    """

    def __init__(self, arrays: list[np.ndarray]):
        lengths = [int(a.shape[0]) for a in arrays]
        order, lcp = sort_with_lcp(arrays, lengths)
        self.n = len(arrays)
        self.order = np.asarray(order, dtype=np.int64)  # [N] input index
        self.length = np.asarray(lengths, dtype=np.int64)[self.order]  # [N]
        self.lcp = np.asarray(lcp, dtype=np.int64)  # [N]
        # [k, p] = min(lcp[p : p + 2^k]); -1 past the end, where a sequence would close every subtree
        self._table = range_min_table(self.lcp)
        self._log2 = np.zeros(self.n + 1, dtype=np.int64)  # [w] = floor(log2(w)), exact for integers
        self._log2[1:] = np.frexp(np.arange(1, self.n + 1))[1] - 1
        # contiguous runs: tokens and pairs each position adds after its predecessor
        self._cum_tokens = np.cumsum(self.length - self.lcp)
        self._cum_pairs = np.cumsum(tri(self.length) - tri(self.lcp))
        self.tree_of = np.cumsum(self.lcp == 0) - 1  # [N] which tree (first token) each position is in

    def common(self, p: int, r: int) -> int:
        """Common prefix length of positions p < r."""
        k = int(self._log2[r - p])
        return int(min(self._table[k, p + 1], self._table[k, r - (1 << k) + 1]))

    def range_min(self, lo, hi):
        """min(lcp[lo .. hi]) (inclusive, lo <= hi), for scalars or arrays."""
        k = self._log2[np.asarray(hi) - np.asarray(lo) + 1]
        return np.minimum(self._table[k, lo], self._table[k, np.asarray(hi) - (1 << k) + 1])

    def first_later_at_most(self, after: np.ndarray, limit: np.ndarray) -> np.ndarray:
        """For each k: the smallest position q > after[k] with lcp[q] <= limit[k], or n if there is none.

        Binary lifting: from q = after + 1, jump 2^j ahead whenever all of the
        next 2^j lcp values exceed the limit, largest jumps first.
        """
        q = after + 1
        for j in range(self._table.shape[0] - 1, -1, -1):
            jump = self._table[j, q] > limit
            q = q + np.where(jump, 1 << j, 0)
        return q

    def stats(self, positions: np.ndarray) -> TreeStats:
        """Stats of the tree of the sequences at ``positions`` (sorted, distinct)."""
        if positions.size == 0:
            return TreeStats(0, 0, 0)
        lens = self.length[positions]
        shared = self.range_min(positions[:-1] + 1, positions[1:]) if positions.size > 1 else lens[:0]
        return TreeStats(int(lens.sum() - shared.sum()), int(tri(lens).sum() - tri(shared).sum()), int(positions.size))

    def run_stats(self, i: int, j: int) -> TreeStats:
        """Stats of the contiguous run of positions i..j."""
        li = int(self.length[i])
        return TreeStats(
            li + int(self._cum_tokens[j] - self._cum_tokens[i]),
            int(tri(li)) + int(self._cum_pairs[j] - self._cum_pairs[i]),
            j - i + 1,
        )

    def children(self, i: int, j: int) -> list[tuple[int, int]] | None:
        """Split run i..j (one subtree) below its shared ancestor chain; None for a chain.

        Sequences that end on the chain come first in preorder and join the
        first child's run, so every run stays contiguous.
        """
        st = i
        while st < j:
            q = int(self.range_min(st + 1, j))
            if self.length[st] != q:
                break
            st += 1  # sequence st is the chain itself: a prefix of all after it
        if st == j:
            return None
        cuts = (np.flatnonzero(self.lcp[st + 1 : j + 1] == q) + st + 1).tolist()
        starts = [i] + cuts
        ends = [c - 1 for c in cuts] + [j]
        return list(zip(starts, ends))
