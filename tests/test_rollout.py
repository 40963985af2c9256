"""Rollouts: plain and speculative sampling are exact, the twins agree, bad input is refused."""

from __future__ import annotations

import collections
import functools
import os
import types

import pytest
import torch

import dta_fast
import dta_fast.rollout as fast_rollout
import dta_ref
from dta_fast.decode import DecodeSteps
from dta_ref.rollout import DraftTree, SamplingParams, context_logits, sampling_probs, walk
from tests.helpers import assert_close_report, tiny_decoder, tiny_family_model, tiny_hf_model

SPECULATIVE = {"ref": dta_ref.speculative_sample, "fast": dta_fast.speculative_sample}
PLAIN = {"ref": dta_ref.sample, "fast": dta_fast.sample}
PROMPTS = [[1, 2, 3], [4, 5], [1, 2, 3, 4, 5, 6, 7]]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def peaky_decoder(vocab_size, scale, seed=0, dtype=torch.float64):
    """A tiny decoder whose next-token distributions are far from uniform (so caches get accepted)."""
    model = tiny_decoder(dtype, seed=seed, vocab_size=vocab_size)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def model():
    return peaky_decoder(32, 8.0)


def cache_of(prompts, completions):
    cache = dta_ref.RolloutCache()
    for p, c in zip(prompts, completions):
        cache.add(p, c)
    return cache


def teacher_forced(model, prompt, completion, params):
    """Each completion token's log-probability under the sampling distribution, one causal forward per prefix."""
    contexts = [prompt + completion[:t] for t in range(len(completion))]
    probs = sampling_probs(context_logits(model, contexts), params)
    return probs[torch.arange(len(completion)), torch.tensor(completion)].log()


# ------------------------------------------------------------------ greedy


@pytest.mark.parametrize("engine", ["ref", "fast"])
@pytest.mark.parametrize("content", ["right", "wrong", "empty", "prefix-then-wrong"])
def test_greedy_equals_plain_greedy(model, engine, content):
    expected = dta_ref.sample(model, PROMPTS, 12, temperature=0)
    if content == "right":
        cache = cache_of(PROMPTS, expected.completions)
    elif content == "wrong":
        wrong = [[(t + 1) % 32 for t in c] for c in expected.completions]
        cache = cache_of(PROMPTS * 2, wrong + [c[::-1] for c in expected.completions])
    elif content == "prefix-then-wrong":
        cache = cache_of(PROMPTS, [c[:5] + [(t + 3) % 32 for t in c[5:]] for c in expected.completions])
    else:
        cache = dta_ref.RolloutCache()
    got = SPECULATIVE[engine](model, PROMPTS, 12, cache=cache, temperature=0, max_draft_tokens=8)
    assert got.completions == expected.completions
    for lp in got.logprobs:  # greedy draws from a point mass
        assert torch.equal(lp, torch.zeros_like(lp))
    s = got.stats
    assert s["generated_tokens"] == sum(map(len, got.completions))
    assert 0 <= s["accepted_tokens"] <= s["drafted_tokens"]
    if content == "right":  # the whole answer comes from the cache: a few steps, most tokens drafted
        assert s["verify_steps"] <= 3 and s["accepted_tokens"] >= 24  # of 36; plain greedy takes 12 steps
    if content == "empty":
        assert s["drafted_tokens"] == 0 and s["verify_steps"] == 12


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_hf_matches_generate(family):
    model = tiny_hf_model(family, torch.float64)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    expected = []
    for p in prompts:
        out = model.generate(
            torch.tensor([p]),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
        )
        expected.append(out[0, len(p) :].tolist())
    assert dta_ref.sample(model, prompts, 10, temperature=0).completions == expected
    cache = cache_of(prompts, [c[:4] + [7, 7, 7] for c in expected])
    got = dta_fast.speculative_sample(model, prompts, 10, cache=cache, temperature=0)
    assert got.completions == expected
    assert got.stats["accepted_tokens"] >= 4


# ------------------------------------------------------------------ exact distributions


V_SMALL, EOS, NEW = 5, 0, 3


@pytest.fixture(scope="module")
def small():
    return peaky_decoder(V_SMALL, 3.0, seed=0)


@torch.no_grad()
def exact_distribution(model, prompt, params):
    """Probability of every possible completion (EOS ends one early), by enumeration."""
    probs = {}

    def expand(done, p):
        if len(done) == NEW or (done and done[-1] == EOS):
            probs[tuple(done)] = p
            return
        dist = sampling_probs(context_logits(model, [prompt + done]), params)[0]
        for t in range(V_SMALL):
            if dist[t] > 0:
                expand(done + [t], p * float(dist[t]))

    expand([], 1.0)
    return probs


def chi_square_pvalue(counts: dict, expected: dict, n: int) -> float:
    """Pearson's test of sample counts against exact probabilities; bins with < 5 expected are pooled."""
    assert set(counts) <= set(expected), f"impossible completions sampled: {set(counts) - set(expected)}"
    keys = sorted(expected, key=expected.get, reverse=True)
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k in keys:
        if expected[k] * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(expected[k] * n)
        else:
            pool_o += counts.get(k, 0)
            pool_e += expected[k] * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    obs_t, exp_t = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = float(((obs_t - exp_t) ** 2 / exp_t).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0)))


SETTINGS = {
    "t1": SamplingParams(1.0, None, None, EOS),
    "t0.7-topk3": SamplingParams(0.7, 3, None, EOS),
    "t0.8-topp0.8": SamplingParams(0.8, None, 0.8, EOS),
}


def _kwargs(params):
    return dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, eos_token_id=EOS)


def _counts(completions):
    counts: dict = {}
    for c in completions:
        counts[tuple(c)] = counts.get(tuple(c), 0) + 1
    return counts


