"""RL and SFT losses on padded per-sequence logprobs [N, L].

Every loss here is a weighted sum of per-token terms, ``sum(term * weight)``,
where the weights come from the loss mask and the normalisation only. That is
what lets the same loss be split per sequence (depth-first execution) or per
rank (distributed) without changing its value or its gradient.

Masked-out tokens never matter: their logprobs, old logprobs and advantages
are selected away before any arithmetic (never multiplied by a zero weight),
so a NaN or inf there (a padded position, a group with no reward spread)
changes neither the loss nor its gradient. Non-finite inputs at masked-in
tokens are refused.
"""

from __future__ import annotations

import copy
import numbers

import torch

from .checks import check_real

NORMALIZATIONS = ("token_mean", "sequence_mean", "sum")


def _check_padded(name: str, x, shape=None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    return x


def _check_floating(name: str, x: torch.Tensor) -> None:
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def _is_integer(x: torch.Tensor) -> bool:
    """An integer dtype; bool is not one."""
    return not (x.dtype == torch.bool or x.dtype.is_floating_point or x.dtype.is_complex)


def _check_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """The loss mask as bool: a bool tensor, or numbers that are all 0 or 1."""
    if loss_mask.dtype == torch.bool:
        return loss_mask
    if loss_mask.dtype.is_complex or not bool(((loss_mask == 0) | (loss_mask == 1)).all()):
        raise ValueError(f"loss_mask must be bool (or hold only 0 and 1), got dtype {loss_mask.dtype}")
    return loss_mask != 0


def _check_clip(name: str, value) -> float:
    value = check_real(name, value)
    if value < 0:
        raise ValueError(f"clip ranges must be non-negative, got {name}={value}")
    return value


def _check_finite_where(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    if x.dtype.is_floating_point and not bool(torch.isfinite(x).logical_or(~mask).all()):
        bad = (~torch.isfinite(x) & mask).nonzero()[0].tolist()
        raise ValueError(f"{name} is not finite at masked-in position {tuple(bad)}: {x[tuple(bad)].item()}")


def _check_policy_inputs(old_logprobs, advantages, loss_mask, shape) -> torch.Tensor:
    """Checks the policy-gradient inputs; returns the loss mask as bool."""
    _check_padded("old_logprobs", old_logprobs, shape)
    _check_floating("old_logprobs", old_logprobs)
    _check_padded("loss_mask", loss_mask, shape)
    mask = _check_mask(loss_mask)
    _check_padded("advantages", advantages)
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"advantages must be [N] or [N, L] = {tuple(shape)}, got shape {tuple(advantages.shape)}")
    if advantages.dtype == torch.bool or advantages.dtype.is_complex:
        raise TypeError(f"advantages must be real numbers, got {advantages.dtype}")
    _check_finite_where("old_logprobs", old_logprobs, mask)
    _check_finite_where("advantages", advantages if advantages.dim() == 2 else advantages[:, None].expand(shape), mask)
    return mask


def token_weights(loss_mask: torch.Tensor, normalization: str = "token_mean") -> torch.Tensor:
    """Weights [N, L] such that a loss is ``sum(per_token_term * weights)``.

    - ``token_mean``: each valid token of the batch weighs 1 / (valid tokens in the batch)
      (DAPO's token-level loss).
    - ``sequence_mean``: mean over sequences of each sequence's token mean (GRPO);
      sequences without a valid token are left out of the mean.
    - ``sum``: every valid token weighs 1.
    """
    if not isinstance(loss_mask, torch.Tensor):
        raise ValueError(f"loss_mask must be a 2-D tensor [N, L], got {type(loss_mask).__name__}")
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be a 2-D tensor [N, L], got shape {tuple(loss_mask.shape)}")
    if not isinstance(normalization, str) or normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    mask = _check_mask(loss_mask).to(torch.float64)
    if normalization == "sum":
        return mask
    if normalization == "token_mean":
        return mask / mask.sum().clamp(min=1.0)
    per_seq = mask.sum(dim=1, keepdim=True)
    num_seqs = (per_seq > 0).sum().clamp(min=1)
    return mask / per_seq.clamp(min=1.0) / num_seqs


def clipped_policy_gradient_terms(logprobs, old_logprobs, advantages, clip_low=0.2, clip_high=None, dual_clip=None):
    """Per-token PPO-clip terms -min(r A, clip(r, 1-low, 1+high) A), in logprobs' shape.

    ``old_logprobs`` has logprobs' shape; ``advantages`` too, or [N] (one per
    sequence) for logprobs [N, L].

    ``clip_high`` defaults to ``clip_low`` (PPO/GRPO); a larger one is DAPO's
    clip-higher. ``dual_clip`` (c > 1) bounds the loss of negative-advantage
    tokens by -c A, as in dual-clip PPO.
    """
    clip_low = _check_clip("clip_low", clip_low)
    clip_high = clip_low if clip_high is None else _check_clip("clip_high", clip_high)
    if dual_clip is not None and check_real("dual_clip", dual_clip) <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    _check_padded("logprobs", logprobs)
    _check_padded("old_logprobs", old_logprobs, logprobs.shape)  # broadcast, they would pair other tokens
    _check_padded("advantages", advantages)
    if advantages.shape != logprobs.shape:
        if logprobs.dim() != 2 or advantages.shape != logprobs.shape[:1]:
            raise ValueError(
                f"advantages must have logprobs' shape {tuple(logprobs.shape)}, or be [N] one per "
                f"sequence of logprobs [N, L]; got shape {tuple(advantages.shape)}"
            )
        advantages = advantages[:, None]
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    terms = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
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
    sequence, as in GRPO) or [N, L] (per token, as in PPO with GAE). The mask
    must be False past each sequence's last logprob (``tree.logprob_mask``
    and ``&`` with it are safe): this function cannot see the lengths, but
    ``tree_backward`` and :meth:`TokenLoss.__call__` refuse such a mask.
    ``old_logprobs`` and ``advantages`` are constants of the loss, as in PPO
    and as :class:`PolicyGradientLoss` holds them: no gradient flows into
    them (an on-policy ``old_logprobs=logprobs`` gives the ratio's gradient,
    not zero).
    """
    _check_padded("logprobs", logprobs)
    _check_floating("logprobs", logprobs)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, L], got shape {tuple(logprobs.shape)}")
    mask = _check_policy_inputs(old_logprobs, advantages, loss_mask, logprobs.shape)
    old_logprobs, advantages = old_logprobs.detach(), advantages.detach()
    weights = token_weights(mask, normalization).to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand(logprobs.shape)
    logprobs, old_logprobs, advantages = (torch.where(mask, x, 0) for x in (logprobs, old_logprobs, advantages))
    terms = clipped_policy_gradient_terms(logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip)
    return (terms * weights).sum()


def value_loss(values, old_values, returns, loss_mask, clip: float | None = None, normalization: str = "token_mean"):
    """PPO's value loss over the masked tokens: ``0.5 (v - R)^2``, or with ``clip`` the clipped form
    ``0.5 max((v - R)^2, (v_old + clip(v - v_old, -clip, clip) - R)^2)`` (values, old_values, returns,
    loss_mask: [N, L]; old values and returns are constants of the loss)."""
    _check_padded("values", values)
    _check_floating("values", values)
    if values.dim() != 2:
        raise ValueError(f"values must be [N, L], got shape {tuple(values.shape)}")
    for name, x in (("old_values", old_values), ("returns", returns), ("loss_mask", loss_mask)):
        _check_padded(name, x, values.shape)
    mask = _check_mask(loss_mask)
    for name, x in (("old_values", old_values), ("returns", returns)):
        _check_finite_where(name, x, mask)
    old_values, returns = (torch.where(mask, x.detach(), 0) for x in (old_values, returns))
    values = torch.where(mask, values, 0)
    terms = (values - returns) ** 2
    if clip is not None:
        clip = _check_clip("clip", clip)
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        terms = torch.maximum(terms, (clipped - returns) ** 2)
    return 0.5 * (terms * token_weights(mask, normalization).to(values.dtype)).sum()


def sft_loss(logprobs, loss_mask, normalization: str = "token_mean"):
    """Negative log-likelihood of the masked tokens."""
    _check_padded("logprobs", logprobs)
    _check_floating("logprobs", logprobs)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, L], got shape {tuple(logprobs.shape)}")
    _check_padded("loss_mask", loss_mask, logprobs.shape)
    mask = _check_mask(loss_mask)
    weights = token_weights(mask, normalization).to(logprobs.dtype)
    return -(torch.where(mask, logprobs, 0) * weights).sum()


class TokenLoss:
    """A loss of the form sum over (sequence i, step t) of ``weight[i, t] * term(i, t, logprob[i, t])``.

    Call it as ``loss_fn(i, logprobs_i)`` (sequence i's 1-D next-token
    logprobs), the form ``dta_fast.tree_backward`` takes for any loss. Because
    every token's term depends on that token's logprob alone, the engines can
    also evaluate it a piece at a time with :meth:`terms`, which lets them
    backpropagate each chunk as soon as it is computed.
    """

    # what it is a loss of: next-token logprobs, one per token but the last ([N, Lmax-1]); a value loss
    # overrides both (one value per token, [N, Lmax])
    outputs, one_output = "logprobs", "next-token logprob"
    lost_per_sequence = 1  # a sequence of n tokens has n - lost_per_sequence outputs

    def __init__(self, weights: torch.Tensor):
        self.weights = weights  # [N, L], float64

    @property
    def shape(self):
        return tuple(self.weights.shape)

    def _term(self, seq, step, logprobs):
        raise NotImplementedError

    def to(self, device) -> TokenLoss:
        """A copy whose tensors (and those of TokenLosses it holds) live on ``device``.

        :meth:`terms` moves what it reads to the logprobs' device; an engine
        calling it once per chunk moves the loss once instead.
        """
        moved = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, (torch.Tensor, TokenLoss)):
                setattr(moved, name, value.to(device))
        return moved

    def rows(self, index, width: int | None = None) -> TokenLoss:
        """The same loss over sequences ``index`` only: its sequence j is sequence ``index[j]`` here.

        Normalisation is unchanged (it lives in the weights), so the terms of
        disjoint row sets add up to the whole batch's loss. ``width`` keeps the
        first ``width`` steps (default: all). Every tensor whose first
        dimension is the sequences is indexed, its step dimension cut, and held
        TokenLosses too: subclasses keep per-sequence inputs as [N, ...] and
        per-token inputs as [N, L, ...] tensors, or override this.
        """
        N, L = self.shape
        index = torch.as_tensor(index)
        if index.numel() and not _is_integer(index):
            # a bool mask would be read as indices 0 and 1, floats truncated: rows of other sequences
            raise TypeError(f"index must be integer sequence indices, got dtype {index.dtype}")
        index = index.long()
        if index.dim() != 1 or (index.numel() and not (0 <= int(index.min()) and int(index.max()) < N)):
            raise ValueError(f"index must be 1-D sequence indices in [0, {N}), got {index.tolist()}")
        if width is not None and (isinstance(width, bool) or not isinstance(width, numbers.Integral)):
            raise TypeError(f"width must be an int, got {type(width).__name__}")
        width = L if width is None else int(width)
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
        """Weighted terms of the (seq[p], step[p]) tokens whose logprobs are ``logprobs[p]``.

        A token of weight 0 gives exactly 0 and no gradient, whatever its logprob (NaN included).
        """
        weights = self.weights.to(logprobs.device)[seq, step].to(logprobs.dtype)
        active = weights != 0
        terms = self._term(seq, step, torch.where(active, logprobs, 0))
        return torch.where(active, terms * weights, 0)

    def check_lengths(self, lengths: torch.Tensor) -> None:
        """Raise ValueError unless the loss is built for sequences of these lengths.

        Its shape must be [N, max(lengths) - 1] and no token past a sequence's
        last next-token logprob may carry weight (a mask True there would count
        in the normalisation a token that has no logprob).
        """
        if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 or not _is_integer(lengths):
            raise TypeError(
                f"lengths must be a 1-D integer tensor, got {getattr(lengths, 'dtype', type(lengths))} "
                f"of shape {tuple(getattr(lengths, 'shape', ()))}"
            )
        lost, what = self.lost_per_sequence, self.outputs
        expected = (lengths.numel(), int(lengths.max()) - lost if lengths.numel() else 0)
        if self.shape != expected:
            raise ValueError(f"loss_fn was built for {what} of shape {self.shape}, the tree has {expected}")
        steps = torch.arange(self.shape[1], device=self.weights.device)
        past_end = steps[None, :] >= (lengths.to(self.weights.device)[:, None] - lost)
        if bool((self.weights != 0).logical_and(past_end).any()):
            i, t = (self.weights != 0).logical_and(past_end).nonzero()[0].tolist()
            raise ValueError(
                f"the loss mask is True at step {t} of sequence {i}, past its last {self.one_output} "
                f"(step {int(lengths[i]) - lost - 1}): mask only steps t < length{f' - {lost}' if lost else ''}"
            )

    def __call__(self, i: int, logprobs_i: torch.Tensor) -> torch.Tensor:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"the sequence index must be an int, got {type(i).__name__}")
        if not 0 <= i < self.shape[0]:
            raise ValueError(f"sequence index {i} is out of range for a loss over {self.shape[0]} sequences")
        what = self.outputs
        if not isinstance(logprobs_i, torch.Tensor) or logprobs_i.dim() != 1 or logprobs_i.shape[0] > self.shape[1]:
            raise ValueError(
                f"{what} of sequence {i} must be 1-D of length <= {self.weights.shape[1]}, "
                f"got shape {tuple(getattr(logprobs_i, 'shape', ()))}"
            )
        _check_floating(what, logprobs_i)
        n = logprobs_i.shape[0]
        if bool((self.weights[i, n:] != 0).any()):
            raise ValueError(f"the loss mask is True past the {n} {what} of sequence {i}")
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
        if old_logprobs.dim() != 2:
            raise ValueError(f"old_logprobs must be [N, L], got shape {tuple(old_logprobs.shape)}")
        mask = _check_policy_inputs(old_logprobs, advantages, loss_mask, old_logprobs.shape)
        super().__init__(token_weights(mask, normalization))
        advantages = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(old_logprobs)
        # masked-out tokens are selected away here, so a NaN there never meets a logprob
        self.old_logprobs = torch.where(mask, old_logprobs.detach(), 0)
        self.advantages = torch.where(mask, advantages.detach(), 0)
        self.clip = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
        clipped_policy_gradient_terms(old_logprobs[:1, :1], old_logprobs[:1, :1], self.advantages[:1, :1], **self.clip)

    def _term(self, seq, step, logprobs):
        # in the dtype torch promotes the three to, as policy_gradient_loss computes them (16-bit logprobs
        # beside float32 old logprobs: a float32 ratio, not one of old logprobs rounded to 16 bits)
        old = self.old_logprobs.to(logprobs.device)[seq, step]
        adv = self.advantages.to(logprobs.device)[seq, step]
        terms = clipped_policy_gradient_terms(logprobs[:, None], old[:, None], adv[:, None], **self.clip)
        return terms[:, 0]


class SFTLoss(TokenLoss):
    """:func:`sft_loss` as a per-sequence ``loss_fn(i, logprobs_i)``."""

    def __init__(self, loss_mask, normalization: str = "token_mean"):
        _check_padded("loss_mask", loss_mask)
        super().__init__(token_weights(loss_mask, normalization))

    def _term(self, seq, step, logprobs):
        return -logprobs


class ValueLoss(TokenLoss):
    """:func:`value_loss` as a per-sequence ``loss_fn(i, values_i)``: a critic's loss on its values, one
    per token ([N, Lmax], the layout of ``tree_values``).

    Summed over the batch it equals ``value_loss(values, ...)`` with the same arguments, normalisation
    included; ``dta_fast.tree_backward`` trains a critic with it, chunk by chunk.
    """

    outputs, one_output = "values", "value"
    lost_per_sequence = 0

    def __init__(self, old_values, returns, loss_mask, clip: float | None = None, normalization: str = "token_mean"):
        _check_padded("returns", returns)
        if returns.dim() != 2:
            raise ValueError(f"returns must be [N, L], got shape {tuple(returns.shape)}")
        _check_floating("returns", returns)
        for name, x in (("old_values", old_values), ("loss_mask", loss_mask)):
            _check_padded(name, x, returns.shape)
        mask = _check_mask(loss_mask)
        for name, x in (("old_values", old_values), ("returns", returns)):
            _check_finite_where(name, x, mask)
        super().__init__(token_weights(mask, normalization))
        self.old_values, self.returns = (torch.where(mask, x.detach(), 0) for x in (old_values, returns))
        self.clip = None if clip is None else _check_clip("clip", clip)

    def _term(self, seq, step, values):
        old = self.old_values.to(values.device)[seq, step].to(values.dtype)
        ret = self.returns.to(values.device)[seq, step].to(values.dtype)
        terms = (values - ret) ** 2
        if self.clip is not None:
            clipped = old + (values - old).clamp(-self.clip, self.clip)
            terms = torch.maximum(terms, (clipped - ret) ** 2)
        return 0.5 * terms
