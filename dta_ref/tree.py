"""The rollout prefix tree, packed as a depth-first preorder forest.

All rollouts are inserted into a token trie; its unique tokens are packed in
depth-first preorder into one sequence. Every quantity the rest of the library
needs is an O(T) integer vector over that packed sequence (see docs/prefix_tree.md):

    tokens[i]        token id of packed position i
    position_ids[i]  depth of i = its position in every rollout that contains it
    parent[i]        packed index of the previous token on its path, -1 at a root
    subtree_end[i]   one past the last packed index below i (exclusive)
    seq_index[s, t]  packed index of token t of rollout s, -1 past its end

Query i may attend key j  <=>  j <= i < subtree_end[j].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def _as_token_list(seq, i: int) -> list[int]:
    """One rollout as a list of non-negative Python ints, with a clear error otherwise."""
    if isinstance(seq, torch.Tensor):
        if seq.dtype in (torch.bool,) or seq.dtype.is_floating_point or seq.dtype.is_complex:
            raise TypeError(f"sequence {i}: tokens must be integers, got a tensor of dtype {seq.dtype}")
        if seq.dim() != 1:
            raise ValueError(f"sequence {i}: expected a 1-D tensor of tokens, got shape {tuple(seq.shape)}")
        tokens = seq.tolist()
    elif isinstance(seq, np.ndarray):
        if not np.issubdtype(seq.dtype, np.integer):
            raise TypeError(f"sequence {i}: tokens must be integers, got an array of dtype {seq.dtype}")
        if seq.ndim != 1:
            raise ValueError(f"sequence {i}: expected a 1-D array of tokens, got shape {seq.shape}")
        tokens = seq.tolist()
    elif isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
        raise TypeError(f"sequence {i}: expected a list of ints or a 1-D integer tensor, got {type(seq).__name__}")
    else:
        tokens = list(seq)
        kinds = set(map(type, tokens))  # one pass in C; the checks below run per distinct type
        if kinds - {int}:
            for t in tokens:
                # bool is an int subclass but never a token id
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                    raise TypeError(f"sequence {i}: tokens must be ints, got {t!r} of type {type(t).__name__}")
            tokens = [int(t) for t in tokens]
    if len(tokens) == 0:
        raise ValueError(f"sequence {i} is empty: every rollout needs at least one token")
    if min(tokens) < 0:
        raise ValueError(f"sequence {i}: tokens must be non-negative, got {min(tokens)}")
    return tokens


@dataclass(frozen=True, eq=False)
class PrefixTree:
    """A batch of rollouts packed as a preorder forest of unique tokens.

    Build it with :meth:`from_sequences`. All tensors live on the CPU; move
    them with :meth:`to`.
    """

    tokens: torch.Tensor  # [T] long
    position_ids: torch.Tensor  # [T] long, depth
    parent: torch.Tensor  # [T] long, -1 at a root
    subtree_end: torch.Tensor  # [T] long, exclusive
    seq_index: torch.Tensor  # [N, Lmax] long, -1 past the end
    lengths: torch.Tensor  # [N] long

    @classmethod
    def from_sequences(cls, sequences) -> "PrefixTree":
        """Insert ``sequences`` (N >= 1 token lists or 1-D integer tensors/arrays, or one 2-D one) into a trie.

        Children are visited in increasing token order, so sorting the rollouts
        lexicographically and appending each one's suffix beyond its longest
        common prefix with the previous one yields exactly the preorder.
        """
        if isinstance(sequences, (torch.Tensor, np.ndarray)) and sequences.ndim == 2:
            sequences = list(sequences)
        if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence):
            raise TypeError(f"sequences must be a list of token sequences, got {type(sequences).__name__}")
        if len(sequences) == 0:
            raise ValueError("empty batch: at least one sequence is needed")
        seqs = [_as_token_list(s, i) for i, s in enumerate(sequences)]

        order = sorted(range(len(seqs)), key=lambda i: seqs[i])
        tokens: list[int] = []
        depth: list[int] = []
        parent: list[int] = []
        seq_index = [None] * len(seqs)
        path: list[int] = []  # packed indices of the previously inserted rollout
        prev: list[int] = []
        for i in order:
            s = seqs[i]
            limit = min(len(s), len(prev))
            differ = np.flatnonzero(np.asarray(s[:limit]) != np.asarray(prev[:limit]))
            lcp = int(differ[0]) if differ.size else limit  # longest common prefix with prev
            del path[lcp:]
            for t in range(lcp, len(s)):
                parent.append(path[-1] if path else -1)
                path.append(len(tokens))
                tokens.append(s[t])
                depth.append(t)
            seq_index[i] = path[: len(s)]
            prev = s

        # The subtree of j ends at the first later token that is not deeper than j.
        T = len(tokens)
        subtree_end = [T] * T
        open_nodes: list[int] = []
        for k in range(T):
            while open_nodes and depth[open_nodes[-1]] >= depth[k]:
                subtree_end[open_nodes.pop()] = k
            open_nodes.append(k)

        lengths = [len(s) for s in seqs]
        index = np.full((len(seqs), max(lengths)), -1, dtype=np.int64)
        for i, row in enumerate(seq_index):
            index[i, : len(row)] = row

        def as_tensor(values):  # through numpy: much faster than torch.tensor on long lists
            return torch.from_numpy(np.asarray(values, dtype=np.int64))

        return cls(
            tokens=as_tensor(tokens),
            position_ids=as_tensor(depth),
            parent=as_tensor(parent),
            subtree_end=as_tensor(subtree_end),
            seq_index=torch.from_numpy(index),
            lengths=as_tensor(lengths),
        )

    @classmethod
    def from_padded(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> "PrefixTree":
        """The tree of a padded batch [B, L]: row i's tokens are those where ``attention_mask`` is 1.

        Left, right or mixed padding; each row's tokens must be one contiguous
        run. The same tree as :meth:`from_sequences` on the unpadded rows, in
        row order. :class:`dta_ref.padded.PaddedLayout` moves per-token tensors
        between the padded layout and the tree's.
        """
        from .padded import PaddedLayout

        return cls.from_sequences(PaddedLayout.of(attention_mask).sequences(input_ids))

    @property
    def num_sequences(self) -> int:
        return self.seq_index.shape[0]

    @property
    def num_tokens(self) -> int:
        """T, the number of unique (packed) tokens."""
        return self.tokens.shape[0]

    @property
    def flat_tokens(self) -> int:
        """Sum of the rollouts' lengths: what per-sequence training computes."""
        return int(self.lengths.sum())

    @property
    def compression_ratio(self) -> float:
        return self.flat_tokens / self.num_tokens

    @property
    def max_length(self) -> int:
        return self.seq_index.shape[1]

    @property
    def logprob_mask(self) -> torch.Tensor:
        """bool [N, Lmax-1]: True where a next-token logprob exists (t < len - 1)."""
        t = torch.arange(self.max_length - 1)
        return t[None, :] < (self.lengths[:, None] - 1)

    def sequence(self, i: int) -> torch.Tensor:
        """Tokens of rollout i, read back from the packed tree."""
        return self.tokens[self.seq_index[i, : int(self.lengths[i])]]

    def to(self, device) -> "PrefixTree":
        return PrefixTree(**{name: getattr(self, name).to(device) for name in self.__dataclass_fields__})

    def __repr__(self) -> str:
        return (
            f"PrefixTree(num_sequences={self.num_sequences}, num_tokens={self.num_tokens}, "
            f"flat_tokens={self.flat_tokens}, compression_ratio={self.compression_ratio:.2f})"
        )