@pytest.mark.parametrize(
    "setting,sampler,content",
    [
        ("t1", "ref.sample", None),
        ("t0.7-topk3", "ref.sample", None),
        ("t1", "ref.speculative", "likely"),
        ("t1", "fast.speculative", "likely"),
        ("t1", "fast.speculative", "unlikely"),
        ("t0.7-topk3", "fast.speculative", "likely"),
        ("t0.7-topk3", "fast.speculative", "unlikely"),
        ("t0.8-topp0.8", "fast.speculative", "likely"),
        ("t0.8-topp0.8", "fast.speculative", "unlikely"),
        ("t0.8-topp0.8", "fast.sample", None),
    ],
)
def test_distribution_is_exact(small, setting, sampler, content):
    params = SETTINGS[setting]
    prompt = [1, 2]
    expected = exact_distribution(small, prompt, params)
    n = 700 if sampler.startswith("ref") else 3000  # the reference recomputes every prefix: fewer samples
    kw = _kwargs(params)
    if sampler.endswith("sample"):
        fn = dta_ref.sample if sampler.startswith("ref") else dta_fast.sample
        out = fn(small, [prompt] * n, NEW, generator=gen(11), **kw)
    else:
        ranked = sorted(expected, key=expected.get, reverse=content == "likely")
        cache = cache_of([prompt] * 6, [list(c) + [4, 4] for c in ranked[:6]])  # drafts run past EOS too
        fn = SPECULATIVE[sampler.split(".")[0]]
        out = fn(small, [prompt] * n, NEW, cache=cache, generator=gen(11), max_draft_tokens=4, **kw)
        assert out.stats["drafted_tokens"] > 0
        if content == "likely":
            assert out.stats["accepted_tokens"] > 0
    pvalue = chi_square_pvalue(_counts(out.completions), expected, n)
    assert pvalue > 1e-3, f"completions are not distributed as the policy: p = {pvalue:.2e}"


def test_chi_square_detects_a_wrong_distribution(small):
    """The test above has power: samples at temperature 1 fail against the temperature-0.7 law."""
    prompt, n = [1, 2], 3000
    out = dta_fast.sample(small, [prompt] * n, NEW, generator=gen(11), **_kwargs(SETTINGS["t1"]))
    wrong = exact_distribution(small, prompt, SamplingParams(0.7, None, None, EOS))
    assert chi_square_pvalue(_counts(out.completions), wrong, n) < 1e-6


def test_sampling_probs_by_hand():
    """The sampling law written out by hand (every distribution test above takes its expected law from
    sampling_probs itself): top-p keeps up to and including the token that reaches it, exactly at a tie,
    and renormalises; top-k keeps ties; temperature divides; greedy takes the first argmax."""
    quarters = torch.tensor([[0.5, 0.25, 0.125, 0.125]], dtype=torch.float64).log()
    law = lambda **kw: sampling_probs(quarters, SamplingParams(**kw))[0].tolist()  # noqa: E731
    assert law(top_p=0.75) == [2 / 3, 1 / 3, 0.0, 0.0]  # mass above the third token is exactly 0.75: left out
    assert law(top_p=0.7) == [2 / 3, 1 / 3, 0.0, 0.0]
    assert law(top_p=0.5) == [1.0, 0.0, 0.0, 0.0]
    assert law(top_p=0.8) == pytest.approx([4 / 7, 2 / 7, 1 / 7, 0.0], abs=1e-15)  # the later of two equal ones out
    assert law(top_k=3) == pytest.approx([4 / 8, 2 / 8, 1 / 8, 1 / 8], abs=1e-15)  # the tie at the 3rd is kept
    assert law(top_k=1) == [1.0, 0.0, 0.0, 0.0]
    assert law(temperature=0.5) == pytest.approx([16 / 22, 4 / 22, 1 / 22, 1 / 22], abs=1e-15)
    assert law(temperature=0.5, top_p=0.8) == pytest.approx([0.8, 0.2, 0.0, 0.0], abs=1e-15)
    assert law(temperature=0) == [1.0, 0.0, 0.0, 0.0]
    ties = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    assert sampling_probs(ties, SamplingParams(temperature=0))[0].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_walk_rule():
    """Accept while the drawn token is a child; emit the first token that is not; stop at EOS."""
    draft = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, 0, 0, -1])  # 5 -> {6, 7}; 8
    assert walk(draft, [5, 7, 9, 9, 9], frozenset()).tokens == [5, 7, 9]
    assert walk(draft, [5, 7, 9, 9, 9], frozenset()).rows == [0, 1, 3]
    assert walk(draft, [5, 7, 9, 9, 9], frozenset()).accepted == 2
    assert walk(draft, [5, 9, 7, 9, 9], frozenset()).tokens == [5, 9]
    assert walk(draft, [3, 9, 9, 9, 9], frozenset()).tokens == [3]
    assert walk(draft, [5, 0, 9, 9, 9], frozenset({5})).tokens == [5]  # EOS ends even inside the draft
    assert walk(draft, [5, 0, 9, 9, 9], frozenset({5})).accepted == 1  # ... and counts as drafted there
    assert walk(draft, [5, 7, 9, 9, 9], frozenset({7})).accepted == 2
    assert walk(draft, [6, 7, 9, 9, 9], frozenset({6})).accepted == 0  # an EOS not in the draft


# ------------------------------------------------------------------ logprobs and EOS


@pytest.mark.parametrize("engine", ["ref", "fast"])
def test_logprobs_equal_teacher_forced(model, engine):
    base = dta_ref.sample(model, PROMPTS, 8, temperature=1.0, generator=gen(1))
    cache = cache_of(PROMPTS, base.completions)
    # temperature 1 without truncation: the behaviour logprobs are the model's own (flat_logprobs)
    out = SPECULATIVE[engine](model, PROMPTS, 8, cache=cache, generator=gen(2))
    flat = dta_ref.flat_logprobs(model, [p + c for p, c in zip(PROMPTS, out.completions)])
    for i, (p, c) in enumerate(zip(PROMPTS, out.completions)):
        assert_close_report(out.logprobs[i], flat[i, len(p) - 1 : len(p) - 1 + len(c)], 1e-10, 1e-10, f"seq {i}")
    params = SamplingParams(0.8, 6, 0.9, None)
    out = SPECULATIVE[engine](
        model, PROMPTS, 8, cache=cache, generator=gen(3), **_kwargs(params) | {"eos_token_id": None}
    )
    assert out.stats["accepted_tokens"] > 0
    for i, (p, c) in enumerate(zip(PROMPTS, out.completions)):
        assert_close_report(out.logprobs[i], teacher_forced(model, p, c, params), 1e-10, 1e-10, f"seq {i}")


