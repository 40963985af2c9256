"""Exact speculative sampling: the step loop both engines share, and the readable reference engine.

:func:`speculative_sample` drafts a token tree per sequence from a
:class:`~dta_ref.rollout.cache.RolloutCache` of earlier completions and
verifies it with one tree-masked forward per step (recomputing the whole
prefix: no KV cache here). The acceptance rule keeps the output distribution
exactly that of :func:`~dta_ref.rollout.sampling.sample` (docs/rollout.md):

    at a draft node draw x from the target distribution; if x is a child of
    the node move there and go on, else emit x and stop; after the deepest
    accepted node emit one more token from its distribution.

It returns plain sampling's very tokens only while no draft is verified: each draft node takes a draw
of its own, and finished completions join the cache mid-batch (docs/rollout.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..adapter import adapt
from ..attention import masked_attend
from ..linear_attention import TreeLinearMixing
from ..logprobs import logprob_dtype
from .cache import DraftBudget, Drafter, DraftTree, RolloutCache, Walk, walk
from .sampling import (
    Rollout,
    check_int,
    check_sampling_args,
    draw,
    progress_bar,
    refuse_nonfinite_draws,
    sampling_probs,
    step_uniforms,
)


def check_speculative_args(cache, max_draft_tokens):
    if not isinstance(cache, RolloutCache):
        raise TypeError(f"cache must be a dta_ref.RolloutCache, got {type(cache).__name__}")
    check_int("max_draft_tokens", max_draft_tokens, 0)


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
        self.stats = {
            "generated_tokens": 0,
            "drafted_tokens": 0,
            "accepted_tokens": 0,
            "verify_steps": 0,
            "sequence_steps": 0,
        }
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


def context_and_draft_parents(context_len: int, draft: DraftTree) -> torch.Tensor:
    """Parent pointers of a context (a chain) followed by its draft tree: what linear-attention layers
    read, each draft node continuing its parent's state (a root the context's last token's)."""
    chain = list(range(-1, context_len - 1))
    return torch.tensor(chain + [context_len - 1 if p < 0 else context_len + p for p in draft.parents])


def tree_inputs(context_len: int, draft: DraftTree):
    """Positions and subtree ends of the draft nodes appended after a context of ``context_len`` tokens."""
    positions = [context_len + d for d in draft.depths()]
    ends = [context_len + e for e in draft.subtree_end()]
    return positions, ends


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
    """Exact speculative sampling with draft trees from ``cache`` (readable: recomputes the whole prefix).

    Same output distribution as :func:`sample`; each step verifies every
    sequence's draft tree with one tree-masked forward over its context plus
    the tree, and finished completions join ``cache`` as soon as they finish.
    ``progress``: a bar over generated tokens on stderr (None: only on a terminal).
    """
    prompts, params = check_sampling_args(
        model, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator
    )
    check_speculative_args(cache, max_draft_tokens)
    adapter = adapt(model)
    device, head = adapter.device, adapter.head
    run = SpeculativeRun(prompts, max_new_tokens, cache, params, max_draft_tokens, adapter.vocab_size)
    with progress_bar(progress, len(prompts) * max_new_tokens) as bar:
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
                attend = masked_attend(end, torch.arange(T, device=device), pos)
                linear = TreeLinearMixing(context_and_draft_parents(len(context), draft).to(device))
                hidden = adapter.hidden_states(ids, pos[None], attend, linear=linear)[0, len(context) - 1 :]
                probs = sampling_probs(head(hidden), params)
                n = len(draft) + 1
                tokens, logp = draw(probs, None if uniforms is None else uniforms[offset : offset + n])
                offset += n
                sampled.append(tokens.tolist())
                logprobs.append(logp.tolist())
            walks = run.finish_step(active, drafts, sampled, logprobs)
            bar.update(sum(len(w.tokens) for w in walks))
    return run.result(logprob_dtype(adapter.dtype))
