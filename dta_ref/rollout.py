"""Rollouts: plain sampling and exact speculative sampling from a per-prompt tree cache.

Readable reference. :func:`sample` is plain autoregressive sampling (one
forward over the whole context per token). :func:`speculative_sample` drafts a
token tree per sequence from a :class:`RolloutCache` of earlier completions and
verifies it with one tree-masked forward per step (recomputing the whole
prefix: no KV cache here). The acceptance rule keeps the output distribution
exactly that of :func:`sample` (docs/rollout.md):

    at a draft node draw x from the target distribution; if x is a child of
    the node move there and go on, else emit x and stop; after the deepest
    accepted node emit one more token from its distribution.

Both samplers draw their randomness the same way (one uniform per node whose
distribution is computed, in sequence order, inverse-CDF sampling), so with an
empty cache they return the same tokens for the same generator, and
dta_fast's twins return the same tokens as these.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .attention import as_float, attention, mask_from_subtree_end
from .adapter import adapt
from .hf import check_in_window
from .logprobs import MIN_TEMPERATURE, logprob_dtype
from .tree import _as_token_list

BOS = -1  # marks where a stored sequence starts, so a match may be anchored at the prompt's end


# ------------------------------------------------------------------ results and arguments


@dataclass
class Rollout:
    """What every sampler returns.

    ``completions[i]``: the generated tokens of prompt i (the EOS token
    included when sampled, nothing after it). ``logprobs[i]``: 1-D float
    tensor, each token's log-probability under the distribution it was
    sampled from (after temperature, top-k and top-p; 0 for greedy: a point
    mass). ``stats``: counters (``generated_tokens``, ``verify_steps``, and for
    speculative samplers ``drafted_tokens``, ``accepted_tokens``, ...).
    """

    completions: list[list[int]]
    logprobs: list[torch.Tensor]
    stats: dict = field(default_factory=dict)

    def padded_logprobs(self, prompts) -> torch.Tensor:
        """The behaviour logprobs laid out like tree/flat logprobs of ``prompt + completion``: [N, Lmax-1].

        Entry [i, t] scores token t+1 of rollout i; completion i's tokens sit at
        t = len(prompt_i) - 1 ...; prompt positions and padding are 0 (mask
        them with ``PrefixTree.response_mask``).
        """
        if len(prompts) != len(self.completions):
            raise ValueError(f"got {len(prompts)} prompts for {len(self.completions)} completions")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (its last one scores the first completion token)")
        width = max(len(p) + len(c) for p, c in zip(prompts, self.completions)) - 1
        dtype = self.logprobs[0].dtype if self.logprobs else torch.float32
        out = torch.zeros(len(prompts), width, dtype=dtype)
        for i, (p, lp) in enumerate(zip(prompts, self.logprobs)):
            out[i, len(p) - 1 : len(p) - 1 + len(lp)] = lp
        return out


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_ids: frozenset[int] = frozenset()  # a completion ends at any of them

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_int(name, value, minimum, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)  # a NumPy integer as an int


def check_sampling_args(model, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator):
    """Validate the common sampler arguments; return (prompts as int lists, SamplingParams)."""
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of token lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: at least one prompt is needed")
    try:
        prompts = [_as_token_list(p, i) for i, p in enumerate(prompts)]
    except ValueError as e:
        raise ValueError(f"prompts: {e}") from None
    except TypeError as e:
        raise TypeError(f"prompts: {e}") from None
    adapter = adapt(model)
    adapter.check_token_ids(torch.tensor([max(p) for p in prompts]))
    logits = adapter.num_logits
    if logits is not None and logits > adapter.vocab_size:
        raise ValueError(
            f"the model's output head gives {logits} logits but its embedding has {adapter.vocab_size} rows: a "
            f"sampled id past {adapter.vocab_size - 1} could not be fed back; resize one to match the other"
        )
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 0)
    check_in_window(adapter.sliding_window, max(map(len, prompts)) + max_new_tokens - 1)  # before any work
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not math.isfinite(as_float(temperature)) or not (temperature == 0 or temperature >= MIN_TEMPERATURE):
        raise ValueError(
            f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} (below, the scaled logits "
            f"overflow), got {temperature}"
        )
    top_k = _check_int("top_k", top_k, 1, allow_none=True)
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
            raise TypeError(f"top_p must be a float or None, got {type(top_p).__name__}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    eos_token_ids = _check_eos(model, eos_token_id)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    params = SamplingParams(float(temperature), top_k, None if top_p is None else float(top_p), eos_token_ids)
    return prompts, params


def _check_eos(model, eos_token_id) -> frozenset[int]:
    """An int, a list of ints (chat models often end turns with several, as Hugging Face's
    generation_config.eos_token_id lists them) or None."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, (list, tuple, set, frozenset)):
        if not eos_token_id:
            raise ValueError("eos_token_id is an empty list: pass None for no end-of-sequence token")
        ids = [_check_int("eos_token_id", e, 0) for e in eos_token_id]
    elif isinstance(eos_token_id, numbers.Integral):
        ids = [_check_int("eos_token_id", eos_token_id, 0)]  # a bool is refused there
    else:
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {type(eos_token_id).__name__}")
    vocab = adapt(model).vocab_size
    for e in ids:  # compared as ints: an id past int64 cannot become a tensor
        if e >= vocab:
            raise ValueError(f"eos_token_id {e} is out of range for a vocabulary of {vocab} tokens")
    return frozenset(ids)