@pytest.mark.parametrize("engine", ["ref", "fast"])
def test_eos_ends_a_completion_even_inside_a_draft(model, engine):
    greedy = dta_ref.sample(model, PROMPTS, 8, temperature=0).completions
    k = next(k for k in range(2, 8) if greedy[0][k] not in greedy[0][:k])
    eos = greedy[0][k]
    cache = cache_of(PROMPTS, greedy)  # the drafts run on past the EOS token
    out = SPECULATIVE[engine](model, PROMPTS, 8, cache=cache, temperature=0, eos_token_id=eos)
    expected = dta_ref.sample(model, PROMPTS, 8, temperature=0, eos_token_id=eos).completions
    assert out.completions == expected
    assert out.completions[0] == greedy[0][: k + 1]
    for c in out.completions:
        assert eos not in c[:-1] and len(c) <= 8
        assert len(c) == 8 or c[-1] == eos
    none = SPECULATIVE[engine](model, PROMPTS, 0, cache=cache)
    assert none.completions == [[], [], []] and all(lp.numel() == 0 for lp in none.logprobs)


# ------------------------------------------------------------------ twins


def _assert_twins(a, b):
    assert a.completions == b.completions
    assert a.stats == b.stats
    for x, y in zip(a.logprobs, b.logprobs):
        assert_close_report(y, x, 1e-9, 1e-9, "logprobs")


def test_twins_agree_decoder(model):
    kw = dict(temperature=0.9, top_p=0.95, eos_token_id=7, max_draft_tokens=6)
    prompts = PROMPTS * 3
    base = dta_fast.sample(model, prompts, 10, temperature=0.9, generator=gen(4))
    ref = dta_ref.speculative_sample(
        model, prompts, 10, cache=cache_of(prompts, base.completions), generator=gen(5), **kw
    )
    fast = dta_fast.speculative_sample(
        model, prompts, 10, cache=cache_of(prompts, base.completions), generator=gen(5), **kw
    )
    _assert_twins(ref, fast)
    assert ref.stats["accepted_tokens"] > 0
    _assert_twins(
        dta_ref.sample(model, PROMPTS, 6, generator=gen(6)), dta_fast.sample(model, PROMPTS, 6, generator=gen(6))
    )


@pytest.mark.parametrize("window", [None, 3])
def test_decode_steps_attend_as_the_tree_mask_says(window):
    """The decode route (SDPA with the tree's mask) computes dta_ref's masked attention on a cached batch
    (ragged rows, an unused gap, GQA, a window); sinks and softcaps go to the fallback, built once."""
    from dta_fast.dispatch import sdpa_attend
    from dta_ref.attention import masked_attend

    g = torch.Generator().manual_seed(0)
    B, W, Tq, Hq, Hkv, D = 3, 12, 1, 4, 2, 8
    ends = torch.arange(1, W + 1).repeat(B, 1)  # the gap: seen by nobody
    depths = torch.zeros(B, W, dtype=torch.long)
    for b, n in enumerate((9, 4, 0)):  # cached tokens per row, then the row's new token at W - 1
        ends[b, :n] = W
        depths[b, :n] = torch.arange(n)
        depths[b, W - 1] = n
    q, k, v = (torch.randn(B, h, t, D, dtype=torch.float64, generator=g) for h, t in ((Hq, Tq), (Hkv, W), (Hkv, W)))
    want = masked_attend(ends, torch.arange(W - Tq, W), depths)
    built = []

    def fallback():
        built.append(1)
        return want

    got = sdpa_attend(ends, Tq, depths, fallback)
    torch.testing.assert_close(got(0, q, k, v, 0.3, window=window), want(0, q, k, v, 0.3, window=window))
    sinks = torch.randn(Hq, dtype=torch.float64, generator=g)
    for _ in range(2):
        torch.testing.assert_close(got(1, q, k, v, 0.3, window=window, sinks=sinks),
                                   want(1, q, k, v, 0.3, window=window, sinks=sinks))  # fmt: skip
    assert built == [1]


def _spy_decode_steps(monkeypatch):
    """The results of every fixed-shape decode step (None: the model's attention sent it back)."""
    served = []
    original = DecodeSteps.__call__

    def spy(self, *args):
        served.append(original(self, *args))
        return served[-1]

    monkeypatch.setattr(DecodeSteps, "__call__", spy)
    return served


