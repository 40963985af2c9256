"""The prefix tree of a batch, built with numpy: the same PrefixTree as dta_ref, faster.

``PrefixTree.from_sequences`` inserts rollouts into a trie one token at a
time in Python, readable but slow for the millions of tokens of a training
batch. :func:`build_tree` gets the identical packing from a sort: order the
rollouts lexicographically and find ``lcp[p]``, the common prefix length of
neighbours p-1 and p (``_sort_with_lcp``, shared with the partitioner). Then
rollout p adds its tokens ``lcp[p]:`` to the packed forest, in that order,
and everything else is array arithmetic:

- a token's parent is the token before it, except the first new token of a
  rollout, whose parent is its predecessor's token at depth ``lcp[p] - 1``;
- a rollout's row of ``seq_index`` is its predecessor's up to ``lcp[p]`` and
  its own new tokens after;
- the subtree of the token at depth t added by rollout p ends where the
  first later rollout q with ``lcp[q] <= t`` starts adding tokens (found for
  all tokens at once by binary lifting over a range-minimum table of lcp).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dta_ref.tree import PrefixTree


def build_tree(sequences) -> PrefixTree:
    """``PrefixTree.from_sequences(sequences)``, computed with array operations: the same tensors.

    Accepts what the reference accepts (token lists, 1-D integer tensors or
    arrays, or one 2-D one) and raises the same errors: anything that is not
    plainly valid (an empty rollout, a float, a uint64 array, ...) goes to
    the reference builder, which builds it or names the problem.
    """
    arrays = _plain_token_arrays(sequences)
    if arrays is None:
        return PrefixTree.from_sequences(sequences)
    n = len(arrays)
    length = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    order, lcp = _sort_with_lcp(arrays, length.tolist())
    order, lcp = np.asarray(order, dtype=np.int64), np.asarray(lcp, dtype=np.int64)
    sorted_length = length[order]
    new = sorted_length - lcp  # tokens rollout p adds (0 for a repeat)
    start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(new, out=start[1:])  # rollout p adds packed tokens start[p] : start[p + 1]
    T = int(start[-1])
    tokens = np.concatenate([arrays[i][c:] for i, c in zip(order.tolist(), lcp.tolist())])
    owner = np.repeat(np.arange(n), new)  # the rollout that added each packed token
    depth = np.arange(T, dtype=np.int64) - start[owner] + lcp[owner]

    index = np.full((n, int(length.max())), -1, dtype=np.int64)  # seq_index rows in sorted order
    for p, (c, stop) in enumerate(zip(lcp.tolist(), sorted_length.tolist())):
        index[p, :c] = index[p - 1, :c]
        index[p, c:stop] = np.arange(start[p], start[p + 1])

    parent = np.arange(T, dtype=np.int64) - 1
    adds = np.flatnonzero(new)
    shared = lcp[adds] > 0
    parent[start[adds]] = np.where(shared, index[adds, np.maximum(lcp[adds] - 1, 0)], -1)

    subtree_end = start[_first_later_at_most(lcp, owner, depth)]
    seq_index = np.empty_like(index)
    seq_index[order] = index
    as_tensor = torch.from_numpy
    return PrefixTree(
        tokens=as_tensor(tokens.astype(np.int64, copy=False)),
        position_ids=as_tensor(depth),
        parent=as_tensor(parent),
        subtree_end=as_tensor(subtree_end),
        seq_index=as_tensor(seq_index),
        lengths=as_tensor(length),
    )._mark_valid()


def _first_later_at_most(lcp: np.ndarray, after: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """For each k: the smallest q > after[k] with lcp[q] <= limit[k], or len(lcp) if there is none.

    Binary lifting: from q = after + 1, jump 2^j ahead whenever all of the
    next 2^j lcp values exceed the limit, largest jumps first.
    """
    table = _range_min_table(lcp)  # past the end -1: a rollout there would close every subtree
    q = after + 1
    for j in range(table.shape[0] - 1, -1, -1):
        jump = table[j, q] > limit
        q = q + np.where(jump, 1 << j, 0)
    return q


def _range_min_table(values: np.ndarray) -> np.ndarray:
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


# ------------------------------------------------------------------ the sorted batch


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


def _plain_token_arrays(sequences) -> list[np.ndarray] | None:
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


def _token_arrays(sequences) -> list[np.ndarray]:
    """Validate ``sequences`` as PrefixTree.from_sequences does and return one int64 array each."""
    arrays = _plain_token_arrays(sequences)
    if arrays is not None:
        return arrays
    # Something is unusual: the reference builder either names the problem or accepts the batch.
    tree = PrefixTree.from_sequences(sequences)
    return [tree.sequence(i).numpy() for i in range(tree.num_sequences)]


def _sort_with_lcp(arrays: list[np.ndarray], lengths: list[int]) -> tuple[list[int], list[int]]:
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
