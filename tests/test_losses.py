"""RL and SFT losses against hand-computed values on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from dta_ref import TokenLoss, clipped_policy_gradient_terms, policy_gradient_loss, sft_loss, token_weights

NORMALIZATIONS = ("token_mean", "sequence_mean", "sum")


def lp(*ratios):
    """Logprobs whose ratio to old logprobs of 0 is ``ratios``."""
    return torch.tensor([math.log(r) for r in ratios], dtype=torch.float64)


# Two rollouts, old logprobs 0, so ratio = exp(logprob).
#   row 0: A = +1, ratios 1.5, 1.0, (padding)
#   row 1: A = -2, ratios 0.5, 1.1, 4.0
# clip 0.2, terms -min(rA, clip(r) A):
#   row 0: -min(1.5, 1.2) = -1.2;  -1.0
#   row 1: -min(-1.0, -1.6) = 1.6;  2.2;  -min(-8, -2.4) = 8
# dual clip c = 3 caps row 1's last term at -c A = 6.
LOGPROBS = torch.stack([torch.cat([lp(1.5, 1.0), torch.zeros(1, dtype=torch.float64)]), lp(0.5, 1.1, 4.0)])
MASK = torch.tensor([[True, True, False], [True, True, True]])
ADV = torch.tensor([1.0, -2.0], dtype=torch.float64)
TERMS = torch.tensor([[-1.2, -1.0, 0.0], [1.6, 2.2, 8.0]], dtype=torch.float64)

HAND_VALUES = [
    ("token_mean", None, (-1.2 - 1.0 + 1.6 + 2.2 + 8.0) / 5),
    ("sequence_mean", None, ((-1.2 - 1.0) / 2 + (1.6 + 2.2 + 8.0) / 3) / 2),
    ("sum", None, -1.2 - 1.0 + 1.6 + 2.2 + 8.0),
    ("token_mean", 3.0, (-1.2 - 1.0 + 1.6 + 2.2 + 6.0) / 5),
    ("sequence_mean", 3.0, ((-1.2 - 1.0) / 2 + (1.6 + 2.2 + 6.0) / 3) / 2),
    ("sum", 3.0, -1.2 - 1.0 + 1.6 + 2.2 + 6.0),
]


def test_terms_by_hand():
    terms = clipped_policy_gradient_terms(LOGPROBS, torch.zeros_like(LOGPROBS), ADV, clip_low=0.2)
    assert torch.allclose(terms[MASK], TERMS[MASK], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "normalization,dual_clip,expected", HAND_VALUES, ids=[f"{n}-dual{d}" for n, d, _ in HAND_VALUES]
)
def test_policy_gradient_loss_by_hand(normalization, dual_clip, expected):
    loss = policy_gradient_loss(
        LOGPROBS, torch.zeros_like(LOGPROBS), ADV, MASK, clip_low=0.2, normalization=normalization, dual_clip=dual_clip
    )
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_clip_higher_by_hand():
    # clip_high 0.6: row 0's ratio 1.5 is no longer clipped (-1.5); the low side is unchanged
    loss = policy_gradient_loss(
        LOGPROBS, torch.zeros_like(LOGPROBS), ADV, MASK, clip_low=0.2, clip_high=0.6, normalization="sum"
    )
    assert loss.item() == pytest.approx(-1.5 - 1.0 + 1.6 + 2.2 + 8.0, rel=1e-12)


def test_old_logprobs_enter_only_through_the_ratio():
    shift = torch.tensor([[0.3, -0.7, 1.1], [2.0, -0.4, 0.05]], dtype=torch.float64)
    a = policy_gradient_loss(LOGPROBS, torch.zeros_like(LOGPROBS), ADV, MASK)
    b = policy_gradient_loss(LOGPROBS + shift, shift, ADV, MASK)
    assert b.item() == pytest.approx(a.item(), rel=1e-12)


CLIP_CASES = [
    # (advantage, ratio, clipped?)  clip range [0.8, 1.2]
    (1.0, 1.5, True),
    (1.0, 0.5, False),
    (1.0, 1.1, False),
    (-1.0, 0.5, True),
    (-1.0, 1.5, False),
    (-1.0, 0.9, False),
]


@pytest.mark.parametrize("adv,ratio,clipped", CLIP_CASES, ids=[f"A{a:+g}-r{r:g}" for a, r, _ in CLIP_CASES])
def test_clipped_side_has_zero_gradient(adv, ratio, clipped):
    logprobs = lp(ratio)[None].requires_grad_(True)
    loss = policy_gradient_loss(
        logprobs,
        torch.zeros(1, 1, dtype=torch.float64),
        torch.tensor([adv], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool),
        clip_low=0.2,
        normalization="sum",
    )
    (grad,) = torch.autograd.grad(loss, logprobs)
    # unclipped term -r A has d/dlogprob = -r A
    expected = 0.0 if clipped else -ratio * adv
    assert grad.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("ratio,capped", [(4.0, True), (2.0, False), (0.9, False)], ids=["r4", "r2", "r0.9"])
def test_dual_clip_caps_negative_advantage_loss(ratio, capped):
    logprobs = lp(ratio)[None].requires_grad_(True)
    args = (torch.zeros(1, 1, dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1))
    loss = policy_gradient_loss(logprobs, *args, normalization="sum", dual_clip=3.0)
    plain = policy_gradient_loss(logprobs, *args, normalization="sum")
    assert loss.item() == pytest.approx(3.0 if capped else plain.item(), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert (grad.item() == 0.0) == capped


def test_dual_clip_leaves_positive_advantages_alone():
    logprobs = lp(0.1, 5.0)[None]
    args = (torch.zeros(1, 2, dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 2))
    with_dual = policy_gradient_loss(logprobs, *args, normalization="sum", dual_clip=1.5)
    assert with_dual.item() == pytest.approx(policy_gradient_loss(logprobs, *args, normalization="sum").item())


def test_token_weights_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    w = token_weights(mask, "token_mean")
    assert w.dtype == torch.float64
    assert torch.equal(w, mask.double() / 3)
    # sequence_mean: the empty row is left out of the mean over sequences
    expected = torch.tensor([[0.25, 0.25, 0], [0.5, 0, 0], [0, 0, 0]], dtype=torch.float64)
    assert torch.equal(token_weights(mask, "sequence_mean"), expected)
    assert torch.equal(token_weights(mask, "sum"), mask.double())


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_empty_mask_gives_zero_loss(normalization):
    mask = torch.zeros(2, 3, dtype=torch.bool)
    logprobs = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(token_weights(mask, normalization), torch.zeros(2, 3, dtype=torch.float64))
    loss = policy_gradient_loss(
        logprobs, logprobs, torch.ones(2, dtype=torch.float64), mask, normalization=normalization
    )
    assert loss.item() == 0.0
    assert sft_loss(logprobs, mask, normalization).item() == 0.0


@pytest.mark.parametrize(
    "normalization,expected", [("token_mean", 2.0), ("sequence_mean", 2.25), ("sum", 6.0)], ids=NORMALIZATIONS
)
def test_sft_loss_by_hand(normalization, expected):
    logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -9.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert sft_loss(logprobs, mask, normalization).item() == pytest.approx(expected, rel=1e-12)


def test_normalizations_differ_by_their_known_factors():
    gen = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(4, 6, dtype=torch.float64, generator=gen)
    old = logprobs + 0.3 * torch.randn(4, 6, dtype=torch.float64, generator=gen)
    adv = torch.randn(4, dtype=torch.float64, generator=gen)
    mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 3 + [0] * 3, [1] * 6], dtype=torch.bool)
    s = policy_gradient_loss(logprobs, old, adv, mask, normalization="sum")
    tm = policy_gradient_loss(logprobs, old, adv, mask, normalization="token_mean")
    assert tm.item() == pytest.approx(s.item() / int(mask.sum()), rel=1e-12)
    terms = clipped_policy_gradient_terms(logprobs, old, adv)
    per_seq = [(terms[i] * mask[i]).sum() / mask[i].sum() for i in range(4)]
    sm = policy_gradient_loss(logprobs, old, adv, mask, normalization="sequence_mean")
    assert sm.item() == pytest.approx(float(sum(per_seq)) / 4, rel=1e-12)


def test_per_sequence_advantages_equal_expanded_per_token_advantages():
    gen = torch.Generator().manual_seed(2)
    logprobs = -torch.rand(3, 5, dtype=torch.float64, generator=gen)
    old = logprobs + 0.4 * torch.randn(3, 5, dtype=torch.float64, generator=gen)
    adv = torch.randn(3, dtype=torch.float64, generator=gen)
    mask = torch.rand(3, 5, generator=gen) < 0.7
    a = policy_gradient_loss(logprobs, old, adv, mask, clip_high=0.28, dual_clip=2.0)
    b = policy_gradient_loss(logprobs, old, adv[:, None].expand(3, 5), mask, clip_high=0.28, dual_clip=2.0)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_twins_agree_on_16_bit_logprobs(dtype):
    """16-bit logprobs beside float32 old logprobs and advantages: the class computes in the promoted
    dtype as the function does, not with old logprobs rounded to 16 bits."""
    from dta_ref import PolicyGradientLoss

    g = torch.Generator().manual_seed(8)
    logprobs = -5 - torch.rand(3, 4, generator=g)
    old = logprobs + 0.05 * torch.randn(3, 4, generator=g)
    adv, mask = torch.randn(3, generator=g), torch.ones(3, 4, dtype=torch.bool)
    low = logprobs.to(dtype).requires_grad_()
    want = policy_gradient_loss(low, old, adv, mask)
    twin = PolicyGradientLoss(old, adv, mask)
    got = sum(twin(i, low[i]) for i in range(3))
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(got, low)[0], torch.autograd.grad(want, low)[0], rtol=0, atol=0)


def test_loss_keeps_the_logprob_dtype():
    logprobs = -torch.rand(2, 3, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert policy_gradient_loss(logprobs, logprobs.detach(), torch.ones(2), mask).dtype == torch.float32
    assert sft_loss(logprobs, mask).dtype == torch.float32


@pytest.mark.parametrize("loss_name", ["pg", "sft"])
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_loss_decomposes_per_sequence(normalization, loss_name):
    """sum_i sum(term[i] * weights[i]) == loss, in value and in gradient (weights from the whole batch)."""
    gen = torch.Generator().manual_seed(4)
    N, L = 5, 7
    logprobs = (-torch.rand(N, L, dtype=torch.float64, generator=gen)).requires_grad_(True)
    old = logprobs.detach() + 0.5 * torch.randn(N, L, dtype=torch.float64, generator=gen)
    adv = torch.randn(N, dtype=torch.float64, generator=gen)
    lengths = torch.tensor([7, 1, 4, 0, 3])
    mask = torch.arange(L)[None, :] < lengths[:, None]
    if loss_name == "pg":
        whole = policy_gradient_loss(logprobs, old, adv, mask, normalization=normalization, dual_clip=3.0)
        terms = clipped_policy_gradient_terms(logprobs, old, adv, dual_clip=3.0)
    else:
        whole = sft_loss(logprobs, mask, normalization)
        terms = -logprobs
    weights = token_weights(mask, normalization)
    parts = []
    for i in range(N):
        row_only = torch.zeros_like(weights)
        row_only[i] = weights[i]
        parts.append((terms * row_only).sum())
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-15)
    (g_whole,) = torch.autograd.grad(whole, logprobs, retain_graph=True)
    g_parts = sum(torch.autograd.grad(p, logprobs, retain_graph=True)[0] for p in parts)
    assert torch.allclose(g_parts, g_whole, rtol=1e-12, atol=1e-15)
    assert bool((g_whole[~mask] == 0).all()), "masked tokens must get no gradient"
    assert bool((g_whole[mask] != 0).any())


class _Nested(TokenLoss):
    """A TokenLoss holding another, as a wrapper of a user's loss would."""

    def __init__(self, inner):
        super().__init__(inner.weights * 2)
        self.inner = inner

    def _term(self, seq, step, logprobs):
        return self.inner._term(seq, step, logprobs)