def test_plain_decode_steps_run_at_fixed_shapes(model, monkeypatch):
    """Plain sampling's decode steps run as fixed-shape steps, their K/V written in place (nothing moves
    after them), through rows of different lengths and rows finishing (kept in the buffers until half
    are: a finished row is no new shape); the draws are dta_ref's, with sinks, softcaps and sliding
    windows too. A run that has verified a draft keeps the tree attention."""
    served = _spy_decode_steps(monkeypatch)
    moved = []  # per step: whether its K/V move after the step
    commit = fast_rollout.KVEngine.commit

    def spy(self, verified, *args):
        moved.append(not verified.in_place)
        return commit(self, verified, *args)

    monkeypatch.setattr(fast_rollout.KVEngine, "commit", spy)
    out = dta_fast.sample(model, PROMPTS, 6, generator=gen(6))
    assert len(served) == out.stats["verify_steps"] - 1
    assert moved == [True] + [False] * (out.stats["verify_steps"] - 1)
    base = dta_fast.sample(model, PROMPTS * 3, 12, generator=gen(2), temperature=0.9)
    eos = collections.Counter(t for c in base.completions for t in c[1:]).most_common(1)[0][0]
    served.clear()
    compacted = []
    compact = fast_rollout.KVEngine._compact
    monkeypatch.setattr(fast_rollout.KVEngine, "_compact", lambda self: compacted.append(1) or compact(self))
    kw = dict(temperature=0.9, eos_token_id=eos)  # the rows finish at different steps
    ref, fast = (s(model, PROMPTS * 3, 12, generator=gen(2), **kw) for s in (dta_ref.sample, dta_fast.sample))
    _assert_twins(ref, fast)
    assert len(served) == fast.stats["verify_steps"] - 1
    # finished rows stay in the buffers until half the rows are finished: fewer compactions than finishes
    assert len(compacted) < len({len(c) for c in fast.completions}), (compacted, fast.completions)
    # speculative: a step with drafts takes the tree attention, one without (the cache's drafts used up)
    # is a fixed-shape step, also after drafted steps, whose rejected tokens' K/V were zeroed
    short = [c[:4] for c in dta_fast.sample(model, PROMPTS, 10, generator=gen(4)).completions]
    served.clear()
    clean = []  # after each general step: every slot past a row's length is zero
    monkeypatch.setattr(fast_rollout.KVEngine, "commit", commit)

    def checked(self, verified, *args):
        commit(self, verified, *args)
        if not verified.in_place:
            clean.append(all(bool(buf[i, :, n:].eq(0).all()) for buf in (*self.keys.values(), *self.values.values())
                             for i, n in zip(self.rows, (self.lengths[b] for b in self.rows))))  # fmt: skip

    monkeypatch.setattr(fast_rollout.KVEngine, "commit", checked)
    kw = dict(temperature=0.9, max_draft_tokens=4)
    ref, spec = (
        s(model, PROMPTS, 10, cache=cache_of(PROMPTS, short), generator=gen(5), **kw) for s in SPECULATIVE.values()
    )
    _assert_twins(ref, spec)
    assert spec.stats["accepted_tokens"] > 0 and 0 < len(served) < spec.stats["verify_steps"] - 1
    assert clean and all(clean)
    for family in ("gpt-oss", "gemma2"):  # sinks and a window; softcaps: the softmax written out
        variant = tiny_family_model(family, torch.float64)
        served.clear()
        ref, fast = (s(variant, [[3, 1, 4], [1, 5]], 12, generator=gen(1)) for s in (dta_ref.sample, dta_fast.sample))
        _assert_twins(ref, fast)
        assert len(served) == fast.stats["verify_steps"] - 1


@pytest.mark.parametrize("captures", ["succeed", "fail"])
def test_decode_graph_orchestration(model, captures, monkeypatch):
    """The capture logic off CUDA, with a stand-in for the capture: the second call at a shape captures
    (its warm-up's draws stand), later calls replay, a grown or compacted buffer is never replayed through
    a graph of the old one (plain runs with rows finishing; a speculative run whose drafted steps grow the
    buffers between fixed-shape ones), and a failed capture leaves the run eager; the draws are dta_ref's."""
    import dta_fast.decode as decode

    engines, captured = [], []
    init = DecodeSteps.__init__

    def on_cuda(self, *args):
        init(self, *args)
        self.capture = True  # as on CUDA
        engines.append(self)

    def buffers():
        engine = engines[-1].engine
        return [id(t) for t in (*engine.keys.values(), *engine.values.values())]

    class Replay:
        def __init__(self, fn):
            self.fn, self.buffers = fn, buffers()

        def replay(self):
            assert buffers() == self.buffers, "a graph replayed over buffers it was not captured with"
            self.fn()

        def pool(self):
            return None

    def stand_in(fn, pool, device):
        fn()  # the warm-up
        captured.append(1)
        if captures == "fail":
            raise RuntimeError("operation not permitted when stream is capturing")
        return types.SimpleNamespace(graph=Replay(fn))

    monkeypatch.setattr(DecodeSteps, "__init__", on_cuda)
    monkeypatch.setattr(decode, "capture", stand_in)
    monkeypatch.setattr(fast_rollout, "FIRST_NEW_TOKENS", 4)  # the buffers grow
    base = dta_fast.sample(model, PROMPTS * 3, 40, generator=gen(2), temperature=0.9)
    eos = collections.Counter(t for c in base.completions for t in c[1:]).most_common(2)[1][0]
    kw = dict(temperature=0.9, eos_token_id=eos)
    captured.clear()
    ref, fast = (s(model, PROMPTS * 3, 40, generator=gen(3), **kw) for s in (dta_ref.sample, dta_fast.sample))
    _assert_twins(ref, fast)
    assert len({len(c) for c in fast.completions}) > 2
    if captures == "succeed":
        assert len(captured) > 1 and engines[-1].replays > len(captured)
    else:
        assert captured == [1] and engines[-1].replays == 0 and not engines[-1].capture
    # speculative: fixed-shape steps between drafted ones, whose windows grow the buffers under a key range
    # already captured
    prompts = PROMPTS * 2
    base = dta_fast.sample(model, prompts, 60, generator=gen(3), temperature=0.9).completions
    kw = dict(temperature=0.9, max_draft_tokens=8, generator=gen(103))
    short = [c[: 10 + 3 * i] for i, c in enumerate(base)]
    ref = dta_ref.speculative_sample(model, prompts, 60, cache=cache_of(prompts, short), **kw)
    kw["generator"] = gen(103)
    fast = dta_fast.speculative_sample(model, prompts, 60, cache=cache_of(prompts, short), **kw)
    _assert_twins(ref, fast)


def test_empty_cache_speculative_equals_plain(model):
    """No drafts: the speculative samplers draw exactly like plain sampling, token for token."""
    plain = dta_ref.sample(model, PROMPTS, 8, generator=gen(7), top_k=10)
    for fn in SPECULATIVE.values():
        assert (
            fn(model, PROMPTS, 8, cache=dta_ref.RolloutCache(), generator=gen(7), top_k=10).completions
            == plain.completions
        )