def refuse_nonfinite_draws(logprobs: list[float], prompt: int) -> None:
    """A NaN logprob marks a draw from logits that were not finite (``draw``): an error, not a sample."""
    if any(math.isnan(lp) for lp in logprobs):
        raise ValueError(
            f"prompt {prompt}: the model's next-token logits are not finite (NaN or inf), so nothing can be "
            "sampled: check the model's weights (a diverged update) and its input"
        )


# ------------------------------------------------------------------ the sampling distribution


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from, [N, V], from logits [N, V].

    Temperature, then top-k (keep the logits >= the k-th largest, ties kept),
    then top-p (keep the most probable tokens, in a stable descending order,
    up to and including the one whose cumulative probability reaches top_p).
    Greedy (temperature 0) is the point mass on the first argmax.
    """
    logits = logits.to(logprob_dtype(logits.dtype))
    if params.greedy:
        point = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
        # argmax would pick a NaN: such a row (or one with +inf, whose softmax is NaN) is NaN, which draw reports
        return point.masked_fill((logits.isnan() | logits.isposinf()).any(-1, keepdim=True), float("nan"))
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p is not None and params.top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(-1) - sorted_p  # probability mass ranked above each token
        keep_sorted = before < params.top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw of one token per row of probs [N, V] with uniforms [N] in [0, 1).

    Returns (tokens [N] int64, their log-probabilities [N]). ``uniforms=None``
    takes the argmax (greedy).
    """
    if uniforms is None:
        tokens = probs.argmax(-1)
    else:
        cdf = probs.cumsum(-1)
        x = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, x, right=True).squeeze(-1)
        # rounding may land past the last token of nonzero probability
        last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
        tokens = torch.minimum(tokens, last)
    logp = probs.gather(-1, tokens[:, None]).squeeze(-1).log()
    # a row with a non-finite probability (NaN or inf logits) draws nothing: its logprob says so, NaN,
    # which the caller checks on the host it already syncs with (refuse_nonfinite_draws)
    return tokens, torch.where(probs.sum(-1).isfinite(), logp, torch.nan)


def step_uniforms(n: int, params: SamplingParams, generator, device) -> torch.Tensor | None:
    """The uniforms for ``n`` draws of one step (None when greedy: no randomness is used)."""
    if params.greedy:
        return None
    where = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(n, generator=generator, dtype=torch.float64, device=where).to(device)


# ------------------------------------------------------------------ plain sampling


def _context_logits(model, contexts: list[list[int]]) -> torch.Tensor:
    """Next-token logits [N, V] after each context, every context run alone (causal)."""
    adapter = adapt(model)
    device = adapter.device
    rows = []
    for ctx in contexts:
        ids = torch.tensor(ctx, device=device)[None]
        pos = torch.arange(len(ctx), device=device)[None]
        end = torch.full((len(ctx),), len(ctx), device=device)
        mask = mask_from_subtree_end(end, pos[0])

        def attend(layer, q, k, v, scale, mask=mask):
            return attention(q, k, v, mask, scale)

        rows.append(adapter.head(adapter.hidden_states(ids, pos, attend)[0, -1]))
    return torch.stack(rows)


