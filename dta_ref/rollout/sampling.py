"""Plain sampling: the sampling distribution, the draws, the argument checks and the Rollout record.

Every sampler (plain and speculative, here and in dta_fast) draws its
randomness the same way: one uniform per node whose distribution is
computed, in sequence order, inverse-CDF sampling (:func:`draw`), so the
twins of dta_ref and dta_fast return the same tokens for one generator.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..adapter import adapt
from ..attention import masked_attend
from ..checks import MIN_TEMPERATURE, as_float, check_int
from ..linear_attention import CAUSAL
from ..logprobs import logprob_dtype
from ..tree import _as_token_list

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
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not math.isfinite(as_float(temperature)) or not (temperature == 0 or temperature >= MIN_TEMPERATURE):
        raise ValueError(
            f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} (below, the scaled logits "
            f"overflow), got {temperature}"
        )
    top_k = check_int("top_k", top_k, 1, allow_none=True)
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
        ids = [check_int("eos_token_id", e, 0) for e in eos_token_id]
    elif isinstance(eos_token_id, numbers.Integral):
        ids = [check_int("eos_token_id", eos_token_id, 0)]  # a bool is refused there
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


@contextmanager
def progress_bar(progress, total: int) -> Iterator[tqdm]:
    """A tqdm bar over generated tokens on stderr: shown for True, hidden for False, for None only on a terminal.

    ``total`` is the most tokens the run can generate; a run that ends early
    (at an EOS) sets its bar's total to what it generated, so it reads done.
    """
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool or None, got {type(progress).__name__}")
    bar = tqdm(total=total, desc="sampling", unit="tok", disable=None if progress is None else not progress)
    try:
        yield bar
        bar.total = bar.n
        bar.refresh()
    finally:
        bar.close()


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


def context_logits(model, contexts: list[list[int]]) -> torch.Tensor:
    """Next-token logits [N, V] after each context, every context run alone (causal)."""
    adapter = adapt(model)
    device = adapter.device
    rows = []
    for ctx in contexts:
        ids = torch.tensor(ctx, device=device)[None]
        pos = torch.arange(len(ctx), device=device)[None]
        end = torch.full((len(ctx),), len(ctx), device=device)
        attend = masked_attend(end, pos[0], pos[0])
        rows.append(adapter.head(adapter.hidden_states(ids, pos, attend, linear=CAUSAL)[0, -1]))
    return torch.stack(rows)


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
    """Plain autoregressive sampling, one token per sequence per step (readable, recomputes the prefix).

    ``prompts``: list of token lists. ``temperature=0`` is greedy. Each step
    draws one uniform per unfinished sequence, in order, from ``generator``.
    ``progress``: a bar over generated tokens on stderr (None: only on a terminal).
    """
    prompts, params = check_sampling_args(
        model, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator
    )
    device = adapt(model).device
    out = [[] for _ in prompts]
    lps = [[] for _ in prompts]
    active = [i for i in range(len(prompts)) if max_new_tokens > 0]
    steps = 0
    with progress_bar(progress, len(prompts) * max_new_tokens) as bar:
        while active:
            steps += 1
            probs = sampling_probs(context_logits(model, [prompts[i] + out[i] for i in active]), params)
            tokens, logp = draw(probs, step_uniforms(len(active), params, generator, device))
            for i, t, lp in zip(active, tokens.tolist(), logp.tolist()):
                refuse_nonfinite_draws([lp], i)
                out[i].append(t)
                lps[i].append(lp)
            bar.update(len(active))
            active = [i for i in active if len(out[i]) < max_new_tokens and out[i][-1] not in params.eos_token_ids]
    dtype = logprob_dtype(adapt(model).dtype)
    stats = {"generated_tokens": sum(map(len, out)), "verify_steps": steps}
    return Rollout(out, [torch.tensor(x, dtype=dtype) for x in lps], stats)
