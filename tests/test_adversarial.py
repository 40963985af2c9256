"""Malformed and extreme inputs against the public API.

Each case ends in a clear ValueError/TypeError naming the argument, or in a
result equal to the per-sequence truth (the clean run's, for the rollouts a
poisoned one does not share tokens with). Kernel cases run the Triton kernel
(the interpreter on CPU, compiled in the GPU tier) at small sizes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import dta_ref
from dta_ref import PolicyGradientLoss, PrefixTree, SFTLoss, mask_from_subtree_end
from tests.helpers import tiny_decoder

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")

# Rollout 0 owns its last 6 tokens; rollouts 1 and 2 share the prompt with it; rollout 3 is a tree of its own.
SEQUENCES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 30, 31, 32],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 30, 33],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
]
TREE = PrefixTree.from_sequences(SEQUENCES)
POISONED = 0  # the rollout whose own tokens get NaN
OWN = [int(TREE.seq_index[POISONED, t]) for t in range(16, len(SEQUENCES[POISONED]))]  # its tokens alone


def _kernel():
    pytest.importorskip("triton")
    from dta_fast import tree_attention

    return tree_attention


def _attend(impl, q, k, v, end):
    if impl == "reference":
        mask = mask_from_subtree_end(end, torch.arange(end.shape[0], device=end.device))
        return dta_ref.attention(q, k, v, mask)
    return _kernel()(q, k, v, end)


def _run_attention(impl, q, k, v, do, end):
    inputs = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = _attend(impl, *inputs, end)
    out.backward(do)
    return [out.detach(), *(x.grad for x in inputs)]


# ------------------------------------------------------------ isolation, attention alone


@pytest.mark.parametrize(
    "impl,dtype",
    [("reference", torch.float64), ("reference", torch.float32)]
    + [pytest.param("kernel", dt, marks=pytest.mark.kernel) for dt in (torch.float32, torch.float16)]
    + [pytest.param("kernel", torch.bfloat16, marks=[pytest.mark.kernel, pytest.mark.gpu])],
    ids=lambda x: str(x).replace("torch.", ""),
)
@pytest.mark.parametrize("poison", ["q", "k", "v", "do", "all", "inf_v"])
def test_attention_isolation(impl, dtype, poison):
    """NaN/inf in the rows of one rollout's own tokens: every output and gradient row outside what those
    tokens see or are seen by equals the clean run's; inside it, non-finite exactly where the truth is."""
    if impl == "kernel" and dtype == torch.float64:
        pytest.skip("the kernel runs half and single precision")
    end = TREE.subtree_end.to(DEVICE)
    T = end.shape[0]
    g = torch.Generator(device=DEVICE).manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, T, 16, generator=g, device=DEVICE, dtype=dtype) for _ in range(4))
    k, v = k[:, :1], v[:, :1]  # GQA: two query heads over one K/V head
    clean = _run_attention(impl, q, k, v, do, end)
    own = torch.tensor(OWN, device=DEVICE)
    bad = {name: x.clone() for name, x in dict(q=q, k=k, v=v, do=do).items()}
    for name in ("q", "k", "v", "do") if poison == "all" else ("v",) if poison == "inf_v" else (poison,):
        bad[name][:, :, own] = INF if poison == "inf_v" else NAN
    poisoned = _run_attention(impl, bad["q"], bad["k"], bad["v"], bad["do"], end)
    # the truth: a query row is touched iff it sees a poisoned key (or is poisoned); a key row iff a
    # poisoned query sees it (or it is poisoned). Poisoned rows are rollout 0's own, so "sees" is the mask.
    visible = mask_from_subtree_end(end, torch.arange(T, device=DEVICE))  # [Tq, Tk]
    is_own = torch.zeros(T, dtype=torch.bool, device=DEVICE)
    is_own[own] = True
    query_touched = (visible & is_own[None, :]).any(1) | is_own
    key_touched = (visible & is_own[:, None]).any(0) | is_own
    for name, a, b, touched in zip(
        ("out", "dq", "dk", "dv"), clean, poisoned, (query_touched, query_touched, key_touched, key_touched)
    ):
        rows = b[0, :, ~touched]
        assert torch.isfinite(rows).all(), f"{name}: a NaN reached a row it cannot see"
        assert torch.equal(rows, a[0, :, ~touched]), f"{name}: untouched rows differ from the clean run"
    assert not torch.isfinite(poisoned[0][0, :, own]).any(-1).all() or poison == "do"  # the poisoned rows stay so


