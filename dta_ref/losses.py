"""RL and SFT losses on padded per-sequence logprobs [N, L].

Every loss here is a weighted sum of per-token terms, ``sum(term * weight)``,
where the weights come from the loss mask and the normalisation only. That is
what lets the same loss be split per sequence (depth-first execution) or per
rank (distributed) without changing its value or its gradient.
"""

from __future__ import annotations

import copy

import torch

NORMALIZATIONS = ("token_mean", "sequence_mean", "sum")


def _check_padded(name: str, x, shape=None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    return x


def _check_policy_inputs(old_logprobs, advantages, loss_mask, shape) -> None:
    _check_padded("old_logprobs", old_logprobs, shape)
    _check_padded("loss_mask", loss_mask, shape)
    _check_padded("advantages", advantages)
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"advantages must be [N] or [N, L] = {tuple(shape)}, got shape {tuple(advantages.shape)}")


def token_weights(loss_mask: torch.Tensor, normalization: str = "token_mean") -> torch.Tensor:
    """Weights [N, L] such that a loss is ``sum(per_token_term * weights)``.

    - ``token_mean``: each valid token of the batch weighs 1 / (valid tokens in the batch)
      (DAPO's token-level loss).
    - ``sequence_mean``: mean over sequences of each sequence's token mean (GRPO);
      sequences without a valid token are left out of the mean.
    - ``sum``: every valid token weighs 1.
    """
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be a 2-D tensor [N, L], got {getattr(loss_mask, 'shape', loss_mask)}")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    mask = loss_mask.to(torch.float64)
    if normalization == "sum":
        return mask
    if normalization == "token_mean":
        return mask / mask.sum().clamp(min=1.0)
    per_seq = mask.sum(dim=1, keepdim=True)
    num_seqs = (per_seq > 0).sum().clamp(min=1)
    return mask / per_seq.clamp(min=1.0) / num_seqs


def clipped_policy_gradient_terms(logprobs, old_logprobs, advantages, clip_low=0.2, clip_high=None, dual_clip=None):
    """Per-token PPO-clip terms -min(r A, clip(r, 1-low, 1+high) A) [N, L].

    ``clip_high`` defaults to ``clip_low`` (PPO/GRPO); a larger one is DAPO's
    clip-higher. ``dual_clip`` (c > 1) bounds the loss of negative-advantage
    tokens by -c A, as in dual-clip PPO.
    """
    clip_high = clip_low if clip_high is None else clip_high
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be non-negative, got low={clip_low}, high={clip_high}")
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    terms = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        terms = torch.where(advantages < 0, torch.minimum(terms, -dual_clip * advantages), terms)
    return terms


def policy_gradient_loss(
    logprobs,
    old_logprobs,
    advantages,
    loss_mask,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    normalization: str = "token_mean",
    dual_clip: float | None = None,
):
    """Token-level clipped policy-gradient loss (PPO / GRPO / DAPO).

    logprobs, old_logprobs, loss_mask: [N, L]; advantages: [N] (one per
    sequence, as in GRPO) or [N, L] (per token, as in PPO with GAE).
    """
    _check_padded("logprobs", logprobs)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, L], got shape {tuple(logprobs.shape)}")
    _check_policy_inputs(old_logprobs, advantages, loss_mask, logprobs.shape)
    terms = clipped_policy_gradient_terms(logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip)
    weights = token_weights(loss_mask, normalization).to(terms.dtype)
    return (terms * weights).sum()


def sft_loss(logprobs, loss_mask, normalization: str = "token_mean"):
    """Negative log-likelihood of the masked tokens."""
    _check_padded("logprobs", logprobs)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, L], got shape {tuple(logprobs.shape)}")
    _check_padded("loss_mask", loss_mask, logprobs.shape)
    weights = token_weights(loss_mask, normalization).to(logprobs.dtype)
    return -(logprobs * weights).sum()