@torch.no_grad()
def sample(model, prompts, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None, eos_token_id=None,
           generator=None) -> Rollout:  # fmt: skip
    """Plain autoregressive sampling, one token per sequence per step (readable, recomputes the prefix).

    ``prompts``: list of token lists. ``temperature=0`` is greedy. Each step
    draws one uniform per unfinished sequence, in order, from ``generator``.
    """
    prompts, params = check_sampling_args(
        model, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator
    )
    device = adapt(model).device
    out = [[] for _ in prompts]
    lps = [[] for _ in prompts]
    active = [i for i in range(len(prompts)) if max_new_tokens > 0]
    steps = 0
    while active:
        steps += 1
        probs = sampling_probs(_context_logits(model, [prompts[i] + out[i] for i in active]), params)
        tokens, logp = draw(probs, step_uniforms(len(active), params, generator, device))
        for i, t, lp in zip(active, tokens.tolist(), logp.tolist()):
            refuse_nonfinite_draws([lp], i)
            out[i].append(t)
            lps[i].append(lp)
        active = [i for i in active if len(out[i]) < max_new_tokens and out[i][-1] not in params.eos_token_ids]
    dtype = logprob_dtype(adapt(model).dtype)
    stats = {"generated_tokens": sum(map(len, out)), "verify_steps": steps}
    return Rollout(out, [torch.tensor(x, dtype=dtype) for x in lps], stats)


# ------------------------------------------------------------------ draft trees and the cache


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
                while length < max_match and length < pos and length < len(context) and \
                        s[pos - length - 1] == context[-length - 1]:  # fmt: skip
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

    def __init__(self, max_tokens_per_prompt: int = 1 << 16, max_match: int = 32, max_sources: int = 8,
                 max_tokens: int | None = None):  # fmt: skip
        _check_int("max_tokens_per_prompt", max_tokens_per_prompt, 1)
        _check_int("max_match", max_match, 1)
        _check_int("max_sources", max_sources, 1)
        _check_int("max_tokens", max_tokens, 1, allow_none=True)
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
        max_draft_tokens = _check_int("max_draft_tokens", max_draft_tokens, 0)
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


# ------------------------------------------------------------------ speculative sampling


def check_speculative_args(cache, max_draft_tokens):
    if not isinstance(cache, RolloutCache):
        raise TypeError(f"cache must be a dta_ref.RolloutCache, got {type(cache).__name__}")
    _check_int("max_draft_tokens", max_draft_tokens, 0)


@dataclass
class _Sequence:
    """One prompt's state during speculative sampling (shared by the reference and the fast engine)."""

    prompt: list[int]
    budget: DraftBudget
    drafter: Drafter | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False