def test_reference_backward_is_the_textbook_one():
    """The written-out backward of dta_ref.attention: gradcheck, and plain masked softmax's autograd."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(6, 9, generator=g) < 0.5
    mask[:, 3] = True  # every query sees a key
    torch.autograd.gradcheck(lambda a, b, c: dta_ref.attention(a, b, c, mask, 0.7), (q, k, v))

    def plain(a, b, c):
        b, c = b.repeat_interleave(2, 1), c.repeat_interleave(2, 1)
        return torch.softmax((a @ b.transpose(-1, -2) * 0.7).masked_fill(~mask, -INF), -1) @ c

    do = torch.randn(1, 4, 6, 5, generator=g, dtype=torch.float64)
    ours = torch.autograd.grad(dta_ref.attention(q, k, v, mask, 0.7), (q, k, v), do)
    theirs = torch.autograd.grad(plain(q, k, v), (q, k, v), do)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------- isolation, a whole model


def _poisoned_model(dtype):
    model = tiny_decoder(dtype).to(DEVICE)
    token = SEQUENCES[POISONED][-2]  # a token only rollout 0 uses, read by its last logprob
    assert all(token not in s for i, s in enumerate(SEQUENCES) if i != POISONED)
    clean = tiny_decoder(dtype).to(DEVICE)
    with torch.no_grad():
        model.embed.weight[token] = NAN
    return clean, model


def _tree_backward(model, impl):
    import dta_fast

    loss = SFTLoss(TREE.logprob_mask & (torch.arange(TREE.num_sequences) != POISONED)[:, None])
    return dta_fast.tree_backward(model, TREE, loss, max_chunk_tokens=7, attention_impl=impl)[0]


@pytest.mark.parametrize(
    "entry",
    [
        "reference_tree_logprobs",
        pytest.param("fast_tree_logprobs", marks=pytest.mark.kernel),
        "tree_backward_reference",
        pytest.param("tree_backward_kernel", marks=[pytest.mark.kernel, pytest.mark.slow]),
    ],
)
def test_model_isolation(entry):
    """A NaN embedding row of a token only rollout 0 uses leaves every other rollout's logprobs as they were."""
    dtype = torch.float64 if "reference" in entry else torch.float32
    clean, model = _poisoned_model(dtype)
    if entry == "reference_tree_logprobs":
        run = lambda m: dta_ref.tree_logprobs(m, TREE)  # noqa: E731
    elif entry == "fast_tree_logprobs":
        import dta_fast

        run = lambda m: dta_fast.tree_logprobs(m, TREE, attention_impl="kernel")  # noqa: E731
    else:
        run = lambda m: _tree_backward(m, entry.rsplit("_", 1)[1])  # noqa: E731
    expected, got = run(clean).detach().cpu(), run(model).detach().cpu()
    others = torch.arange(TREE.num_sequences) != POISONED
    assert torch.equal(got[others], expected[others])
    assert torch.isnan(got[POISONED, len(SEQUENCES[POISONED]) - 2])  # the poisoned token's own row


# ------------------------------------------------------------ masked-out loss inputs


def _loss_inputs():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    old = lp + 0.1 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [0] * 6, [1] * 5 + [0]], dtype=torch.bool)
    return lp, old, adv, mask


def _spoil_masked_out(name, lp, old, adv, mask):
    lp, old, adv = lp.clone(), old.clone(), adv.clone()
    if name == "nan_advantage_of_empty_row":
        adv[2] = NAN  # a GRPO group with zero reward spread
    elif name == "minus_inf_old_at_padding":
        old[~mask] = -INF
    elif name == "nan_logprobs_at_padding":
        lp[~mask] = NAN
    elif name == "inf_per_token_advantage_masked_out":
        adv = adv[:, None].expand(4, 6).clone()
        adv[~mask] = INF
    return lp, old, adv