def _pg_loss():
    from dta_ref import PolicyGradientLoss

    old = torch.log(torch.tensor([[0.5, 0.9, 1.0], [0.8, 0.7, 0.6]], dtype=torch.float64))
    return PolicyGradientLoss(old, ADV, MASK, dual_clip=3.0)


def test_token_loss_moves_every_tensor_once():
    """TokenLoss.to copies the loss with every tensor, nested losses included, on the device; terms agree."""
    pg = _pg_loss()
    for loss in (pg, _Nested(pg)):
        meta = loss.to("meta")
        assert type(meta) is type(loss) and meta is not loss
        tensors = [v for v in vars(meta).values() if isinstance(v, torch.Tensor)]
        tensors += [
            v
            for inner in vars(meta).values()
            if hasattr(inner, "weights")
            for v in vars(inner).values()
            if isinstance(v, torch.Tensor)
        ]
        assert tensors and all(t.device.type == "meta" for t in tensors)
        assert all(v.device.type == "cpu" for v in vars(loss).values() if isinstance(v, torch.Tensor))
        seq, step = torch.tensor([0, 0]), torch.tensor([0, 2])
        lp_ = LOGPROBS[1, [0, 2]]
        assert torch.equal(loss.to("cpu").terms(seq, step, lp_), loss.terms(seq, step, lp_))


