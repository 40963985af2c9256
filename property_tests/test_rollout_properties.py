"""Speculative sampling over random caches and prompts: the twins agree, greedy equals plain greedy,
completions are well formed and their logprobs are the sampling distribution's."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dta_fast
import dta_ref
from dta_ref.rollout import SamplingParams, context_logits, sampling_probs
from tests.helpers import assert_close_report, tiny_decoder

VOCAB = 8  # small, so cached continuations often match what the model samples

_model = None


def model():
    global _model
    if _model is None:
        _model = tiny_decoder(torch.float64, seed=5, vocab_size=VOCAB)
        with torch.no_grad():
            _model.lm_head.weight.mul_(6.0)
    return _model


tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5)


@given(
    prompts=st.lists(tokens, min_size=1, max_size=3),
    cached=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, VOCAB - 1), max_size=8)), max_size=6),
    temperature=st.sampled_from([0.0, 0.6, 1.0]),
    top_k=st.one_of(st.none(), st.integers(1, VOCAB)),
    top_p=st.one_of(st.none(), st.floats(0.3, 1.0)),
    eos=st.one_of(st.none(), st.integers(0, VOCAB - 1)),
    max_new_tokens=st.integers(0, 6),
    max_draft_tokens=st.integers(0, 6),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=20)
def test_speculative_twins_on_random_caches(
    prompts, cached, temperature, top_k, top_p, eos, max_new_tokens, max_draft_tokens, seed
):
    m = model()
    prompts = prompts + prompts[:1]  # a group of two siblings: one's finished completion drafts for the other
    caches = [dta_ref.RolloutCache(), dta_ref.RolloutCache()]
    for i, completion in cached:
        for cache in caches:
            cache.add(prompts[i % len(prompts)], completion)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos, max_draft_tokens=max_draft_tokens)
    ref = dta_ref.speculative_sample(
        m, prompts, max_new_tokens, cache=caches[0], generator=torch.Generator().manual_seed(seed), **kw
    )
    fast = dta_fast.speculative_sample(
        m, prompts, max_new_tokens, cache=caches[1], generator=torch.Generator().manual_seed(seed), **kw
    )
    assert ref.completions == fast.completions
    assert ref.stats == fast.stats
    params = SamplingParams(temperature, top_k, top_p, eos)
    for p, c, lp_ref, lp_fast in zip(prompts, fast.completions, ref.logprobs, fast.logprobs):
        assert len(c) <= max_new_tokens and len(lp_fast) == len(c)
        assert len(c) == max_new_tokens or (eos is not None and c[-1] == eos)
        assert eos is None or eos not in c[:-1]
        assert_close_report(lp_fast, lp_ref, 1e-9, 1e-9, "logprobs")
        if c:
            probs = sampling_probs(context_logits(m, [p + c[:t] for t in range(len(c))]), params)
            expected = probs[torch.arange(len(c)), torch.tensor(c)].log()
            assert_close_report(lp_fast, expected, 1e-9, 1e-9, "teacher-forced logprobs")
    assert fast.stats["generated_tokens"] == sum(map(len, fast.completions))
    assert fast.stats["accepted_tokens"] <= fast.stats["drafted_tokens"]
    if temperature == 0:
        assert (
            fast.completions == dta_ref.sample(m, prompts, max_new_tokens, temperature=0, eos_token_id=eos).completions
        )