MASKED_OUT = [
    "nan_advantage_of_empty_row",
    "minus_inf_old_at_padding",
    "nan_logprobs_at_padding",
    "inf_per_token_advantage_masked_out",
]


@pytest.mark.parametrize("normalization", ["token_mean", "sequence_mean"])
@pytest.mark.parametrize("spoil", MASKED_OUT)
def test_masked_out_policy_inputs_never_matter(spoil, normalization):
    lp, old, adv, mask = _loss_inputs()
    ref_lp = lp.clone().requires_grad_(True)
    expected = dta_ref.policy_gradient_loss(ref_lp, old, adv, mask, 0.2, 0.28, normalization)
    (expected_grad,) = torch.autograd.grad(expected, ref_lp)
    bad_lp, bad_old, bad_adv = _spoil_masked_out(spoil, lp, old, adv, mask)
    bad_lp.requires_grad_(True)
    loss = dta_ref.policy_gradient_loss(bad_lp, bad_old, bad_adv, mask, 0.2, 0.28, normalization)
    (grad,) = torch.autograd.grad(loss, bad_lp)
    assert torch.equal(loss, expected) and torch.equal(grad, expected_grad)
    # the per-sequence form (what tree_backward evaluates) agrees
    fn = PolicyGradientLoss(bad_old, bad_adv, mask, 0.2, 0.28, normalization)
    total = sum(fn(i, bad_lp[i]) for i in range(4))
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-15)


def test_masked_out_sft_logprobs_never_matter():
    lp, _, _, mask = _loss_inputs()
    bad = lp.clone()
    bad[~mask] = NAN
    bad.requires_grad_(True)
    loss = dta_ref.sft_loss(bad, mask)
    (grad,) = torch.autograd.grad(loss, bad)
    assert torch.equal(loss, dta_ref.sft_loss(lp, mask)) and torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))


def test_token_loss_terms_select_zero_weights():
    _, old, adv, mask = _loss_inputs()
    fn = PolicyGradientLoss(old, adv, mask)
    seq, step = torch.tensor([2, 0]), torch.tensor([0, 0])
    lp = torch.tensor([NAN, -0.5], dtype=torch.float64, requires_grad=True)
    terms = fn.terms(seq, step, lp)
    (grad,) = torch.autograd.grad(terms.sum(), lp)
    assert terms[0] == 0 and grad[0] == 0 and torch.isfinite(terms).all()


def test_tree_backward_with_a_zero_spread_group():
    """tree_backward with a NaN advantage on a fully masked-out rollout: loss and gradients as without it."""
    import dta_fast

    model = tiny_decoder(torch.float64)
    N, L = TREE.num_sequences, TREE.max_length - 1
    old = torch.zeros(N, L, dtype=torch.float64)
    mask = TREE.logprob_mask.clone()
    mask[1] = False
    adv = torch.tensor([1.0, NAN, -0.5, 2.0], dtype=torch.float64)
    _, loss = dta_fast.tree_backward(model, TREE, PolicyGradientLoss(old, adv, mask), max_chunk_tokens=9)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    _, clean_loss = dta_fast.tree_backward(
        model, TREE, PolicyGradientLoss(old, torch.nan_to_num(adv), mask), max_chunk_tokens=9
    )
    assert torch.equal(loss, clean_loss)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)


# ---------------------------------------------------------------- loss arguments


def _policy(**overrides):
    lp, old, adv, mask = _loss_inputs()
    args = dict(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask)
    args.update(overrides)
    return lambda: dta_ref.policy_gradient_loss(**args)


def _policy_fn(**overrides):
    _, old, adv, mask = _loss_inputs()
    args = dict(old_logprobs=old, advantages=adv, loss_mask=mask)
    args.update(overrides)
    return lambda: PolicyGradientLoss(**args)


def _masked_in(x, value):
    x = x.clone()
    x[0, 0] = value
    return x