@pytest.mark.parametrize("nested", [False, True])
def test_token_loss_rows_is_the_loss_of_those_sequences(nested):
    """rows(index, width): sequence j is sequence index[j], normalisation kept; disjoint rows add up."""
    pg = _Nested(_pg_loss()) if nested else _pg_loss()
    seq, step = torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2])
    for i in range(2):
        one = pg.rows([i], 3)
        assert one.shape == (1, 3)
        assert torch.equal(one.terms(seq, step, LOGPROBS[i]), pg.terms(seq + i, step, LOGPROBS[i]))
    assert pg.rows([1], 2).shape == (1, 2)
    assert torch.equal(
        pg.rows([1, 0]).terms(torch.tensor([1]), torch.tensor([2]), LOGPROBS[0, 2:]),
        pg.terms(torch.tensor([0]), torch.tensor([2]), LOGPROBS[0, 2:]),
    )
    whole = sum(pg(i, LOGPROBS[i]) for i in range(2))
    assert torch.allclose(pg.rows([0])(0, LOGPROBS[0]) + pg.rows([1])(0, LOGPROBS[1]), whole, rtol=1e-14)
    with pytest.raises(ValueError, match="width"):
        pg.rows([0], 4)
    # a bool mask or floats would be read as other rows (indices 0 and 1, truncated), not refused
    for index in (torch.tensor([False, True]), [True], [1.0], torch.tensor([0.9])):
        with pytest.raises(TypeError, match="integer sequence indices"):
            pg.rows(index)
    for width in (True, 2.0):
        with pytest.raises(TypeError, match="width must be an int"):
            pg.rows([0], width)
    assert pg.rows([]).shape == (0, 3) and pg.rows(torch.tensor([1], dtype=torch.int32), 2).shape == (1, 2)
    for lengths, match in (
        ([4, 3], "1-D integer tensor"),
        (torch.tensor([[4], [3]]), "1-D integer tensor"),
        (torch.tensor([4.0, 3.5]), "1-D integer tensor"),
    ):
        with pytest.raises(TypeError, match=match):
            pg.check_lengths(lengths)
    pg.check_lengths(torch.tensor([4, 4]))
    pg.check_lengths(torch.tensor([3, 4]))  # MASK ends at row 0's last logprob, step 1
    with pytest.raises(ValueError, match=r"True at step 1 of sequence 0, past its last next-token logprob \(step 0\)"):
        pg.check_lengths(torch.tensor([2, 4]))  # one step past: the token mask used as the next-token mask


