"""Rollout engine: batched sampling with a KV cache, and exact speculative sampling from a tree cache.

Twins of dta_ref.sample / dta_ref.speculative_sample (same signatures, same
draws: with one generator they return the same tokens). Each step runs ONE
forward over every unfinished sequence: its pending tokens (the prompt at the
first step, then the token emitted last) followed by its draft tree. The
model's trunk runs through ``dta_ref.adapt(model).hidden_states(ids, positions, attend)``;
the ``attend`` closure keeps the KV cache per layer:

- a buffer [B, Hkv, L, D] per layer; row b holds its ``length[b]`` cached
  tokens at [0, length[b]), ragged across rows;
- a step with Tq new tokens per row (padded) writes their K/V at the window
  [W - Tq, W), W >= max(length) + Tq, and attends keys [0, W): that is
  ``tree_attention`` with a cached prefix (Tq < Tk), where ``subtree_end`` is
  W for a row's cached tokens (every query sees them), j + 1 for the unused
  gap between length[b] and the window (no query sees it) and the draft
  tree's own subtree ends for the new tokens (a draft token sees its
  ancestors only);
- after the walk the accepted tokens' K/V move to [length[b], ...) (a few
  vectors per row), and what the step wrote past a row's new length
  (rejected drafts, padding) is zeroed: every slot past a row's length is
  zero. The cache itself is never copied, except to drop finished rows.

On a CUDA device the attention is the Triton kernel, elsewhere dta_ref's
explicit-mask attention on the same subtree ends (dta_fast.dispatch). A decode
step (one query per row, no draft: plain sampling after the prompts' step,
or a speculative step with nothing to draft) is a fixed-shape step, replayed
from a CUDA graph on CUDA (dta_fast.decode); a hybrid's, in a run that has
verified no draft, goes through SDPA with the same mask
(dta_fast.dispatch.sdpa_attend): there every key a row does not see is zero,
a copy of one it sees or the prompt step's padding (token 0), so nothing
needs isolating. Draft sizes adapt per
sequence (dta_ref.rollout.cache.DraftBudget). Supported models: dta_ref.Decoder and
the Hugging Face families of the README's table. Inference only (no gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dta_ref.adapter import adapt
from dta_ref.hf import linear_layers_of, linear_module_of
from dta_ref.logprobs import logprob_dtype
from dta_ref.rollout.cache import DraftTree, Walk
from dta_ref.rollout.sampling import (
    Rollout,
    check_sampling_args,
    draw,
    progress_bar,
    sampling_probs,
    step_uniforms,
)
from dta_ref.rollout.speculative import SpeculativeRun, check_speculative_args

from .decode import DecodeSteps
from .dispatch import sdpa_attend, tree_attend, uses_kernel
from .linear_attention import CachedLinearMixing

ALIGN = 16
FIRST_NEW_TOKENS = 256  # generated tokens the KV buffers first hold room for; they double past it


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class Verified:
    """One verify forward's draws, per row: the tokens drawn after the last pending token and at each
    draft node, their log-probabilities, and where the step's window put the row's new tokens."""

    sampled: list[list[int]]
    logprobs: list[list[float]]
    window_start: int  # q0: the step's new tokens sit at [q0, W) of every row
    pending: list[int]  # pending tokens per row, before the draft's
    queries: int  # Tq: the step's tokens per row, padding included
    in_place: bool = False  # a fixed-shape decode step wrote each row's K/V at its length already


class KVEngine:
    """Per-layer KV buffers of the unfinished sequences and one batched verify forward per step."""

    def __init__(self, model, prompts: list[list[int]], capacity: int, most: int):
        self.adapter = adapt(model)
        self.head, self.device = self.adapter.head, self.adapter.device
        # buffer length per row: grown (doubled, at most ``most``) when a step's window needs more, so
        # the buffers follow the completions' lengths, not max_new_tokens
        self.capacity, self.most = min(capacity, most), most
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [B, Hkv, capacity, D]
        self.values: dict[int, torch.Tensor] = {}
        self.lengths = [0] * len(prompts)  # cached tokens per row
        # the buffer row of each unfinished sequence, in order: fixed-shape decode steps keep finished rows
        # in the buffers (computed, never read) until half are finished, so a row finishing is no new shape
        self.rows = list(range(len(prompts)))
        # whether a step has verified a draft: a hybrid's rejected tokens' K/V stay in its buffers, unseen
        self.drafted = False
        self.pending = [list(p) for p in prompts]  # tokens whose K/V are not cached yet (a chain)
        self.linear = self._linear_states()  # linear-attention layers' states per row, or None
        self.decode: DecodeSteps | None = None  # plain decode steps at fixed shapes (set by _generate)

    def _linear_states(self) -> CachedLinearMixing | None:
        core = self.adapter.core if self.adapter.is_hf else None
        layers = linear_layers_of(core) if core is not None else []
        if not layers:
            return None
        return CachedLinearMixing({id(linear_module_of(core, i).conv1d.weight): i for i in layers})

    def _buffer(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if layer not in self.keys:  # first step: shapes and dtype come from the model's own k, v
            B, H = k.shape[:2]
            self.keys[layer] = k.new_zeros(B, H, self.capacity, k.shape[3])  # zeros: unused slots are read, masked
            self.values[layer] = v.new_zeros(B, H, self.capacity, v.shape[3])
        return self.keys[layer], self.values[layer]

    def grow(self, window: int) -> None:
        if window > self.most:
            raise RuntimeError(f"KV window of {window} tokens past the most a run needs, {self.most}")
        self.capacity = min(max(window, 2 * self.capacity), self.most)
        cached = max(self.lengths)  # every row's tokens past this are unused (zeros, masked)
        if self.decode is not None:
            self.decode.reset()
        for buffers in (self.keys, self.values):
            for layer, old in buffers.items():
                buffers[layer] = old.new_zeros(*old.shape[:2], self.capacity, old.shape[3])
                buffers[layer][:, :, :cached] = old[:, :, :cached]

    def verify(self, drafts: list[DraftTree], uniforms, params) -> Verified:
        """One forward over each row's pending tokens + draft tree; the draws at each row's decision points
        (draw 0 after the last pending token, then one at each draft node)."""
        B = len(drafts)
        self.drafted = self.drafted or any(len(d) for d in drafts)
        if (
            self.decode is not None and self.keys and not any(len(d) for d in drafts)
            and all(len(p) == 1 for p in self.pending)
        ):  # fmt: skip
            if max(self.lengths) + 1 > self.capacity:
                self.grow(_round_up(max(self.lengths) + 1, ALIGN))
            drawn = self.decode([p[0] for p in self.pending], self.lengths, uniforms, self.rows)
            tokens, logp = drawn[0, self.rows].long().tolist(), drawn[1, self.rows].tolist()
            return Verified([[t] for t in tokens], [[x] for x in logp], -1, [1] * B, 1, in_place=True)
        if len(self.rows) < len(self.lengths):  # the general step takes the unfinished rows alone
            self._compact()
        P = [len(p) for p in self.pending]
        q_len = [p + len(d) for p, d in zip(P, drafts)]
        # Triton specialises integer arguments on ==1 and on divisibility by 16: rounding the query
        # count (past 1) and the key count up to multiples of 16 keeps the compiled variants to two
        kernel = uses_kernel(self.device)  # the kernel on CUDA, the reference elsewhere
        align = ALIGN if kernel else 1
        Tq = max(q_len)
        Tq = Tq if Tq == 1 else _round_up(Tq, align)
        W = _round_up(max(self.lengths) + Tq, align)
        if W > self.capacity:
            self.grow(W)
        ids = np.zeros((B, Tq), dtype=np.int64)
        pos = np.zeros((B, Tq), dtype=np.int64)
        ends = np.arange(1, W + 1, dtype=np.int64)[None].repeat(B, 0)  # [B, W]: unused keys seen by nobody
        depths = np.zeros((B, W), dtype=np.int64)  # the keys' positions, which sliding windows read
        rows = []  # flat (row, local query index) of every draw
        q0 = W - Tq
        for b, (draft, n) in enumerate(zip(drafts, self.lengths)):
            p = P[b]
            ids[b, : q_len[b]] = self.pending[b] + draft.tokens
            pos[b, :p] = np.arange(n, n + p)
            pos[b, p : q_len[b]] = [n + p + d for d in draft.depths()]
            ends[b, :n] = W
            depths[b, :n] = np.arange(n)
            depths[b, q0:] = pos[b]
            ends[b, q0 : q0 + p] = q0 + q_len[b]  # the pending chain is an ancestor of the whole draft
            ends[b, q0 + p : q0 + q_len[b]] = [q0 + p + e for e in draft.subtree_end()]
            rows.extend(b * Tq + t for t in range(p - 1, q_len[b]))
        if self.linear is not None:  # a row's window: its pending chain, then its draft tree; padding chained
            parent = np.arange(-1, Tq - 1, dtype=np.int64)[None].repeat(B, 0)
            keep = []
            for b, draft in enumerate(drafts):
                p = P[b]
                parent[b, p : q_len[b]] = [p - 1 if x < 0 else p + x for x in draft.parents]
                keep += [b * Tq + t for t in range(p - 1, q_len[b])]
            self.linear.begin(torch.from_numpy(parent).to(self.device), keep)
        ids_t = torch.from_numpy(ids).to(self.device, non_blocking=True)
        pos_t = torch.from_numpy(pos).to(self.device, non_blocking=True)
        ends_t = torch.from_numpy(ends).to(self.device, non_blocking=True)
        depths_t = torch.from_numpy(depths).to(self.device, non_blocking=True)
        rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        if Tq == 1 and not self.drafted:
            # a decode step: the keys a row does not see are zeros, copies of its own or the prompt step's
            # padding (finite where the model's K/V are), so SDPA with the tree's mask computes it exactly,
            # at one launch a layer
            attend_tree = sdpa_attend(ends_t, Tq, depths_t, lambda: tree_attend(ends_t, Tq, kernel, depths_t))
        else:
            attend_tree = tree_attend(ends_t, Tq, kernel, depths_t)

        def attend(layer, q, k, v, scale, **variant):
            K, V = self._buffer(layer, k, v)
            K[:, :, q0:W] = k  # idempotent: a repeated call writes the same values
            V[:, :, q0:W] = v
            return attend_tree(layer, q, K[:, :, :W], V[:, :, :W], scale, **variant)

        hidden = self.adapter.hidden_states(ids_t, pos_t, attend, linear=self.linear)  # [B, Tq, hidden]
        logits = self.head(hidden.flatten(0, 1)[rows_t])  # [draws, V]
        tokens, logp = draw(sampling_probs(logits, params), uniforms)
        both = torch.stack([tokens.to(torch.float64), logp.to(torch.float64)]).cpu()  # one sync per step
        tokens, logp = both[0].long().tolist(), both[1].tolist()
        sampled, logprobs, k = [], [], 0
        for d in drafts:
            sampled.append(tokens[k : k + len(d) + 1])
            logprobs.append(logp[k : k + len(d) + 1])
            k += len(d) + 1
        return Verified(sampled, logprobs, q0, P, Tq)

    def commit(self, verified: Verified, walks: list[Walk], keep: list[bool]) -> None:
        """Keep the pending and accepted draft tokens' K/V of ``verified``'s step, drop finished rows."""
        q0, P = verified.window_start, verified.pending
        b_idx, src, dst, ends = [], [], [], []
        for i, (b, w, k) in enumerate(zip(self.rows, walks, keep)):  # b: sequence i's buffer row
            if not k:
                continue
            local = list(range(P[i])) + [P[i] + r - 1 for r in w.rows[1:]]  # pending, then accepted nodes
            ends.append(b * verified.queries + local[-1])
            n = self.lengths[b]
            b_idx += [b] * len(local)
            src += [q0 + t for t in local]
            dst += range(n, n + len(local))
            self.lengths[b] = n + len(local)
            self.pending[b] = [w.tokens[-1]]
        if b_idx and not verified.in_place:
            b_t, src_t, dst_t = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (b_idx, src, dst))
            for layer in self.keys:
                for buf in (self.keys[layer], self.values[layer]):
                    buf[b_t, :, dst_t] = buf[b_t, :, src_t]  # the right side is gathered first: no aliasing
        if self.decode is not None and not verified.in_place:
            # what the step wrote past each row's new length (rejected drafts, padding) back to zero: every slot
            # past a row's length is zero again, as a fixed-shape decode step's SDPA needs
            window = np.arange(q0, q0 + verified.queries)
            stale = torch.from_numpy(window[None] >= np.array(self.lengths)[:, None]).to(self.device)
            for layer in self.keys:
                for buf in (self.keys[layer], self.values[layer]):
                    buf[:, :, q0 : q0 + verified.queries].masked_fill_(stale[:, None, :, None], 0)
        if self.linear is not None:
            self.linear.commit(ends)
        if not all(keep):
            self.rows = [b for b, k in zip(self.rows, keep) if k]
            if not verified.in_place or 2 * len(self.rows) <= len(self.lengths):
                self._compact()

    def _compact(self) -> None:
        """Drop the finished rows from the buffers."""
        rows_t = torch.tensor(self.rows, dtype=torch.long, device=self.device)
        for layer in self.keys:
            self.keys[layer] = self.keys[layer].index_select(0, rows_t)
            self.values[layer] = self.values[layer].index_select(0, rows_t)
        if self.decode is not None:
            self.decode.reset()
        self.lengths = [self.lengths[b] for b in self.rows]
        self.pending = [self.pending[b] for b in self.rows]
        self.rows = list(range(len(self.rows)))


def _generate(model, prompts, max_new_tokens, cache, params, generator, max_draft_tokens, progress) -> Rollout:
    adapter = adapt(model)
    run = SpeculativeRun(prompts, max_new_tokens, cache, params, max_draft_tokens, adapter.vocab_size)
    longest = max(map(len, prompts))
    # a step's window: the cached tokens, then the pending ones (a whole prompt first) and a draft, which
    # never runs past the tokens left to generate
    most = _round_up(longest + max_new_tokens + max(longest, min(max_draft_tokens, max_new_tokens) + 1), ALIGN)
    engine = KVEngine(model, prompts, _round_up(longest + FIRST_NEW_TOKENS, ALIGN), most + 2 * ALIGN)
    if engine.linear is None:  # a hybrid's decode steps carry its linear layers' states: the general step
        engine.decode = DecodeSteps(engine, params)
    active = run.active()
    with progress_bar(progress, len(prompts) * max_new_tokens) as bar:
        while active:
            drafts = run.drafts(active)
            uniforms = step_uniforms(sum(len(d) + 1 for d in drafts), params, generator, adapter.device)
            verified = engine.verify(drafts, uniforms, params)
            walks = run.finish_step(active, drafts, verified.sampled, verified.logprobs)
            engine.commit(verified, walks, [not run.seqs[i].done for i in active])
            bar.update(sum(len(w.tokens) for w in walks))
            active = run.active()
    return run.result(logprob_dtype(engine.adapter.dtype))


@torch.no_grad()
def speculative_sample(
    model,
    prompts,
    max_new_tokens,
    *,
    cache,
    temperature=1.0,
    top_k=None,
    top_p=None,
    eos_token_id=None,
    generator=None,
    max_draft_tokens=32,
    progress=None,
) -> Rollout:
    """Exact speculative sampling with draft trees from ``cache``, KV-cached and batched.

    Twin of dta_ref.speculative_sample: the same arguments, the same draws.
    Finished completions join ``cache`` as soon as they finish. ``progress``:
    a bar over generated tokens on stderr (None: only on a terminal).
    """
    prompts, params = check_sampling_args(
        model, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator
    )
    check_speculative_args(cache, max_draft_tokens)
    return _generate(model, prompts, max_new_tokens, cache, params, generator, max_draft_tokens, progress)


@torch.no_grad()
def sample(
    model,
    prompts,
    max_new_tokens,
    *,
    temperature=1.0,
    top_k=None,
    top_p=None,
    eos_token_id=None,
    generator=None,
    progress=None,
) -> Rollout:
    """Plain sampling on the same engine (no drafts): the baseline speculative sampling is measured against.

    Twin of dta_ref.sample: with one generator both return the same tokens.
    ``progress``: a bar over generated tokens on stderr (None: only on a terminal).
    """
    prompts, params = check_sampling_args(
        model, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator
    )
    out = _generate(model, prompts, max_new_tokens, None, params, generator, 0, progress)
    out.stats = {k: out.stats[k] for k in ("generated_tokens", "verify_steps")}  # dta_ref.sample's counters
    return out