LP, OLD, ADV, MASK = _loss_inputs()
LOSS_ARGUMENTS = {
    "nan_clip_low": (_policy(clip_low=NAN), ValueError, "clip_low must be finite"),
    "inf_clip_high": (_policy(clip_high=INF), ValueError, "clip_high must be finite"),
    "string_clip": (_policy(clip_low="0.2"), TypeError, "clip_low must be a real number"),
    "bool_clip": (_policy(clip_high=True), TypeError, "clip_high must be a real number"),
    "tensor_clip": (_policy(clip_low=torch.tensor([0.2, 0.3])), TypeError, "clip_low must be a real number"),
    "nan_dual_clip": (_policy(dual_clip=NAN), ValueError, "dual_clip must be finite"),
    "dual_clip_one": (_policy(dual_clip=1), ValueError, "dual_clip must be > 1"),
    "integer_logprobs": (_policy(logprobs=LP.long()), TypeError, "logprobs must be a floating-point tensor"),
    "integer_old_logprobs": (_policy(old_logprobs=OLD.long()), TypeError, "old_logprobs must be a floating-point"),
    "bool_advantages": (_policy(advantages=ADV > 0), TypeError, "advantages must be real numbers"),
    "complex_advantages": (_policy(advantages=ADV.to(torch.complex128)), TypeError, "advantages must be real"),
    "half_mask": (_policy(loss_mask=MASK.double() * 0.5), ValueError, "loss_mask must be bool"),
    "nan_advantage_masked_in": (
        _policy(advantages=_masked_in(ADV[:, None].expand(4, 6), NAN)),
        ValueError,
        r"advantages is not finite at masked-in position \(0, 0\)",
    ),
    "inf_old_masked_in": (
        _policy(old_logprobs=_masked_in(OLD, -INF)),
        ValueError,
        r"old_logprobs is not finite at masked-in position \(0, 0\)",
    ),
    "sft_integer_logprobs": (lambda: dta_ref.sft_loss(LP.long(), MASK), TypeError, "logprobs must be a floating"),
    "class_nan_clip": (_policy_fn(clip_low=NAN), ValueError, "clip_low must be finite"),
    "class_integer_old": (_policy_fn(old_logprobs=OLD.int()), TypeError, "old_logprobs must be a floating"),
    "class_nan_advantage_masked_in": (
        _policy_fn(advantages=_masked_in(ADV[:, None].expand(4, 6), NAN)),
        ValueError,
        "advantages is not finite",
    ),
    "class_1d_old": (_policy_fn(old_logprobs=OLD[0], loss_mask=MASK[0]), ValueError, r"old_logprobs must be \[N, L\]"),
    "normalization_not_a_string": (_policy(normalization=1), ValueError, "normalization must be one of"),
    "call_past_end": (
        lambda: PolicyGradientLoss(OLD, ADV, MASK)(3, LP[3, :3]),
        ValueError,
        "loss mask is True past the 3 logprobs of sequence 3",
    ),
    "call_integer_logprobs": (lambda: SFTLoss(MASK)(0, LP[0].long()), TypeError, "logprobs must be a floating"),
}


@pytest.mark.parametrize("case", list(LOSS_ARGUMENTS))
def test_loss_arguments(case):
    fn, error, match = LOSS_ARGUMENTS[case]
    with pytest.raises(error, match=match):
        fn()


def test_mask_past_end_refused_by_tree_backward():
    """A mask True past a sequence's end: tree_backward refuses it instead of disagreeing with the padded loss."""
    import dta_fast

    mask = TREE.logprob_mask.clone()
    mask[3, -1] = True  # rollout 3 is shorter than the longest
    loss = SFTLoss(mask)
    with pytest.raises(ValueError, match="loss mask is True at step 20 of sequence 3"):
        dta_fast.tree_backward(tiny_decoder(torch.float64), TREE, loss)


# ------------------------------------------------------- trees not made by the builder


def _crossing():
    end = TREE.subtree_end.clone()
    end[1] = int(TREE.seq_index[1, 17]) + 1  # a range that ends inside a sibling subtree
    return dataclasses.replace(TREE, subtree_end=end)