def test_old_logprobs_and_advantages_are_constants():
    """As PolicyGradientLoss holds them: on-policy (old = logprobs, not detached) the gradient is the
    ratio's, not 0, and none reaches advantages built from something trainable."""
    from dta_ref import PolicyGradientLoss

    logprobs = LOGPROBS.clone().requires_grad_()
    values = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    advantages = ADV + values  # e.g. returns minus a critic's values, not detached
    loss = policy_gradient_loss(logprobs, logprobs, advantages, MASK, normalization="sum")
    loss.backward()
    assert values.grad is None or not values.grad.any()
    # ratio 1, unclipped: d/dlogprob of -r A is -A at every masked-in token
    torch.testing.assert_close(logprobs.grad, torch.where(MASK, -ADV[:, None], 0.0).to(torch.float64))
    twin = PolicyGradientLoss(logprobs, advantages, MASK, normalization="sum")
    grads = torch.autograd.grad(sum(twin(i, logprobs[i, :3]) for i in range(2)), logprobs)[0]
    torch.testing.assert_close(grads, logprobs.grad, rtol=0, atol=0)


def test_terms_check_their_shapes():
    """One sequence's [L] logprobs with per-token [L] advantages stay [L] (not an [L, L] table); logprobs
    of another shape than the old ones are refused, not broadcast."""
    old = torch.zeros(3, dtype=torch.float64)
    terms = clipped_policy_gradient_terms(LOGPROBS[1], old, torch.full((3,), -2.0, dtype=torch.float64))
    assert terms.shape == (3,)
    torch.testing.assert_close(terms, TERMS[1], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        clipped_policy_gradient_terms(LOGPROBS, old, ADV)
    with pytest.raises(ValueError, match="advantages must have logprobs' shape"):
        clipped_policy_gradient_terms(LOGPROBS[1], old, ADV)
    with pytest.raises(TypeError, match="advantages must be a tensor"):
        clipped_policy_gradient_terms(LOGPROBS, LOGPROBS, 1.0)