class TokenLoss:
    """A loss of the form sum over (sequence i, step t) of ``weight[i, t] * term(i, t, logprob[i, t])``.

    Call it as ``loss_fn(i, logprobs_i)`` (sequence i's 1-D next-token
    logprobs), the form ``dta_fast.tree_backward`` takes for any loss. Because
    every token's term depends on that token's logprob alone, the engines can
    also evaluate it a piece at a time with :meth:`terms`, which lets them
    backpropagate each chunk as soon as it is computed.
    """

    def __init__(self, weights: torch.Tensor):
        self.weights = weights  # [N, L], float64

    @property
    def shape(self):
        return tuple(self.weights.shape)

    def _term(self, seq, step, logprobs):
        raise NotImplementedError

    def to(self, device) -> "TokenLoss":
        """A copy whose tensors (and those of TokenLosses it holds) live on ``device``.

        :meth:`terms` moves what it reads to the logprobs' device; an engine
        calling it once per chunk moves the loss once instead.
        """
        moved = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, (torch.Tensor, TokenLoss)):
                setattr(moved, name, value.to(device))
        return moved

    def rows(self, index, width: int | None = None) -> "TokenLoss":
        """The same loss over sequences ``index`` only: its sequence j is sequence ``index[j]`` here.

        Normalisation is unchanged (it lives in the weights), so the terms of
        disjoint row sets add up to the whole batch's loss. ``width`` keeps the
        first ``width`` steps (default: all). Every tensor whose first
        dimension is the sequences is indexed, its step dimension cut, and held
        TokenLosses too: subclasses keep per-sequence inputs as [N, ...] and
        per-token inputs as [N, L, ...] tensors, or override this.
        """
        N, L = self.shape
        index = torch.as_tensor(index, dtype=torch.long)
        width = L if width is None else width
        if not 0 <= width <= L:
            raise ValueError(f"width must be between 0 and {L}, got {width}")
        picked = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, TokenLoss):
                setattr(picked, name, value.rows(index, width))
            elif isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == N:
                value = value[index.to(value.device)]
                setattr(picked, name, value[:, :width] if value.dim() >= 2 and value.shape[1] == L else value)
        return picked

    def terms(self, seq: torch.Tensor, step: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """Weighted terms of the (seq[p], step[p]) tokens whose logprobs are ``logprobs[p]``."""
        weights = self.weights.to(logprobs.device)[seq, step].to(logprobs.dtype)
        return self._term(seq, step, logprobs) * weights

    def __call__(self, i: int, logprobs_i: torch.Tensor) -> torch.Tensor:
        if logprobs_i.dim() != 1 or logprobs_i.shape[0] > self.weights.shape[1]:
            raise ValueError(
                f"logprobs of sequence {i} must be 1-D of length <= {self.weights.shape[1]}, "
                f"got shape {tuple(logprobs_i.shape)}"
            )
        steps = torch.arange(logprobs_i.shape[0], device=logprobs_i.device)
        seq = torch.full_like(steps, i)
        return self.terms(seq, steps, logprobs_i).sum()


class PolicyGradientLoss(TokenLoss):
    """:func:`policy_gradient_loss` as a per-sequence ``loss_fn(i, logprobs_i)``.

    Summed over the batch it equals ``policy_gradient_loss(logprobs, ...)``
    with the same arguments, normalisation included.
    """

    def __init__(
        self,
        old_logprobs,
        advantages,
        loss_mask,
        clip_low: float = 0.2,
        clip_high: float | None = None,
        normalization: str = "token_mean",
        dual_clip: float | None = None,
    ):
        _check_padded("old_logprobs", old_logprobs)
        _check_policy_inputs(old_logprobs, advantages, loss_mask, old_logprobs.shape)
        super().__init__(token_weights(loss_mask, normalization))
        self.old_logprobs = old_logprobs.detach()
        self.advantages = advantages.detach() if advantages.dim() == 2 else advantages.detach()[:, None].expand_as(
            old_logprobs
        )
        self.clip = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
        clipped_policy_gradient_terms(old_logprobs[:1, :1], old_logprobs[:1, :1], self.advantages[:1, :1], **self.clip)

    def _term(self, seq, step, logprobs):
        old = self.old_logprobs.to(logprobs.device)[seq, step].to(logprobs.dtype)
        adv = self.advantages.to(logprobs.device)[seq, step].to(logprobs.dtype)
        terms = clipped_policy_gradient_terms(logprobs[:, None], old[:, None], adv[:, None], **self.clip)
        return terms[:, 0]


class SFTLoss(TokenLoss):
    """:func:`sft_loss` as a per-sequence ``loss_fn(i, logprobs_i)``."""

    def __init__(self, loss_mask, normalization: str = "token_mean"):
        super().__init__(token_weights(loss_mask, normalization))

    def _term(self, seq, step, logprobs):
        return -logprobs