def _shifted_positions():
    return dataclasses.replace(TREE, position_ids=TREE.position_ids + 1)


def _wrong_parent():
    parent = TREE.parent.clone()
    parent[5] = 2
    return dataclasses.replace(TREE, parent=parent)


def _not_a_path():
    index = TREE.seq_index.clone()
    index[1, 3], index[1, 4] = index[1, 4].clone(), index[1, 3].clone()
    return dataclasses.replace(TREE, seq_index=index)


def _long_lengths():
    return dataclasses.replace(TREE, lengths=TREE.lengths + 1)


def _int32_end():
    return dataclasses.replace(TREE, subtree_end=TREE.subtree_end.int())


def _list_end():
    return dataclasses.replace(TREE, subtree_end=TREE.subtree_end.tolist())


BAD_TREES = {
    "crossing_subtree_end": (_crossing, ValueError, "position_ids|not a preorder forest|parent"),
    "shifted_positions": (_shifted_positions, ValueError, r"position_ids\[0\] = 1"),
    "wrong_parent": (_wrong_parent, ValueError, r"parent\[5\] = 2"),
    "seq_index_not_a_path": (_not_a_path, ValueError, r"seq_index\[1\] is not a root-to-node path"),
    "lengths_too_long": (_long_lengths, ValueError, "lengths must be between 1 and Lmax"),
    "int32_subtree_end": (_int32_end, TypeError, "subtree_end must be a long"),
    "list_subtree_end": (_list_end, TypeError, "subtree_end must be a tensor"),
}


def _entry(name):
    if name == "reference_tree_logprobs":
        return lambda tree: dta_ref.tree_logprobs(tiny_decoder(torch.float64), tree)
    if name == "fast_tree_logprobs":
        pytest.importorskip("triton")
        import dta_fast

        return lambda tree: dta_fast.tree_logprobs(
            tiny_decoder(torch.float32).to(DEVICE), tree, attention_impl="kernel"
        )
    import dta_fast

    return lambda tree: dta_fast.tree_backward(tiny_decoder(torch.float64), tree, SFTLoss(TREE.logprob_mask))


@pytest.mark.parametrize("entry", ["reference_tree_logprobs", "fast_tree_logprobs", "tree_backward"])
@pytest.mark.parametrize("bad", list(BAD_TREES))
def test_trees_not_made_by_the_builder(bad, entry):
    make, error, match = BAD_TREES[bad]
    with pytest.raises(error, match=match):
        _entry(entry)(make())


def test_validate_accepts_builder_trees():
    from dta_fast import build_tree

    assert TREE.validate() is TREE
    assert build_tree(SEQUENCES).validate() is not None
    # the same tensors in a tree the builders did not make: every check runs, and passes
    for tree in (TREE, build_tree(SEQUENCES)):
        again = dataclasses.replace(tree)
        assert not again._known_valid() and again.validate() is again and again._known_valid()


def test_builder_trees_are_checked_again_once_changed():
    """A builder's tree skips the checks while its tensors are unchanged; an in-place write to one of
    them (or the tree rebuilt around other tensors) brings them back."""
    from dta_fast import build_tree

    for tree in (
        PrefixTree.from_sequences(SEQUENCES),
        build_tree(SEQUENCES),
        PrefixTree.from_sequences(SEQUENCES).to("cpu"),
    ):
        assert tree._known_valid()
        tree.subtree_end[0] = 1  # crosses the ranges under token 0
        with pytest.raises(ValueError, match="position_ids|not a preorder forest|parent"):
            tree.validate()
        with pytest.raises(ValueError, match="position_ids|not a preorder forest|parent"):
            _entry("tree_backward")(tree)
    changed = dataclasses.replace(TREE, subtree_end=TREE.subtree_end.clone())
    changed.subtree_end[0] = 1
    with pytest.raises(ValueError, match="position_ids|not a preorder forest|parent"):
        changed.validate()


# ------------------------------------------------------------ deep errors made clear


