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
    if max(tokens) > MAX_TOKEN_ID:
        raise ValueError(f"sequence {i}: token id {max(tokens)} does not fit int64 (at most {MAX_TOKEN_ID})")
    return tokens


MAX_TOKEN_ID = 2**63 - 1


def nesting_depth(subtree_end: torch.Tensor) -> torch.Tensor:
    """Depths [B, T] of the preorder forests whose subtree ends are ``subtree_end`` [B, T]; ValueError if none.

    Needs j < end[j] <= T and properly nested ranges. With c[i] the number of
    ranges covering i (its depth + 1), nested ranges are exactly "end[j] is the
    first k > j with c[k] <= c[j]", which is checked with a range-minimum table.
    """
    B, T = subtree_end.shape
    j = torch.arange(T, device=subtree_end.device)
    if bool((subtree_end <= j).any()):
        bad = (subtree_end <= j).nonzero()[0].tolist()
        raise ValueError(f"subtree_end[{bad[-1]}] = {int(subtree_end[tuple(bad)])} must be > its index {bad[-1]}")
    if bool((subtree_end > T).any()):
        bad = (subtree_end > T).nonzero()[0].tolist()
        raise ValueError(f"subtree_end[{bad[-1]}] = {int(subtree_end[tuple(bad)])} exceeds the number of keys {T}")
    end = subtree_end.long()
    diff = torch.zeros(B, T + 1, dtype=torch.long, device=end.device)
    diff[:, :T] += 1
    diff.scatter_add_(1, end, torch.full_like(end, -1))
    cover = diff.cumsum(1)  # [B, T + 1], cover[:, T] == 0
    # Sparse table of range minima over cover; levels[p][i] = min cover[i : i + 2**p].
    levels = [cover]
    while (1 << len(levels)) <= T:
        prev, half = levels[-1], 1 << (len(levels) - 1)
        levels.append(torch.minimum(prev[:, :-half], prev[:, half:]))
    lo, hi = j + 1, end  # open range (j, end[j]) must stay deeper than j
    length = (hi - lo).clamp(min=1)
    p = torch.floor(torch.log2(length.double())).long()
    inner_min = torch.full_like(end, torch.iinfo(torch.long).max)
    for level in range(len(levels)):
        sel = (p == level) & (hi > lo)
        if bool(sel.any()):
            table = levels[level]
            a = table.gather(1, lo.expand(B, T).clamp(max=table.shape[1] - 1))
            b = table.gather(1, (hi - (1 << level)).clamp(min=0, max=table.shape[1] - 1))
            inner_min = torch.where(sel, torch.minimum(a, b), inner_min)
    own = cover[:, :T]
    nested = (inner_min > own) & (cover.gather(1, end) <= own)
    if not bool(nested.all()):
        b, jj = (~nested).nonzero()[0].tolist()
        raise ValueError(
            f"subtree_end is not a preorder forest: the range [{jj}, {int(end[b, jj])}) of key {jj} "
            "crosses another key's range"
        )
    return own - 1


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
    def from_sequences(cls, sequences) -> PrefixTree:
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
        )._mark_valid()

    @classmethod
    def from_padded(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PrefixTree:
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
    def multiplicity(self) -> torch.Tensor:
        """long [T]: how many rollouts hold each packed token (a padded batch counts it that many times)."""
        index = self.seq_index[self.seq_index >= 0]
        return torch.bincount(index, minlength=self.num_tokens)

    @property
    def max_length(self) -> int:
        return self.seq_index.shape[1]

    @property
    def logprob_mask(self) -> torch.Tensor:
        """bool [N, Lmax-1]: True where a next-token logprob exists (t < len - 1)."""
        t = torch.arange(self.max_length - 1, device=self.lengths.device)
        return t[None, :] < (self.lengths[:, None] - 1)

    def response_mask(self, prompt_lengths) -> torch.Tensor:
        """bool [N, Lmax-1]: True where the scored token is a response token (position >= its prompt's length).

        The loss mask of RL training: the logprobs of prompt tokens are
        computed (they are next-token predictions too) but never trained on.
        """
        if isinstance(prompt_lengths, (list, tuple)) and any(isinstance(x, (bool, np.bool_)) for x in prompt_lengths):
            raise ValueError(f"prompt_lengths must be integers, got a bool in {list(prompt_lengths)[:8]}")
        try:
            prompt_lengths = torch.as_tensor(prompt_lengths, device=self.lengths.device)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"prompt_lengths must be {self.num_sequences} integers, got {prompt_lengths!r:.80}") from e
        dtype = prompt_lengths.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"prompt_lengths must be integers, got {dtype}")
        if dtype in (torch.uint16, torch.uint32, torch.uint64):  # compared below, which torch lacks for these
            prompt_lengths = prompt_lengths.to(torch.long)  # one past int64's range wraps negative: refused
        if prompt_lengths.shape != (self.num_sequences,):
            raise ValueError(
                f"prompt_lengths must be {self.num_sequences} integers, one per rollout, "
                f"got {tuple(prompt_lengths.shape)}"
            )
        if (prompt_lengths < 1).any() or (prompt_lengths > self.lengths).any():
            raise ValueError("every prompt length must be between 1 and its rollout's length")
        t = torch.arange(self.max_length - 1, device=self.lengths.device)
        return self.logprob_mask & (t[None, :] + 1 >= prompt_lengths[:, None])

    def sequence(self, i: int) -> torch.Tensor:
        """Tokens of rollout i, read back from the packed tree."""
        return self.tokens[self.seq_index[i, : int(self.lengths[i])]]

    def to(self, device) -> PrefixTree:
        """The tree on ``device``; its tensors stay int64 (token ids and indices, not values to convert)."""
        if isinstance(device, torch.dtype):
            raise TypeError(f"PrefixTree.to takes a device, got the dtype {device}: its tensors stay int64")
        moved = PrefixTree(**{name: getattr(self, name).to(device) for name in self.__dataclass_fields__})
        return moved._mark_valid() if self._known_valid() else moved  # a copy of a valid tree is valid

    def _mark_valid(self) -> PrefixTree:
        """Record that this tree is valid as it stands (for the builders, whose trees are by construction):
        :meth:`validate` then skips its checks, which cost about as much as building (0.6 s on a forest
        of 1M tokens), until a tensor is changed in place or the tree is rebuilt with other tensors."""
        object.__setattr__(self, "_valid_as", self._fingerprint())
        return self

    def _fingerprint(self):
        """The very tensors and their version counters (None for inference tensors, which have none)."""
        fields = [getattr(self, name) for name in self.__dataclass_fields__]
        if any(not isinstance(x, torch.Tensor) or x.is_inference() for x in fields):
            return None
        return tuple((id(x), x._version) for x in fields)

    def _known_valid(self) -> bool:
        known = getattr(self, "_valid_as", None)
        return known is not None and known == self._fingerprint()

    def validate(self, loss_fn=None) -> PrefixTree:
        """Raise ValueError/TypeError unless this is a preorder forest whose fields agree; return self.

        Every entry point calls it, so a tree not made by the builders (say,
        ``dataclasses.replace`` with another ``subtree_end``) is refused rather
        than trained on. Checks: long tensors on one device of consistent
        shapes; ``subtree_end`` a preorder forest; ``position_ids`` its depths;
        ``parent`` each token's enclosing token one level up; each row of
        ``seq_index`` a root-to-node path of ``lengths[s]`` tokens, then -1.
        A ``loss_fn`` that can (``TokenLoss.check_lengths``) is checked to be
        built for these sequences.

        A tree from the builders (:meth:`from_sequences`, ``dta_fast.build_tree``,
        :meth:`to` of such a tree) is valid by construction and skips the
        checks while its tensors are the ones built and unchanged (their
        version counters; a write through ``.data`` is not seen).
        """
        if not self._known_valid():
            self._check()
            self._mark_valid()
        if loss_fn is not None and hasattr(loss_fn, "check_lengths"):
            loss_fn.check_lengths(self.lengths)
        return self

    def _check(self) -> None:
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        for name, x in fields.items():
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"PrefixTree.{name} must be a tensor, got {type(x).__name__}")
            if x.dtype != torch.long:
                raise TypeError(f"PrefixTree.{name} must be a long (int64) tensor, got {x.dtype}")
            if x.device != self.tokens.device:
                raise ValueError(f"PrefixTree.{name} is on {x.device}, tokens on {self.tokens.device}")
        T = self.tokens.shape[0] if self.tokens.dim() == 1 else -1
        for name in ("tokens", "position_ids", "parent", "subtree_end"):
            if fields[name].dim() != 1 or fields[name].shape[0] != T or T < 1:
                raise ValueError(
                    f"PrefixTree.{name} must be [T] with T >= 1 tokens, got shape {tuple(fields[name].shape)}"
                )
        if self.seq_index.dim() != 2 or 0 in self.seq_index.shape:
            raise ValueError(
                f"PrefixTree.seq_index must be [N, Lmax] with N, Lmax >= 1, got {tuple(self.seq_index.shape)}"
            )
        N, L = self.seq_index.shape
        if tuple(self.lengths.shape) != (N,):
            raise ValueError(f"PrefixTree.lengths must be [N] = [{N}], got shape {tuple(self.lengths.shape)}")
        if bool((self.tokens < 0).any()):
            raise ValueError(f"PrefixTree.tokens must be non-negative, got {int(self.tokens.min())}")

        depth = nesting_depth(self.subtree_end[None])[0]
        if not torch.equal(self.position_ids, depth):
            i = int((self.position_ids != depth).nonzero()[0])
            raise ValueError(
                f"PrefixTree.position_ids[{i}] = {int(self.position_ids[i])}, but subtree_end puts token {i} at "
                f"depth {int(depth[i])}"
            )
        parent = self.parent
        i = torch.arange(T, device=parent.device)
        p = parent.clamp(min=0, max=T - 1)  # an entry out of range is refused below, not read out of bounds
        ok = torch.where(
            depth == 0,
            parent == -1,
            (parent >= 0) & (parent < i) & (self.subtree_end[p] > i) & (depth[p] == depth - 1),
        )
        if not bool(ok.all()):
            i = int((~ok).nonzero()[0])
            raise ValueError(
                f"PrefixTree.parent[{i}] = {int(parent[i])} is not the token above {i} in subtree_end's forest"
            )

        lengths = self.lengths
        if bool((lengths < 1).any()) or bool((lengths > L).any()) or int(lengths.max()) != L:
            raise ValueError(
                f"PrefixTree.lengths must be between 1 and Lmax = {L}, with max {L}; got {lengths.tolist()[:8]}"
            )
        t = torch.arange(L, device=lengths.device)
        inside = t[None, :] < lengths[:, None]  # [N, L]
        index = self.seq_index
        if not bool(torch.where(inside, (index >= 0) & (index < T), index == -1).all()):
            s = int((~torch.where(inside, (index >= 0) & (index < T), index == -1)).nonzero()[0, 0])
            raise ValueError(
                f"PrefixTree.seq_index row {s} must hold {int(lengths[s])} packed indices in [0, {T}), then -1"
            )
        prev = torch.cat([torch.full((N, 1), -1, dtype=torch.long, device=index.device), index[:, :-1]], 1)
        on_path = ~inside | (parent[index.clamp(min=0)] == prev)
        if not bool(on_path.all()):
            s, t = (~on_path).nonzero()[0].tolist()
            raise ValueError(
                f"PrefixTree.seq_index[{s}] is not a root-to-node path: its token {t} is not a child of token {t - 1}"
            )

    def __repr__(self) -> str:
        return (
            f"PrefixTree(num_sequences={self.num_sequences}, num_tokens={self.num_tokens}, "
            f"flat_tokens={self.flat_tokens}, compression_ratio={self.compression_ratio:.2f})"
        )