def test_fast_kv_buffers_grow_with_the_completions(model, monkeypatch):
    """dta_fast's KV buffers start small and double as the completions grow: the draws are still the
    twin's, through several growths with drafts, and a huge max_new_tokens or max_draft_tokens allocates
    for what is generated, not for the limit (it had allocated for the limit up front)."""
    grown = []  # (capacity before, capacity after, the most a run needs)
    original = fast_rollout.KVEngine.grow

    def spy(self, window):
        before = self.capacity
        original(self, window)
        grown.append((before, self.capacity, self.most))

    monkeypatch.setattr(fast_rollout.KVEngine, "grow", spy)
    monkeypatch.setattr(fast_rollout, "FIRST_NEW_TOKENS", 4)
    prompts = PROMPTS * 2
    base = dta_fast.sample(model, prompts, 120, temperature=0.9, generator=gen(4))
    kw = dict(temperature=0.9, max_draft_tokens=6, generator=gen(5))
    ref = dta_ref.speculative_sample(model, prompts, 120, cache=cache_of(prompts, base.completions), **kw)
    kw["generator"] = gen(5)
    fast = dta_fast.speculative_sample(model, prompts, 120, cache=cache_of(prompts, base.completions), **kw)
    _assert_twins(ref, fast)
    assert len(grown) >= 2 and fast.stats["accepted_tokens"] > 0
    # doubling, not a step per token: copies stay linear in the completion's length
    assert all(after >= min(2 * before, most) for before, after, most in grown), grown
    monkeypatch.undo()
    # 10**8 new tokens for a prompt whose completion ends at its first token (greedy, EOS = that token)
    first = dta_ref.sample(model, [[1, 2]], 1, temperature=0).completions[0][0]
    for engine in (
        dta_fast.sample,
        lambda *a, **k: dta_fast.speculative_sample(*a, cache=dta_ref.RolloutCache(), max_draft_tokens=10**9, **k),
    ):
        assert engine(model, [[1, 2]], 10**8, temperature=0, eos_token_id=first).completions == [[first]]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_twins_agree_hf(family):
    model = tiny_hf_model(family, torch.float64)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [3, 1, 4]]
    base = dta_ref.sample(model, prompts, 6, generator=gen(8))
    kw = dict(generator=gen(9), max_draft_tokens=5)
    ref = dta_ref.speculative_sample(model, prompts * 2, 6, cache=cache_of(prompts, base.completions), **kw)
    kw["generator"] = gen(9)
    fast = dta_fast.speculative_sample(model, prompts * 2, 6, cache=cache_of(prompts, base.completions), **kw)
    _assert_twins(ref, fast)


def test_fast_engine_with_the_kernel(monkeypatch):
    """The Triton tree-attention route (interpreted on CPU) verifies drafts like the explicit mask."""
    if os.environ.get("TRITON_INTERPRET") != "1":  # on a GPU machine test_cuda_engine_with_the_kernel runs it
        pytest.skip("CPU tensors through the kernel need the interpreter (TRITON_INTERPRET=1)")
    model = peaky_decoder(32, 8.0, dtype=torch.float32)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    expected = dta_ref.sample(model, prompts, 6, temperature=0).completions
    cache = cache_of(prompts, [c[:3] + [0, 0] for c in expected])
    monkeypatch.setattr(fast_rollout, "uses_kernel", lambda device: True)
    out = dta_fast.speculative_sample(model, prompts, 6, cache=cache, temperature=0, max_draft_tokens=4)
    assert out.completions == expected
    assert out.stats["accepted_tokens"] >= 2


# ------------------------------------------------------------------ the cache


def test_cache_drafts_most_frequent_first_and_bounded():
    cache = dta_ref.RolloutCache(max_tokens_per_prompt=40)
    for c in ([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4], [1, 7]):
        cache.add([9, 9], c)
    tree = cache.draft([9, 9], [], 5)
    assert tree.tokens == [1, 2, 3, 4, 7] and tree.parents == [-1, 0, 1, 2, 0]  # ties: the most recent first
    assert cache.draft([9, 9], [1, 2], 2).tokens == [3, 4]
    assert cache.draft([9, 9], [5, 1], 1).tokens == [2]  # suffix match: "1" was followed by 2 most often
    assert cache.draft([8], [1], 4).tokens == []  # another prompt: nothing cached
    tree = cache.draft([9, 9], [], 3)
    assert len(tree) == 3 and tree.subtree_end() == [3, 3, 3]
    for i in range(20):
        cache.add([9, 9], [i % 7] * 5)
    assert cache.num_tokens([9, 9]) <= 40
    assert cache.draft([9, 9], [], 3).tokens == [5, 5, 5]  # the newest completions survive
    # the generated tokens are checked as a prompt's are (empty allowed), not matched as other numbers
    assert cache.draft([9, 9], torch.tensor([5, 5], dtype=torch.int32), 1).tokens == [5]
    for generated, exc in (
        ([-1, 3], ValueError),
        ([True], TypeError),
        ("ab", TypeError),
        ([3.0], TypeError),
        (5, TypeError),
    ):
        with pytest.raises(exc, match="sequence 0|generated must be"):
            cache.draft([9, 9], generated, 2)


def test_cache_bounded_across_prompts():
    """max_tokens bounds the whole cache: the prompt least recently added to or drafted from goes first,
    the one just added to stays; clear() empties it."""
    cache = dta_ref.RolloutCache(max_tokens=30)
    for p in ([1], [2], [3]):
        cache.add(p, [p[0]] * 10)
    assert cache.num_tokens() == 30 and len(cache) == 3
    assert cache.draft([1], [], 3).tokens == [1, 1, 1]  # [1] is now the most recently used
    cache.add([4], [4] * 10)  # 40 tokens: [2], the least recently used, goes
    assert cache.num_tokens() == 30 and cache.num_tokens([2]) == 0 and cache.draft([2], [], 3).tokens == []
    assert [cache.num_tokens([p]) for p in (1, 3, 4)] == [10, 10, 10]
    cache.add([5], [5] * 25)  # larger than what is left: every older prompt goes, the new one stays
    assert len(cache) == 1 and cache.num_tokens() == 25 and cache.draft([5], [], 2).tokens == [5, 5]
    cache.add([5, 6], [7, 8])  # a later turn of [5], stored under it
    assert len(cache) == 1 and cache.num_tokens() == 25 + 3
    cache.clear()
    assert len(cache) == 0 and cache.num_tokens() == 0 and cache.draft([5], [], 2).tokens == []
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        dta_ref.RolloutCache(max_tokens=0)