CLEAR_ERRORS = {
    "token_beyond_int64": (lambda: PrefixTree.from_sequences([[1, 2**63]]), ValueError, "does not fit int64"),
    "uint64_array": (
        lambda: PrefixTree.from_sequences([np.array([1, 2**64 - 1], dtype=np.uint64)]),
        ValueError,
        "does not fit int64",
    ),
    "fast_builder_uint64": (
        lambda: _build_tree([np.array([3, 2**63], dtype=np.uint64)]),
        ValueError,
        "does not fit int64",
    ),
    "reference_zero_heads": (
        lambda: dta_ref.attention(*_qkv(h=0), torch.ones(4, 4, dtype=torch.bool)),
        ValueError,
        "heads, tokens and head dim must be at least 1",
    ),
    "reference_zero_head_dim": (
        lambda: dta_ref.attention(*_qkv(d=0), torch.ones(4, 4, dtype=torch.bool)),
        ValueError,
        "heads, tokens and head dim must be at least 1",
    ),
    "reference_nan_scale": (
        lambda: dta_ref.attention(*_qkv(), torch.ones(4, 4, dtype=torch.bool), NAN),
        ValueError,
        "scale must be finite",
    ),
    "kernel_zero_heads": (
        lambda: _kernel()(*_qkv(h=0), torch.full((4,), 4)),
        ValueError,
        "heads, tokens and head dim must be at least 1",
    ),
    "kernel_zero_head_dim": (
        lambda: _kernel()(*_qkv(d=0), torch.full((4,), 4)),
        ValueError,
        "heads, tokens and head dim must be at least 1",
    ),
    "kernel_list_subtree_end": (lambda: _kernel()(*_qkv(), [4, 4, 4, 4]), TypeError, "subtree_end must be an integer"),
    "kernel_numpy_subtree_end": (lambda: _kernel()(*_qkv(), np.full(4, 4)), TypeError, "subtree_end must be an"),
    "kernel_string_scale": (
        lambda: _kernel()(*_qkv(), torch.full((4,), 4), "0.1"),
        TypeError,
        "scale must be a real number",
    ),
}


def _build_tree(sequences):
    from dta_fast import build_tree

    return build_tree(sequences)


def _qkv(h=1, d=16):
    return [torch.zeros(1, h, 4, d, device=DEVICE) for _ in range(3)]


@pytest.mark.parametrize("case", list(CLEAR_ERRORS))
def test_clear_errors(case):
    fn, error, match = CLEAR_ERRORS[case]
    if case.startswith("kernel") or case.startswith("fast"):
        pytest.importorskip("triton")
    with pytest.raises(error, match=match):
        fn()


def test_plot_help_writes_no_file(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from dta_ref.plot import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "usage" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_draw_tree_labels(tmp_path):
    """draw_tree takes its labels as a dict, a list indexed by id or a function, and names anything else."""
    pytest.importorskip("matplotlib")
    from dta_ref.plot import draw_tree, label_fn

    assert [label_fn({1: "a"})(t) for t in (1, 2)] == ["a", "2"]
    assert [label_fn(["x", "y"])(t) for t in (1, 5)] == ["y", "5"]
    assert label_fn(lambda t: t * 10)(3) == "30"
    for labels in ({1: "a"}, ["x", "y", "z"], lambda t: f"<{t}>"):
        path = draw_tree([[1, 2], [1, 0]], tmp_path / "tree.png", token_labels=labels)
        assert path.stat().st_size > 0
        path.unlink()
    with pytest.raises(TypeError, match="token_labels must be a dict, a sequence or a function"):
        draw_tree([[1, 2]], tmp_path / "tree.png", token_labels=5)


def test_draw_states(tmp_path):
    """The linear-attention picture draws a forked tree and refuses one too large to read."""
    pytest.importorskip("matplotlib")
    from dta_ref import draw_states
    from dta_ref.plot import main

    path = draw_states([[0, 1, 2, 3], [0, 1, 4]], tmp_path / "states.png")
    assert path.exists() and path.stat().st_size > 0
    main(["--states", str(tmp_path / "example.png")])
    assert (tmp_path / "example.png").stat().st_size > 0
    with pytest.raises(ValueError, match="draws at most"):
        draw_states([list(range(300))], tmp_path / "big.png")