class SpeculativeRun:
    """The step loop both speculative samplers share: drafts, uniforms, the walk, the cache updates.

    An engine supplies ``verify(active, drafts) -> (sampled, logprobs)``: for
    each active sequence, the tokens drawn at draw 0 (after its context) and
    at each draft node, from this step's uniforms.
    """

    def __init__(self, prompts, max_new_tokens, cache, params, max_draft_tokens, vocab_size: int):
        self.vocab_size = vocab_size  # drafts are checked against it: a cache may hold another tokenizer's ids
        self.seqs = [
            _Sequence(p, DraftBudget(max_draft_tokens), None if cache is None else cache.drafter(p)) for p in prompts
        ]
        self.max_new_tokens, self.cache, self.params = max_new_tokens, cache, params
        self.stats = {"generated_tokens": 0, "drafted_tokens": 0, "accepted_tokens": 0, "verify_steps": 0,
                      "sequence_steps": 0}  # fmt: skip
        if max_new_tokens == 0:
            for s in self.seqs:
                s.done = True

    def active(self) -> list[int]:
        return [i for i, s in enumerate(self.seqs) if not s.done]

    def drafts(self, active: list[int]) -> list[DraftTree]:
        out = []
        for i in active:
            s = self.seqs[i]
            size = min(s.budget.size(), self.max_new_tokens - len(s.tokens) - 1)
            draft = s.drafter.draft(s.tokens, size) if size > 0 else DraftTree()
            if draft.tokens and max(draft.tokens) >= self.vocab_size:
                raise ValueError(
                    f"the rollout cache drafted token {max(draft.tokens)}, out of range for the model's vocabulary "
                    f"of {self.vocab_size} tokens: was the cache filled with another tokenizer's ids?"
                )
            out.append(draft)
        return out

    def finish_step(self, active, drafts, sampled: list[list[int]], logprobs: list[list[float]]) -> list[Walk]:
        """Walk each draft, append the emitted tokens, and add finished completions to the cache."""
        self.stats["verify_steps"] += 1
        walks = []
        for i, draft, smp, lp in zip(active, drafts, sampled, logprobs):
            s = self.seqs[i]
            w = walk(draft, smp, self.params.eos_token_ids)
            room = self.max_new_tokens - len(s.tokens)
            w = Walk(w.tokens[:room], w.rows[:room], min(w.accepted, room))
            emitted = [lp[r] for r in w.rows]
            refuse_nonfinite_draws(emitted, i)
            s.tokens += w.tokens
            s.logprobs += emitted
            s.budget.update(len(draft), w.accepted)
            self.stats["drafted_tokens"] += len(draft)
            self.stats["accepted_tokens"] += w.accepted
            self.stats["generated_tokens"] += len(w.tokens)
            self.stats["sequence_steps"] += 1
            walks.append(w)
            if len(s.tokens) >= self.max_new_tokens or s.tokens[-1] in self.params.eos_token_ids:
                s.done = True
        for i in active:  # after the step: a finished sibling drafts for the rest of its group
            if self.seqs[i].done and self.cache is not None:
                self.cache.add(self.seqs[i].prompt, self.seqs[i].tokens)
        return walks

    def result(self, dtype) -> Rollout:
        return Rollout(
            [s.tokens for s in self.seqs],
            [torch.tensor(s.logprobs, dtype=dtype) for s in self.seqs],
            dict(self.stats),
        )


def tree_inputs(context_len: int, draft: DraftTree):
    """Positions and subtree ends of the draft nodes appended after a context of ``context_len`` tokens."""
    positions = [context_len + d for d in draft.depths()]
    ends = [context_len + e for e in draft.subtree_end()]
    return positions, ends


@torch.no_grad()
def speculative_sample(model, prompts, max_new_tokens, *, cache, temperature=1.0, top_k=None, top_p=None,
                       eos_token_id=None, generator=None, max_draft_tokens=32) -> Rollout:  # fmt: skip
    """Exact speculative sampling with draft trees from ``cache`` (readable: recomputes the whole prefix).

    Same output distribution as :func:`sample`; each step verifies every
    sequence's draft tree with one tree-masked forward over its context plus
    the tree, and finished completions join ``cache`` as soon as they finish.
    """
    prompts, params = check_sampling_args(
        model, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator
    )
    check_speculative_args(cache, max_draft_tokens)
    adapter = adapt(model)
    device, head = adapter.device, adapter.head
    run = SpeculativeRun(prompts, max_new_tokens, cache, params, max_draft_tokens, adapter.vocab_size)
    while active := run.active():
        drafts = run.drafts(active)
        uniforms = step_uniforms(sum(len(d) + 1 for d in drafts), params, generator, device)
        sampled, logprobs, offset = [], [], 0
        for i, draft in zip(active, drafts):
            context = run.seqs[i].prompt + run.seqs[i].tokens
            positions, ends = tree_inputs(len(context), draft)
            T = len(context) + len(draft)
            ids = torch.tensor(context + draft.tokens, device=device)[None]
            pos = torch.tensor(list(range(len(context))) + positions, device=device)
            end = torch.tensor([T] * len(context) + ends, device=device)
            mask = mask_from_subtree_end(end, torch.arange(T, device=device))

            def attend(layer, q, k, v, scale, mask=mask):
                return attention(q, k, v, mask, scale)

            hidden = adapter.hidden_states(ids, pos[None], attend)[0, len(context) - 1 :]  # draws 0..len(draft)
            probs = sampling_probs(head(hidden), params)
            n = len(draft) + 1
            tokens, logp = draw(probs, None if uniforms is None else uniforms[offset : offset + n])
            offset += n
            sampled.append(tokens.tolist())
            logprobs.append(logp.tolist())
        run.finish_step(active, drafts, sampled, logprobs)
    return run.result(logprob_dtype(adapter.dtype))
