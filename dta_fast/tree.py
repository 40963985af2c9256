"""The prefix tree of a batch, built with numpy: the same PrefixTree as dta_ref, faster.

``PrefixTree.from_sequences`` inserts rollouts into a trie one token at a
time in Python, readable but slow for the millions of tokens of a training
batch. :func:`build_tree` gets the identical packing from a sort: order the
rollouts lexicographically and find ``lcp[p]``, the common prefix length of
neighbours p-1 and p (:class:`~dta_fast.sorted_batch.SortedBatch`, shared
with the partitioner). Then rollout p adds its tokens ``lcp[p]:`` to the
packed forest, in that order, and everything else is array arithmetic:

- a token's parent is the token before it, except the first new token of a
  rollout, whose parent is its predecessor's token at depth ``lcp[p] - 1``;
- a rollout's row of ``seq_index`` is its predecessor's up to ``lcp[p]`` and
  its own new tokens after;
- the subtree of the token at depth t added by rollout p ends where the
  first later rollout q with ``lcp[q] <= t`` starts adding tokens (found for
  all tokens at once by binary lifting over a range-minimum table of lcp).
"""

from __future__ import annotations

import numpy as np
import torch

from dta_ref.tree import PrefixTree

from .sorted_batch import SortedBatch, plain_token_arrays


def build_tree(sequences) -> PrefixTree:
    """``PrefixTree.from_sequences(sequences)``, computed with array operations: the same tensors.

    Accepts what the reference accepts (token lists, 1-D integer tensors or
    arrays, or one 2-D one) and raises the same errors: anything that is not
    plainly valid (an empty rollout, a float, a uint64 array, ...) goes to
    the reference builder, which builds it or names the problem.
    """
    arrays = plain_token_arrays(sequences)
    if arrays is None:
        return PrefixTree.from_sequences(sequences)
    batch = SortedBatch(arrays)
    n, order, lcp, sorted_length = batch.n, batch.order, batch.lcp, batch.length
    length = np.array([a.shape[0] for a in arrays], dtype=np.int64)
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

    subtree_end = start[batch.first_later_at_most(owner, depth)]
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