def test_cache_serves_a_later_turn():
    """A prompt extending a cached prompt (the next turn) drafts from what followed that context before."""
    cache = dta_ref.RolloutCache()
    cache.add([1, 2], [3, 4, 5])
    cache.add([1, 2, 3, 4, 5, 6], [7, 8, 9])  # turn 2: turn 1's context plus a tool output (6)
    assert len(cache) == 1
    assert cache.draft([1, 2, 3, 4, 5, 6], [], 3).tokens == [7, 8, 9]
    assert cache.draft([1, 2, 3, 4, 5, 6], [7], 2).tokens == [8, 9]


def test_drafter_follows_a_growing_sequence():
    cache = dta_ref.RolloutCache()
    cache.add([9], [1, 2, 3, 4, 5, 6, 7, 8])
    drafter = cache.drafter([9])
    assert drafter.draft([], 3).tokens == [1, 2, 3]
    assert drafter.draft([1, 2], 3).tokens == [3, 4, 5]  # pointers moved along, no new search
    assert drafter.draft([1, 2, 3, 0], 3).tokens == []  # diverged: "0" never occurs
    assert drafter.draft([1, 2, 3, 0, 5], 2).tokens == [6, 7]  # found again by the suffix "5"
    cache.add([9], [1, 2, 3, 0, 5, 9, 9])  # a sibling finished: new sources are picked up
    assert drafter.draft([1, 2, 3, 0, 5], 2).tokens == [9, 9]  # the longer match ranks first
    with pytest.raises(ValueError, match="may only be appended"):
        drafter.draft([1], 2)


# ------------------------------------------------------------------ bad input


