"""Draft trees, the exact acceptance walk, and the per-prompt cache of earlier completions they come from.

A :class:`RolloutCache` stores finished completions under their prompts and
indexes their n-grams; a :class:`Drafter` follows one growing sequence
through it and proposes a :class:`DraftTree` of what followed the sequence's
end before, most frequent first; :func:`walk` is the acceptance rule that
keeps speculative sampling exact (docs/rollout.md).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..checks import check_int
from ..tree import _as_token_list

BOS = -1  # marks where a stored sequence starts, so a match may be anchored at the prompt's end


@dataclass
class DraftTree:
    """Draft tokens in depth-first preorder hanging below the last context token.

    ``parents[i]`` is the index of node i's parent, -1 for a child of the
    context's last token. Siblings have distinct tokens (a trie).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each node, 0 for a child of the context's last token."""
        d = []
        for p in self.parents:
            d.append(0 if p < 0 else d[p] + 1)
        return d

    def subtree_end(self) -> list[int]:
        """One past the last node below each node (preorder), in draft coordinates."""
        end = list(range(1, len(self.tokens) + 1))
        for i in range(len(self.tokens) - 1, -1, -1):
            p = self.parents[i]
            if p >= 0:
                end[p] = max(end[p], end[i])
        return end

    def children(self) -> list[dict[int, int]]:
        """``children()[r]``: token -> node index for r = 0 (the context's last token) and r = 1 + node."""
        kids: list[dict[int, int]] = [{} for _ in range(len(self.tokens) + 1)]
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            kids[p + 1][t] = i
        return kids


@dataclass
class Walk:
    """The outcome of verifying one draft: tokens emitted and where each was drawn.

    ``rows[k]`` is the draw that emitted ``tokens[k]``: 0 for the context's
    last token, 1 + i for draft node i. ``accepted`` counts drafted tokens
    among the emitted ones.
    """

    tokens: list[int]
    rows: list[int]
    accepted: int


def walk(draft: DraftTree, sampled: list[int], eos_token_ids: frozenset[int]) -> Walk:
    """The exact acceptance rule: follow the draft while the token drawn at a node is one of its children.

    ``sampled[r]`` is the token drawn from the target distribution at draw r
    (0: after the context, 1 + i: after draft node i).
    """
    kids = draft.children()
    tokens, rows, r = [], [], 0
    while True:
        x = sampled[r]
        tokens.append(x)
        rows.append(r)
        child = kids[r].get(x)
        if child is None or x in eos_token_ids:  # the last token was drafted where it is a child (an EOS)
            return Walk(tokens, rows, len(tokens) - (child is None))
        r = child + 1


@dataclass
class DraftBudget:
    """Per-sequence adaptive draft size: large while drafts are accepted, none while they are not.

    ``accepted`` is a running mean of draft tokens accepted per step. Below
    ``min_accepted`` the sequence stops drafting, except for a small probe
    after ``probe_every`` idle steps; each probe that fails doubles that wait
    (up to 256 steps). So a sequence whose rollouts stop repeating costs
    almost nothing over plain generation.
    """

    max_draft_tokens: int
    accepted: float = 1.0
    min_accepted: float = 0.15
    probe_every: int = 16
    probe_tokens: int = 4
    idle: int = 0

    def size(self) -> int:
        if self.max_draft_tokens == 0:
            return 0
        if self.accepted >= self.min_accepted:
            return min(self.max_draft_tokens, 4 + int(4 * self.accepted))
        self.idle += 1
        if self.idle >= self.probe_every:
            self.idle = 0
            return min(self.max_draft_tokens, self.probe_tokens)
        return 0

    def update(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self.accepted = 0.6 * self.accepted + 0.4 * accepted
        if accepted:
            self.probe_every = 16
        elif self.accepted < self.min_accepted:
            self.probe_every = min(256, 2 * self.probe_every)


NGRAMS = (1, 2, 4, 8)  # context lengths indexed; candidates are then ranked by their true match length
_HASH_MUL = 0x100000001B3
_MASK64 = (1 << 64) - 1


def _ngram_hash(tokens) -> int:
    """The hash :meth:`_Store.add` computes (with numpy) for an n-gram, in Python ints."""
    h = 0
    for t in tokens:
        h = (h * _HASH_MUL + t + 2) & _MASK64
    return h


class _Store:
    """One cache key's sequences and an index of their n-grams (by hash) for suffix matching."""

    def __init__(self):
        self.seqs: dict[int, list[int]] = {}  # id -> [BOS] + tokens
        self.order: deque[int] = deque()
        self.next_id = 0
        self.num_tokens = 0
        self.index: dict[int, dict[int, list[tuple[int, int]]]] = {n: {} for n in NGRAMS}  # n -> hash -> [(id, pos)]
        self.indexed = 0  # tokens the index holds entries for, evicted ones included

    def add(self, seq: list[int]) -> None:
        s = [BOS] + seq
        sid = self.next_id
        self.next_id += 1
        self.seqs[sid] = s
        self.order.append(sid)
        self.num_tokens += len(seq)
        self.indexed += len(seq)
        self._index(sid, s)

    def _index(self, sid: int, s: list[int]) -> None:
        arr = np.asarray(s, dtype=np.int64).astype(np.uint64) + np.uint64(2)
        with np.errstate(over="ignore"):  # the hash wraps modulo 2**64 on purpose
            for n in NGRAMS:
                if n >= len(s):
                    break
                count = len(s) - n  # n-grams s[e-n:e] for e = n .. len(s)-1 (a continuation s[e] follows)
                h = np.zeros(count, dtype=np.uint64)
                for k in range(n):
                    h = h * np.uint64(_HASH_MUL) + arr[k : k + count]
                table = self.index[n]
                for e, key in enumerate(h.tolist(), start=n):
                    hits = table.get(key)
                    if hits is None:
                        table[key] = [(sid, e)]
                    else:
                        hits.append((sid, e))

    def evict_to(self, max_tokens: int) -> None:
        while self.order and self.num_tokens > max_tokens:
            sid = self.order.popleft()
            self.num_tokens -= len(self.seqs.pop(sid)) - 1
        # an evicted sequence's index entries stay until the index is rebuilt (match skips them), which
        # happens once they outnumber the live ones: a rebuild per max_tokens evicted, not per eviction
        if self.indexed > 2 * self.num_tokens + 1024:
            self.index = {n: {} for n in NGRAMS}
            self.indexed = self.num_tokens
            for sid in self.order:
                self._index(sid, self.seqs[sid])

    def match(self, context: list[int], max_match: int, max_sources: int) -> list[list[int]]:
        """Pointers [id, pos] after the stored occurrences of the longest context suffix, longest first.

        Candidates come from the longest indexed n-gram with hits (most recent
        first); they are ranked by how far (up to ``max_match`` tokens) the
        context keeps matching before them, ties to the most recent.
        """
        for n in reversed(NGRAMS):
            if n > len(context):
                continue
            key = context[-n:]
            found = []
            for sid, pos in reversed(self.index[n].get(_ngram_hash(key), ())):
                s = self.seqs.get(sid)
                if s is None or pos >= len(s) or s[pos - n : pos] != key:
                    continue  # evicted, nothing follows, or a hash collision
                length = n
                while (
                    length < max_match
                    and length < pos
                    and length < len(context)
                    and s[pos - length - 1] == context[-length - 1]
                ):
                    length += 1
                found.append((length, len(found), [sid, pos]))
                if len(found) == 4 * max_sources:
                    break
            if found:
                found.sort(key=lambda f: (-f[0], f[1]))
                return [f[2] for f in found[:max_sources]]
        return []


class RolloutCache:
    """Per-prompt tree cache of earlier completions, the draft source for speculative sampling.

    ``add(prompt, completion)`` stores a completion under its prompt; a prompt
    that extends a cached prompt (a later turn whose prompt holds an earlier
    sample's context) is stored under that cached prompt, its extra tokens
    becoming part of the stored sequence. ``draft(prompt, generated,
    max_draft_tokens)`` finds where the end of ``prompt + generated`` (its
    longest suffix, up to ``max_match`` tokens, anchored at the prompt's end
    when short) occurs in the stored sequences and returns what followed, as
    a token tree, most frequent first. Memory per prompt is bounded by
    ``max_tokens_per_prompt`` (oldest completions evicted first), and the
    whole cache's by ``max_tokens`` when given (the prompts least recently
    added to or drafted from dropped first: a run over a large prompt set
    keeps the prompts it meets again); ``clear()`` empties it.
    """

    def __init__(
        self,
        max_tokens_per_prompt: int = 1 << 16,
        max_match: int = 32,
        max_sources: int = 8,
        max_tokens: int | None = None,
    ):
        check_int("max_tokens_per_prompt", max_tokens_per_prompt, 1)
        check_int("max_match", max_match, 1)
        check_int("max_sources", max_sources, 1)
        check_int("max_tokens", max_tokens, 1, allow_none=True)
        self.max_tokens_per_prompt = max_tokens_per_prompt
        self.max_match = max_match
        self.max_sources = max_sources
        self.max_tokens = max_tokens
        self.version = 0  # bumped by every add: drafters then look for new sources
        self.clear()

    def clear(self) -> None:
        """Forget every stored completion."""
        self._stores: OrderedDict[tuple[int, ...], _Store] = OrderedDict()  # least recently used first
        self._key_lengths: set[int] = set()
        self._num_tokens = 0
        self.version += 1

    def __len__(self) -> int:
        return len(self._stores)

    def num_tokens(self, prompt=None) -> int:
        """Tokens stored under ``prompt``'s key, or in the whole cache."""
        if prompt is None:
            return self._num_tokens
        found = self._find(_as_token_list(prompt, 0), use=False)
        return 0 if found is None else found[0].num_tokens

    def _find(self, prompt: list[int], use: bool = True):
        """(store, prompt tokens after its key) for the longest cached key that prefixes ``prompt``;
        ``use`` marks it the most recently used."""
        for n in sorted(self._key_lengths, reverse=True):
            if n <= len(prompt):
                key = tuple(prompt[:n])
                store = self._stores.get(key)
                if store is not None:
                    if use:
                        self._stores.move_to_end(key)
                    return store, prompt[n:]
        return None

    def _evict(self) -> None:
        """Drop least recently used prompts while the cache holds more than max_tokens (never the last
        one used: a prompt larger than the bound keeps its own max_tokens_per_prompt)."""
        while self.max_tokens is not None and self._num_tokens > self.max_tokens and len(self._stores) > 1:
            _, store = self._stores.popitem(last=False)
            self._num_tokens -= store.num_tokens
            self._key_lengths = {len(k) for k in self._stores}

    def add(self, prompt, completion) -> None:
        prompt = _as_token_list(prompt, 0)
        if isinstance(completion, torch.Tensor) and completion.dim() == 1 and not completion.dtype.is_floating_point:
            completion = completion.tolist()
        if isinstance(completion, (str, bytes)) or not isinstance(completion, (Sequence, np.ndarray)):
            raise TypeError(f"completion must be a list of token ids, got {type(completion).__name__}")
        try:
            completion = [] if len(completion) == 0 else _as_token_list(completion, 0)
        except (TypeError, ValueError) as e:
            raise type(e)(f"completion: {e}") from None
        found = self._find(prompt)
        if found is None:
            store, tail = _Store(), []
            self._stores[tuple(prompt)] = store
            self._key_lengths.add(len(prompt))
        else:
            store, tail = found
        if tail or completion:
            before = store.num_tokens
            store.add(tail + completion)
            store.evict_to(self.max_tokens_per_prompt)
            self._num_tokens += store.num_tokens - before
            self._evict()
        self.version += 1

    def drafter(self, prompt) -> Drafter:
        """A drafter for one sequence of ``prompt``: it follows its matches as the sequence grows."""
        return Drafter(self, list(prompt))

    def draft(self, prompt, generated, max_draft_tokens: int) -> DraftTree:
        """A draft tree of at most ``max_draft_tokens`` tokens to follow ``prompt + generated``."""
        max_draft_tokens = check_int("max_draft_tokens", max_draft_tokens, 0)
        if isinstance(generated, (str, bytes)) or not hasattr(generated, "__len__"):
            raise TypeError(f"generated must be a list of token ids, got {type(generated).__name__}")
        generated = [] if len(generated) == 0 else _as_token_list(generated, 0)
        return self.drafter(_as_token_list(prompt, 0)).draft(generated, max_draft_tokens)


class Drafter:
    """Draft trees for one growing sequence.

    Keeps pointers just past the stored occurrences of the sequence's end and
    moves them along as tokens are generated, so the index is searched again
    only when every pointer has diverged (or new completions arrived while
    fewer than ``max_sources`` pointers are alive).
    """

    def __init__(self, cache: RolloutCache, prompt: list[int]):
        self.cache, self.prompt = cache, prompt
        self.pointers: list[list[int]] = []
        self.store: _Store | None = None
        self.seen = 0  # generated tokens the pointers account for
        self.version = -1

    def _advance(self, new: list[int]) -> None:
        alive = []
        for ptr in self.pointers:
            s = self.store.seqs.get(ptr[0]) if self.store is not None else None
            if s is not None and s[ptr[1] : ptr[1] + len(new)] == new and ptr[1] + len(new) < len(s):
                alive.append([ptr[0], ptr[1] + len(new)])
        self.pointers = alive

    def draft(self, generated: list[int], max_draft_tokens: int) -> DraftTree:
        if len(generated) < self.seen:
            raise ValueError("a Drafter follows one growing sequence: generated tokens may only be appended")
        self._advance(generated[self.seen :])
        self.seen = len(generated)
        cache = self.cache
        if not self.pointers or (cache.version != self.version and len(self.pointers) < cache.max_sources):
            self.version = cache.version
            found = cache._find(self.prompt)
            if found is not None:
                self.store, tail = found
                self.pointers = self.store.match([BOS] + tail + generated, cache.max_match, cache.max_sources)
        if max_draft_tokens <= 0 or not self.pointers:
            return DraftTree()
        continuations: dict[tuple[int, ...], int] = {}
        for sid, pos in self.pointers:
            c = tuple(self.store.seqs[sid][pos : pos + max_draft_tokens])
            continuations[c] = continuations.get(c, 0) + 1
        return _most_frequent_tree(continuations, max_draft_tokens)


def _most_frequent_tree(continuations: dict[tuple[int, ...], int], budget: int) -> DraftTree:
    """The ``budget`` most frequent nodes of the continuations' trie (a node only with its parent).

    ``continuations`` maps each distinct continuation to how often it was seen,
    in order of preference for ties.
    """
    if len(continuations) == 1:  # one distinct continuation (the common case): a chain
        (c,) = continuations
        return DraftTree(list(c[:budget]), list(range(-1, min(len(c), budget) - 1)))
    counts: list[dict[int, list]] = [{}]  # node -> {token: [count, child node]}
    for c, weight in continuations.items():
        node = 0
        for t in c:
            entry = counts[node].get(t)
            if entry is None:
                entry = counts[node][t] = [0, len(counts)]
                counts.append({})
            entry[0] += weight
            node = entry[1]
    chosen: dict[int, list[int]] = {0: []}  # chosen trie node -> chosen children (trie nodes)
    token_of = {}
    heap = [(-e[0], e[1], 0, t) for t, e in counts[0].items()]  # trie node ids order ties by first sight
    heapq.heapify(heap)
    while heap and len(token_of) < budget:
        _, node, parent, t = heapq.heappop(heap)
        chosen[parent].append(node)
        chosen[node] = []
        token_of[node] = t
        for tt, e in counts[node].items():
            heapq.heappush(heap, (-e[0], e[1], node, tt))
    rank = {node: i for i, node in enumerate(token_of)}  # selection order: most frequent first
    tree = DraftTree()
    stack = [(child, -1) for child in sorted(chosen[0], key=rank.get, reverse=True)]
    while stack:
        node, parent = stack.pop()
        tree.tokens.append(token_of[node])
        tree.parents.append(parent)
        me = len(tree.tokens) - 1
        stack.extend((child, me) for child in sorted(chosen[node], key=rank.get, reverse=True))
    return tree