BAD = [
    ("empty-prompts", dict(prompts=[]), ValueError, "prompts is empty"),
    ("empty-prompt", dict(prompts=[[1], []]), ValueError, "sequence 1 is empty"),
    ("negative-token", dict(prompts=[[1, -2]]), ValueError, "non-negative"),
    ("float-token", dict(prompts=[[1.0, 2.0]]), TypeError, "tokens must be ints"),
    ("not-a-list", dict(prompts=torch.tensor([[1, 2]])), TypeError, "prompts must be a list"),
    ("token-out-of-vocab", dict(prompts=[[1, 999]]), ValueError, "out of range"),
    ("negative-max-new", dict(max_new_tokens=-1), ValueError, "max_new_tokens must be >= 0"),
    ("float-max-new", dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an int"),
    ("negative-temperature", dict(temperature=-0.5), ValueError, "temperature must be"),
    ("subnormal-temperature", dict(temperature=1e-40), ValueError, "the scaled logits overflow"),
    ("nan-temperature", dict(temperature=float("nan")), ValueError, "temperature must be"),
    ("int-temperature-past-floats", dict(temperature=10**400), ValueError, "temperature must be"),
    ("top-p-zero", dict(top_p=0.0), ValueError, "top_p must be in"),
    ("top-p-above-one", dict(top_p=1.5), ValueError, "top_p must be in"),
    ("top-k-zero", dict(top_k=0), ValueError, "top_k must be >= 1"),
    ("top-k-float", dict(top_k=2.5), TypeError, "top_k must be an int"),
    ("eos-negative", dict(eos_token_id=-1), ValueError, "eos_token_id must be >= 0"),
    ("eos-list-negative", dict(eos_token_id=[3, -1]), ValueError, "eos_token_id must be >= 0"),
    ("eos-list-empty", dict(eos_token_id=[]), ValueError, "eos_token_id is an empty list"),
    ("eos-list-out-of-vocab", dict(eos_token_id=[3, 99]), ValueError, "out of range"),
    ("eos-past-int64", dict(eos_token_id=[1, 2**64]), ValueError, "eos_token_id 18446744073709551616 is out of range"),
    ("eos-string", dict(eos_token_id="3"), TypeError, "eos_token_id must be an int, a list of ints or None"),
    ("generator-type", dict(generator=0), TypeError, "generator must be"),
]


@pytest.mark.parametrize("sampler", ["ref.sample", "fast.sample", "ref.speculative", "fast.speculative"])
@pytest.mark.parametrize("change,exc,match", [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_input(model, sampler, change, exc, match):
    args = dict(prompts=[[1, 2]], max_new_tokens=2) | change
    kwargs = {k: v for k, v in args.items() if k not in ("prompts", "max_new_tokens")}
    if sampler.endswith("speculative"):
        fn = SPECULATIVE[sampler.split(".")[0]]
        kwargs["cache"] = dta_ref.RolloutCache()
    else:
        fn = PLAIN[sampler.split(".")[0]]
    with pytest.raises(exc, match=match):
        fn(model, args["prompts"], args["max_new_tokens"], **kwargs)


@pytest.mark.parametrize("sampler", ["ref.sample", "fast.sample", "ref.speculative", "fast.speculative"])
def test_head_with_more_logits_than_embedding_rows_is_refused(sampler):
    """A sampled id the embedding has no row for could not be fed back: refused before any draw, not an
    IndexError (a device-side assert on CUDA) at the first such draw."""
    hf = tiny_hf_model("llama", torch.float32)
    hf.lm_head = torch.nn.Linear(hf.config.hidden_size, hf.config.vocab_size + 16, bias=False)
    engine, kind = sampler.split(".")
    fn = (
        functools.partial(SPECULATIVE[engine], cache=dta_ref.RolloutCache()) if kind == "speculative" else PLAIN[engine]
    )
    with pytest.raises(ValueError, match=f"output head gives {hf.config.vocab_size + 16} logits but its embedding"):
        fn(hf, [[1, 2]], 2)


@pytest.mark.parametrize("engine", ["ref", "fast"])
def test_bad_speculative_input(model, engine):
    with pytest.raises(TypeError, match="cache must be a dta_ref.RolloutCache"):
        SPECULATIVE[engine](model, [[1]], 2, cache={})
    with pytest.raises(ValueError, match="max_draft_tokens must be >= 0"):
        SPECULATIVE[engine](model, [[1]], 2, cache=dta_ref.RolloutCache(), max_draft_tokens=-1)
    with pytest.raises(TypeError, match="unsupported model"):
        SPECULATIVE[engine](torch.nn.Linear(2, 2), [[1]], 2, cache=dta_ref.RolloutCache())


@pytest.mark.parametrize("engine", ["ref", "fast"])
def test_cache_of_another_vocabulary_is_refused(model, engine):
    """A cache holding ids the model does not have (filled with another tokenizer) is a clear error, not an
    index error in the embedding (a device-side assert on CUDA)."""
    cache = dta_ref.RolloutCache()
    cache.add([3], [40, 41])  # the model's vocabulary has 32 tokens
    with pytest.raises(ValueError, match="drafted token 41, out of range for the model.s vocabulary of 32"):
        SPECULATIVE[engine](model, [[3]], 3, cache=cache, temperature=0)


@pytest.mark.parametrize("engine", ["ref", "fast"])
def test_several_eos_tokens(model, engine):
    """eos_token_id=[a, b] (chat models end turns with several): a completion ends at the first of either.
    One prompt draws one uniform per step whatever ends it, so the completion is the one without an EOS,
    cut after its first a or b; speculative sampling with a fresh cache drafts nothing, so it is too."""
    frees = [
        PLAIN[engine](model, [[1, 2]], 12, temperature=1.5, generator=gen(seed)).completions[0] for seed in range(6)
    ]
    eos = [frees[0][3], frees[1][2]]  # tokens these completions draw early
    cut = 0
    for seed, free in enumerate(frees):
        ends = [t for t, x in enumerate(free) if x in eos]
        want = free[: ends[0] + 1] if ends else free
        cut += bool(ends) and ends[0] < len(free) - 1
        for out in (
            PLAIN[engine](model, [[1, 2]], 12, temperature=1.5, eos_token_id=eos, generator=gen(seed)),
            SPECULATIVE[engine](
                model,
                [[1, 2]],
                12,
                cache=dta_ref.RolloutCache(),
                temperature=1.5,
                eos_token_id=tuple(eos),
                generator=gen(seed),
            ),
        ):
            assert out.completions[0] == want, seed
            assert len(out.logprobs[0]) == len(want)
    assert cut  # some completion did stop early, so the check means something


@pytest.mark.parametrize("sampler", ["ref.sample", "fast.sample", "ref.speculative", "fast.speculative"])
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_nonfinite_logits_are_an_error(sampler, greedy):
    """Logits with a NaN (a diverged update) have no distribution to draw from: a ValueError naming the
    prompt, not a token picked by the search's rounding or by argmax landing on the NaN."""
    model = peaky_decoder(32, 8.0)
    with torch.no_grad():
        model.lm_head.weight[7] = float("nan")
    engine, kind = sampler.split(".")
    fn = SPECULATIVE[engine] if kind == "speculative" else PLAIN[engine]
    kwargs = dict(cache=dta_ref.RolloutCache()) if kind == "speculative" else {}
    with pytest.raises(ValueError, match="prompt 0: the model's next-token logits are not finite"):
        fn(model, [[1, 2]], 4, temperature=0 if greedy else 1.0, generator=gen(), **kwargs)


@pytest.mark.parametrize("sampler", ["ref", "fast"])
def test_numpy_scalars_are_numbers(model, sampler):
    import numpy as np

    plain = PLAIN[sampler](model, [[1, 2]], 3, temperature=0.7, top_k=5, eos_token_id=3, generator=gen())
    numpy = PLAIN[sampler](
        model,
        [[1, 2]],
        np.int64(3),
        temperature=np.float32(0.7),
        top_k=np.int64(5),
        eos_token_id=np.int64(3),
        generator=gen(),
    )
    assert numpy.completions == plain.completions


ALL_SAMPLERS = ["ref.sample", "fast.sample", "ref.speculative", "fast.speculative"]


def sampler_fn(sampler, cache_from=None):
    """The sampler named ``engine.kind``; a speculative one gets a fresh cache (of ``cache_from``'s completions)."""
    engine, kind = sampler.split(".")
    if kind != "speculative":
        return PLAIN[engine]
    completions = [] if cache_from is None else cache_from.completions
    return lambda *a, **k: SPECULATIVE[engine](*a, cache=cache_of(PROMPTS, completions), **k)


@pytest.mark.parametrize("sampler", ALL_SAMPLERS)
def test_progress_bar_on_stderr_changes_no_draw(model, sampler, capsys):
    """progress=True draws a bar over the generated tokens on stderr and draws the same tokens as
    progress=False; by default (None) the bar shows only on a terminal, which a captured stderr is not."""
    base = dta_ref.sample(model, PROMPTS, 8, temperature=0.9, generator=gen(4))
    capsys.readouterr()
    kw = dict(temperature=0.9, eos_token_id=base.completions[0][2])  # some completion ends early
    runs = {}
    for progress in (False, None, True):
        runs[progress] = sampler_fn(sampler, base)(model, PROMPTS, 8, generator=gen(4), progress=progress, **kw)
        runs[progress, "stderr"] = capsys.readouterr().err
    assert runs[False, "stderr"] == runs[None, "stderr"] == ""
    n = runs[True].stats["generated_tokens"]
    assert n < 8 * len(PROMPTS) and "sampling" in runs[True, "stderr"]
    assert f"| {n}/{n} [" in runs[True, "stderr"]  # an early end reads done
    for progress in (None, True):
        _assert_twins(runs[False], runs[progress])


@pytest.mark.parametrize("sampler", ALL_SAMPLERS)
def test_progress_must_be_a_bool_or_none(model, sampler):
    for progress in (1, "yes"):
        with pytest.raises(TypeError, match=f"progress must be a bool or None, got {type(progress).__name__}"):
            sampler_fn(sampler)(model, [[1, 2]], 2, progress=progress)


def test_bad_cache_and_rollout_arguments():
    cache = dta_ref.RolloutCache()
    for completion in (None, 5, "12"):
        with pytest.raises(TypeError, match="completion must be a list of token ids"):
            cache.add([1], completion)
    with pytest.raises(ValueError, match="completion: sequence 0: tokens must be non-negative"):
        cache.add([1], [2, -3])
    with pytest.raises(TypeError, match="max_draft_tokens must be an int"):
        cache.draft([1], [], "3")
    rollout = dta_ref.Rollout([[5]], [torch.zeros(1)])
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        rollout.padded_logprobs([[]])


def test_rl_loop_generate_then_tree_backward(model):
    """docs/rollout.md's loop: the behaviour logprobs are the policy's own at the first update (ratio 1)."""
    cache = dta_ref.RolloutCache()
    prompts = [p for p in PROMPTS[:2] for _ in range(3)]  # groups of 3
    for step in range(2):  # the cache carries over: the second step drafts from the first
        out = dta_fast.speculative_sample(model, prompts, 6, cache=cache, generator=gen(20 + step))
    assert out.stats["drafted_tokens"] > 0
    tree = dta_fast.build_tree([p + c for p, c in zip(prompts, out.completions)])
    old = out.padded_logprobs(prompts)
    mask = tree.response_mask(torch.tensor([len(p) for p in prompts]))
    advantages = torch.linspace(-1, 1, len(prompts), dtype=torch.float64)
    loss_fn = dta_ref.PolicyGradientLoss(old, advantages, mask, normalization="token_mean")
    model.zero_grad()
    logprobs, loss = dta_fast.tree_backward(model, tree, loss_fn)
    # the layout and the values (tree_backward's own tests hold its precision; float32 level is enough here)
    assert_close_report(logprobs.detach().masked_fill(~mask, 0), old, 1e-6, 1e-6, "tree vs behaviour logprobs")
    assert_close_report(dta_ref.tree_logprobs(model, tree).detach().masked_fill(~mask, 0), old, 1e-10, 1e-10, "exact")
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.zero_grad()


@pytest.mark.gpu
@pytest.mark.parametrize("first_new_tokens", [fast_rollout.FIRST_NEW_TOKENS, 4], ids=["roomy", "growing"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_engine_with_the_kernel(dtype, first_new_tokens, monkeypatch):
    """On CUDA the engine verifies drafts with the compiled kernel: greedy equals the reference,
    sampled logprobs equal teacher-forced ones (ragged prompts, a cache with right and wrong drafts),
    also when the KV buffers start small and grow during the run."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(fast_rollout, "FIRST_NEW_TOKENS", first_new_tokens)
    model = tiny_hf_model("llama", torch.float32).cuda()
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]] * 3
    expected = dta_ref.sample(model, prompts, 24, temperature=0).completions
    cache = cache_of(prompts, [c[:10] + [(t + 1) % 64 for t in c[10:]] for c in expected])
    model = model.to(dtype)
    if dtype == torch.float32:
        got = dta_fast.speculative_sample(model, prompts, 24, cache=cache, temperature=0)
        assert got.completions == expected and got.stats["accepted_tokens"] > 0
    g = torch.Generator(device="cuda").manual_seed(0)
    out = dta_fast.speculative_sample(model, prompts, 24, cache=cache, generator=g)
    with torch.no_grad():
        flat = dta_ref.flat_logprobs(model, [p + c for p, c in zip(prompts, out.completions)])
    tol = 1e-4 if dtype == torch.float32 else 0.1  # bf16: the verify forward and the flat one round differently
    for i, (p, c) in enumerate(zip(prompts, out.completions)):
        assert_close_report(out.logprobs[i], flat[i, len(p) - 1 : len(p) - 1 + len(c)].cpu(), tol, tol, f"seq {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_decode_steps_replay_from_graphs(dtype, monkeypatch):
    """On CUDA plain decode steps are captured as CUDA graphs and replayed: the same tokens and bitwise the
    same logprobs as the eager steps, through buffers that grow and rows that finish; in float32 greedy
    draws are dta_ref's. A model with forward hooks is never captured."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import dta_fast.decode as decode

    monkeypatch.setattr(fast_rollout, "FIRST_NEW_TOKENS", 4)  # the buffers grow during the run
    engines = []
    init = DecodeSteps.__init__

    def spy(self, *args):
        init(self, *args)
        engines.append(self)

    monkeypatch.setattr(DecodeSteps, "__init__", spy)
    model = tiny_hf_model("llama", torch.float32).cuda()
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]] * 3
    if dtype == torch.float32:
        want = dta_ref.sample(model, prompts, 24, temperature=0).completions
        assert dta_fast.sample(model, prompts, 24, temperature=0).completions == want
        assert engines[-1].replays > 0
    model = model.to(dtype)
    runs = []
    for graphs in (True, False):
        monkeypatch.setattr(decode, "CUDA_GRAPHS", graphs)
        g = torch.Generator(device="cuda").manual_seed(0)
        runs.append(dta_fast.sample(model, prompts, 48, temperature=0.9, eos_token_id=7, generator=g))
        assert (engines[-1].replays > 0) == graphs
    replayed, eager = runs
    assert replayed.completions == eager.completions
    assert len({len(c) for c in eager.completions}) > 1  # rows finished at different steps
    for x, y in zip(replayed.logprobs, eager.logprobs, strict=True):
        assert torch.equal(x, y)
    # a forward hook (as sharded or offloaded weights bring) runs every step: nothing is replayed
    monkeypatch.setattr(decode, "CUDA_GRAPHS", True)
    calls = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda *args: calls.append(1))
    out = dta_fast.sample(model, prompts, 8, temperature=0)
    hook.remove()
    assert engines[-1].replays == 0 and len(calls) == out.stats["verify_steps"]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mistral", "qwen3-moe", "gpt-oss"])
def test_cuda_decode_graphs_of_the_families(family, monkeypatch):
    """A sliding window, a MoE model (replayed, or eager where its step cannot be captured) and sinks in
    the replayed steps: the same draws with graphs as without."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import dta_fast.decode as decode

    model = tiny_family_model(family, torch.float32).cuda()
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]] * 2
    runs = []
    for graphs in (True, False):
        monkeypatch.setattr(decode, "CUDA_GRAPHS", graphs)
        g = torch.Generator(device="cuda").manual_seed(1)
        runs.append(dta_fast.sample(model, prompts, 40, generator=g))
    assert runs[0].completions == runs[1].completions
    for x, y in zip(runs[0].logprobs, runs[1].logprobs, strict=True):
        assert torch.equal(x, y)
