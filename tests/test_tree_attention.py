"""dta_fast.tree_attention against dta_ref.attention with the explicit mask.

On a CPU machine these run the Triton kernels under TRITON_INTERPRET=1 at
small sizes (indexing and masking); tests marked gpu run real sizes.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.kernel

import dta_fast  # noqa: E402
from dta_fast import build_schedule, tree_attention  # noqa: E402
from dta_ref import PrefixTree, agentic_batch, grpo_batch  # noqa: E402
from tests.attention_checks import (  # noqa: E402
    check_tree_attention,
    random_depths,
    subtree_end_from_depths,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]  # the interpreter's bfloat16 dot is unreliable; bf16 runs on GPU
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if DEVICE == "cuda" else CPU_DTYPES


def make_qkv(B, Hq, Hkv, Tq, Tk, D, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(B, Hq, Tq, D, generator=g, device=DEVICE, dtype=dtype)
    k = torch.randn(B, Hkv, Tk, D, generator=g, device=DEVICE, dtype=dtype)
    v = torch.randn(B, Hkv, Tk, D, generator=g, device=DEVICE, dtype=dtype)
    return q, k, v


def named_trees():
    """Small versions of the shapes users train on, plus adversarial ones."""
    rng = np.random.default_rng(0)
    return {
        "grpo": PrefixTree.from_sequences(grpo_batch(2, 21, 4, 9, vocab_size=50)).subtree_end,
        "agentic": PrefixTree.from_sequences(agentic_batch(13, 2, 3, 2, 3, 4, 5, vocab_size=50)).subtree_end,
        "chain": torch.full((37,), 37),
        "fan": PrefixTree.from_sequences([[0, t] for t in range(60)]).subtree_end,
        "forest_of_singletons": torch.arange(1, 30),
        "forest": PrefixTree.from_sequences([[1, 2, 3], [1, 2, 4, 5], [7, 8, 9, 9, 9], [3]]).subtree_end,
        "random": subtree_end_from_depths(random_depths(83, rng)),
        "one_token": torch.tensor([1]),
    }


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(named_trees()))
def test_named_trees(name, dtype):
    end = named_trees()[name].to(DEVICE)
    T = end.shape[0]
    q, k, v = make_qkv(1, 4, 2, T, T, 32, dtype)
    check_tree_attention(q, k, v, end)


@pytest.mark.parametrize(
    "B,Hq,Hkv,D",
    [(1, 2, 2, 8), (1, 2, 2, 64), (2, 4, 1, 80), (1, 6, 2, 96), (1, 2, 1, 128)],
    ids=lambda x: str(x),
)
def test_head_dims_and_gqa(B, Hq, Hkv, D):
    end = subtree_end_from_depths(random_depths(45, np.random.default_rng(D))).to(DEVICE)
    q, k, v = make_qkv(B, Hq, Hkv, 45, 45, D, torch.float32, seed=D)
    check_tree_attention(q, k, v, end)


@pytest.mark.parametrize("Tq", [1, 7, 16, 33])
def test_cached_prefix(Tq):
    """Tq < Tk: the first Tk - Tq keys are a cached prefix the queries attend."""
    rng = np.random.default_rng(Tq)
    end = subtree_end_from_depths(random_depths(50, rng)).to(DEVICE)
    q, k, v = make_qkv(1, 2, 1, Tq, 50, 32, torch.float32, seed=Tq)
    check_tree_attention(q, k, v, end)


def test_per_batch_trees():
    """subtree_end [B, Tk]: every batch row has its own tree."""
    rng = np.random.default_rng(1)
    end = torch.stack([subtree_end_from_depths(random_depths(40, rng)) for _ in range(3)]).to(DEVICE)
    q, k, v = make_qkv(3, 2, 2, 40, 40, 32, torch.float32)
    out = check_tree_attention(q, k, v, end)[0]
    for b in range(3):  # each row equals running its own tree alone
        alone = tree_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], end[b])
        torch.testing.assert_close(out[b : b + 1], alone, rtol=0, atol=0)


@pytest.mark.parametrize("shared", [True, False], ids=["one_tree", "per_row_trees"])
def test_batch_past_the_grid_limit_runs_in_slices(shared, monkeypatch):
    """CUDA grids take 65535 programs on the axis the kernels give to batch x heads: a larger batch (a
    rollout of thousands of rows) runs in slices, with the same outputs, LSE and gradients (the limit
    lowered here so that 5 rows of 2 heads cross it; test_gpu_batch_past_the_grid_limit crosses the real one)."""
    rng = np.random.default_rng(11)
    rows = [subtree_end_from_depths(random_depths(20, rng)) for _ in range(5)]
    end = (rows[0] if shared else torch.stack(rows)).to(DEVICE)
    q, k, v = make_qkv(5, 2, 1, 12, 20, 16, torch.float32)
    schedule = build_schedule(end, 12)

    def run():
        inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out, lse = tree_attention(*inputs, schedule=schedule, return_lse=True, scale=-0.3)
        (out * torch.linspace(-1, 1, out.numel(), device=DEVICE).view_as(out)).sum().backward()
        return out, lse, *[x.grad for x in inputs]

    whole = run()
    monkeypatch.setattr(dta_fast.attention.function, "MAX_GRID_ROWS", 5)  # 2 rows of 2 heads per slice
    for got, want in zip(run(), whole):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_batch_past_the_grid_limit():
    """16,400 rows of 4 heads: 65,600 programs on the grid's second axis (CUDA's limit is 65535), as a
    rollout's decode step of that many sequences has; each row equals its own call."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    B, Tk = 16400, 5
    end = torch.tensor([5, 3, 3, 5, 5], device=DEVICE)
    q, k, v = (x.requires_grad_() for x in make_qkv(B, 4, 2, 2, Tk, 16, torch.bfloat16))
    out = tree_attention(q, k, v, end)
    out.float().sum().backward()
    for b in (0, 9000, B - 1):
        qb, kb, vb = (x.detach()[b : b + 1].requires_grad_() for x in (q, k, v))
        alone = tree_attention(qb, kb, vb, end)
        alone.float().sum().backward()
        torch.testing.assert_close(out[b : b + 1], alone)  # bfloat16's tolerance: a row alone may split
        for g, gb in ((q.grad, qb.grad), (k.grad, kb.grad), (v.grad, vb.grad)):  # dK/dV's heads otherwise
            torch.testing.assert_close(g[b : b + 1], gb)


@pytest.mark.parametrize("scale", [0.37, 0.0, -2.5])
def test_custom_scale_and_lse(scale):
    end = subtree_end_from_depths(random_depths(30, np.random.default_rng(3))).to(DEVICE)
    q, k, v = make_qkv(1, 2, 1, 30, 30, 16, torch.float32)
    check_tree_attention(q, k, v, end, scale=scale)
    out, lse = tree_attention(q, k, v, end, scale, return_lse=True)
    mask = dta_fast_mask(end, 30)
    group = q.shape[1] // k.shape[1]
    s = (q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2)) * scale
    expected = torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1)
    torch.testing.assert_close(lse.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [-8.0, 8.0])
def test_large_scales_of_either_sign_on_full_blocks(scale):
    """A causal chain has full key blocks, whose loop takes the row max of the unscaled scores: with a
    negative scale that is the row min, which overflows exp2 unless the sign is folded into q first."""
    T = 48
    end = torch.full((T,), T, dtype=torch.int64, device=DEVICE)
    q, k, v = make_qkv(1, 2, 2, T, T, 16, torch.float32)
    check_tree_attention(q, k, v, end, scale=scale)


def dta_fast_mask(end, Tq):
    from dta_ref import mask_from_subtree_end

    Tk = end.shape[-1]
    return mask_from_subtree_end(end, torch.arange(Tk - Tq, Tk, device=end.device))


def test_schedule_reuse_matches_fresh():
    end = subtree_end_from_depths(random_depths(40, np.random.default_rng(4))).to(DEVICE)
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, torch.float32)
    schedule = build_schedule(end)
    torch.testing.assert_close(tree_attention(q, k, v, schedule=schedule), tree_attention(q, k, v, end), rtol=0, atol=0)


def test_forward_without_graph_matches_autograd_path():
    """With nothing to differentiate the forward skips the autograd Function: same output and LSE, bitwise."""
    end = subtree_end_from_depths(random_depths(40, np.random.default_rng(5))).to(DEVICE)
    q, k, v = make_qkv(1, 4, 2, 30, 40, 16, torch.float32)
    schedule = build_schedule(end, 30)
    with torch.no_grad():
        plain = tree_attention(q, k, v, schedule=schedule, return_lse=True)
    graph = tree_attention(*(x.clone().requires_grad_(True) for x in (q, k, v)), schedule=schedule, return_lse=True)
    assert not plain[0].requires_grad and graph[0].requires_grad
    for a, b in zip(plain, graph):
        assert torch.equal(a, b.detach())


@pytest.mark.parametrize("Tq", [70, 23])
def test_key_block_order_is_longest_first(Tq):
    """dK/dV programs launch every (batch row, key block) once, most query blocks to walk first."""
    rng = np.random.default_rng(Tq)
    Tk, BM, BN = 70, 16, 8
    end = torch.stack([subtree_end_from_depths(random_depths(Tk, rng)) for _ in range(2)]).to(DEVICE)
    schedule = build_schedule(end, Tq)
    Mq, Nk = -(-Tq // BM), -(-Tk // BN)
    visible = torch.nn.functional.pad(dta_fast_mask(end, Tq), (0, Nk * BN - Tk, 0, Mq * BM - Tq))
    # a key block's program walks exactly the query blocks holding a query that one of its keys sees
    work = visible.view(2, Mq, BM, Nk, BN).any(4).any(2).sum(1).flatten()
    walked = dta_fast.attention.schedule.key_block_work(schedule.subtree_end, Tq, BM, BN)
    assert walked.tolist() == work.tolist()
    order = schedule.key_block_order(BM, BN).long().cpu()
    work = work.cpu()
    assert sorted(order.tolist()) == list(range(2 * Nk))
    assert bool((work[order][1:] <= work[order][:-1]).all())


def test_deterministic():
    end = subtree_end_from_depths(random_depths(70, np.random.default_rng(5))).to(DEVICE)
    q, k, v = make_qkv(1, 4, 2, 70, 70, 32, torch.float16)
    first = check_tree_attention(q, k, v, end)
    second = check_tree_attention(q, k, v, end)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def expected_shares(work, heads_per_row, group, slots, sms):
    """DkdvShares.shares by its rule, written out in NumPy: the largest F of 4, 2, 1, 0 whose split units
    fit ``slots``, then ceil(work x F x SMs / (total x heads_per_row)) between 1 and group."""
    work = np.asarray(work, dtype=np.int64)
    den = max(int(work.sum()) * heads_per_row, 1)
    for F in (4, 2, 1, 0):
        shares = np.clip(-(-work * F * sms // den), 1, group)
        if np.where(shares > 1, shares, 0).sum() * heads_per_row <= slots:
            return shares.tolist()


def test_dkdv_shares_follow_the_work(monkeypatch):
    """dK/dV shares a unit's query heads out over programs where its work is more than a program's share
    of the GPU: a long prompt's units, not its short branches'; nothing where every program is small
    or a K/V head has one query head; within the workspace, whose slots the units take in turn."""
    from dta_fast.attention import schedule

    monkeypatch.setattr(schedule, "sm_count", lambda device: 16)

    def shares_of(end, heads_per_row, group, head_dim=64):
        plan = build_schedule(end.to(DEVICE)).dkdv_shares(heads_per_row, group, head_dim)
        return plan, plan.shares.tolist(), plan.first.tolist()

    # a prompt of 1024 tokens and 64 branches of 8: 12 units of 128 keys
    tree = PrefixTree.from_sequences([list(range(1024)) + [2000 + 8 * i + j for j in range(8)] for i in range(64)])
    end = tree.subtree_end
    work = schedule.key_block_work(end[None].int().to(DEVICE), tree.num_tokens, 64, 128).tolist()
    plan, shares, first = shares_of(end, 2, 7)
    assert plan.max_shares == 7 and len(shares) == 12
    assert shares == expected_shares(work, 2, 7, plan.slots, 16)
    # the prompt's units split, the more the longer they walk; the branches' do not
    assert min(shares[:8]) > 1 and shares[:8] == sorted(shares[:8], reverse=True) and shares[8:] == [1] * 4
    assert first == np.concatenate([[0], np.cumsum([x if x > 1 else 0 for x in shares])[:-1]]).tolist()
    # nothing to split: one query head per K/V head, or programs that each hold little
    plan, shares, _ = shares_of(end, 2, 1)
    assert plan.max_shares == 1 and shares == [1] * 12
    balanced = subtree_end_from_depths([0, 1] * 600)  # 600 two-token roots: every unit walks its own keys
    assert set(shares_of(balanced, 64, 4)[1]) == {1}
    # a workspace too small for F = 4 takes a smaller F; one with no room splits nothing
    monkeypatch.setattr(schedule, "DKDV_SPLIT_WORKSPACE_BYTES", 2 * 128 * 64 * 4 * 40)  # 40 slots
    plan, shares, _ = shares_of(end, 2, 7)
    assert plan.slots == 40 and shares == expected_shares(work, 2, 7, 40, 16)
    assert 1 < max(shares) < 7 and sum(x for x in shares if x > 1) * 2 <= 40
    monkeypatch.setattr(schedule, "DKDV_SPLIT_WORKSPACE_BYTES", 0)
    plan, shares, _ = shares_of(end, 2, 7)
    assert plan.max_shares == 1 and shares == [1] * 12


@pytest.mark.parametrize("Tq", [45, 19])
def test_dkdv_shares_match_one_program_per_group(Tq, monkeypatch):
    """Each GQA group's query heads shared out over programs (float32 partials summed in share order)
    give the reference's gradients, those of one program per group up to rounding, and bitwise the
    same gradients again."""
    from dta_fast.attention import schedule

    end = subtree_end_from_depths(random_depths(45, np.random.default_rng(11))).to(DEVICE)
    q, k, v = make_qkv(1, 6, 2, Tq, 45, 32, torch.float32, seed=3)
    monkeypatch.setattr(schedule, "DKDV_SPLIT_PROGRAMS_PER_SM", 0)
    whole = check_tree_attention(q, k, v, end)
    assert build_schedule(end, Tq).dkdv_shares(2, 3, 32).shares.tolist() == [1]
    monkeypatch.setattr(schedule, "DKDV_SPLIT_PROGRAMS_PER_SM", 10**6)
    split = check_tree_attention(q, k, v, end)
    again = check_tree_attention(q, k, v, end)
    assert build_schedule(end, Tq).dkdv_shares(2, 3, 32).shares.tolist() == [3]
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), whole, split, again):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(b, c), name


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dkdv_shares_on_a_prompt_and_short_branches(dtype, monkeypatch):
    """Units of 64 keys and 4 SMs, on any device: the prompt's units split over programs, the branches'
    not, in one call; dK and dV match the reference, and each K/V head of a split unit gets slots of
    its own."""
    from dta_fast.attention import schedule

    monkeypatch.setattr(schedule, "DKDV_SPLIT_UNIT", 64)  # a multiple of every dK/dV key block at head dim 16
    monkeypatch.setattr(schedule, "sm_count", lambda device: 4)
    tree = PrefixTree.from_sequences([list(range(128)) + [200 + 8 * i + j for j in range(8)] for i in range(16)])
    end = tree.subtree_end.to(DEVICE)
    assert build_schedule(end).dkdv_shares(2, 3, 16).shares.tolist() == [3, 3, 1, 1]
    q, k, v = make_qkv(1, 6, 2, tree.num_tokens, tree.num_tokens, 16, dtype, seed=5)
    check_tree_attention(q, k, v, end)


# ------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "end, match",
    [
        (torch.tensor([3, 1, 3]), "must be > its index"),
        (torch.tensor([3, 2, 4]), "exceeds the number of keys"),
        (torch.tensor([2, 3, 3]), "crosses"),
        (torch.tensor([4, 3, 4, 4]), "crosses"),
        (torch.tensor([3, 3]), "but k has 3 keys"),
    ],
    ids=["end_not_after_index", "end_past_T", "crossing", "crossing_later", "wrong_length"],
)
def test_invalid_subtree_end(end, match):
    T = 3 if match.startswith("but") else end.shape[0]
    q, k, v = make_qkv(1, 1, 1, T, T, 16, torch.float32)
    with pytest.raises(ValueError, match=match):
        tree_attention(q, k, v, end.to(DEVICE))


def test_a_tree_is_checked_once_until_written(monkeypatch):
    """tree_attention(subtree_end=t) checks t (a host sync) on its first call only, as every layer
    passes the same tensor; writing t in place makes the next call check it again."""
    from dta_fast.attention import schedule

    checks = []
    monkeypatch.setattr(schedule, "validate_subtree_end", lambda end: checks.append(1) or schedule.nesting_depth(end))
    end = torch.tensor([3, 2, 3], device=DEVICE)
    q, k, v = make_qkv(1, 1, 1, 3, 3, 16, torch.float32)
    for _ in range(3):
        tree_attention(q, k, v, end)
    assert len(checks) == 1
    end[1] = 4  # crosses its parent's subtree
    with pytest.raises(ValueError, match="exceeds|crosses"):
        tree_attention(q, k, v, end)
    assert len(checks) == 2


def test_bad_inputs():
    q, k, v = make_qkv(1, 4, 2, 5, 5, 16, torch.float32)
    end = torch.full((5,), 5, device=DEVICE)
    with pytest.raises(TypeError, match="float16, bfloat16 and float32"):
        tree_attention(q.double(), k.double(), v.double(), end)
    with pytest.raises(TypeError, match="share a dtype"):
        tree_attention(q, k.half(), v, end)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        tree_attention(q[:, :3], k, v, end)
    with pytest.raises(ValueError, match="4-D"):
        tree_attention(q[0], k, v, end)
    with pytest.raises(ValueError, match="more queries"):
        tree_attention(torch.cat([q, q], 2), k, v, end)
    with pytest.raises(ValueError, match="k and v must agree in batch, heads and tokens"):
        tree_attention(q, k, v[:, :1], end)
    with pytest.raises(ValueError, match="sliding window needs position_ids"):
        tree_attention(q, k, v, end, window=2)
    with pytest.raises(ValueError, match="window must be >= 1"):
        tree_attention(q, k, v, end, window=0, position_ids=torch.arange(5, device=DEVICE))
    with pytest.raises(ValueError, match="one logit per query head"):
        tree_attention(q, k, v, end, sinks=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="softcap must be positive"):
        tree_attention(q, k, v, end, softcap=-1.0)
    with pytest.raises(ValueError, match="pass position_ids to build_schedule"):
        tree_attention(q, k, v, schedule=build_schedule(end), window=2, position_ids=torch.arange(5, device=DEVICE))
    with pytest.raises(TypeError, match="integer tensor"):
        tree_attention(q, k, v, end.float())
    with pytest.raises(ValueError, match="subtree_end must be"):
        tree_attention(q, k, v, end.view(1, 1, 5))
    with pytest.raises(ValueError, match="batch size"):
        tree_attention(q, k, v, end.expand(3, 5))
    with pytest.raises(ValueError, match="head dim"):
        big = torch.zeros(1, 1, 5, 320, device=DEVICE)
        tree_attention(big, big, big, end)
    with pytest.raises(ValueError, match="needs subtree_end"):
        tree_attention(q, k, v)


def test_bad_arguments_of_the_schedule_and_scale():
    q, k, v = make_qkv(1, 2, 1, 5, 5, 16, torch.float32)
    end = torch.full((5,), 5, device=DEVICE)
    for num_queries, exc in ((2.5, TypeError), (True, TypeError), ("3", TypeError), (0, ValueError), (6, ValueError)):
        with pytest.raises(exc, match="num_queries|number of queries"):
            build_schedule(end, num_queries)
    assert build_schedule(end, np.int64(3)).num_queries == 3  # a NumPy integer is an int
    for bad in (end.float(), end.bool(), end.tolist()):
        with pytest.raises(TypeError, match="subtree_end must be"):
            dta_fast.validate_subtree_end(bad)
    dta_fast.validate_subtree_end(end)  # [T] as well as [B, T]
    with pytest.raises(ValueError, match="must be > its index"):
        dta_fast.validate_subtree_end(torch.tensor([3, 1, 3]))
    for scale in (1e39, float("nan"), 10**400):
        with pytest.raises(ValueError, match="scale must be finite"):
            tree_attention(q, k, v, end, scale=scale)
    # a schedule made by hand must be what the kernels read
    with pytest.raises(ValueError, match="contiguous int32"):
        dta_fast.TreeSchedule(end[None].int().expand(2, 5), 5)
    with pytest.raises(ValueError, match="contiguous int32"):
        dta_fast.TreeSchedule(end.int(), 5)
    # its tiles: int powers of two
    schedule = build_schedule(end, 5)
    for blocks, exc in (
        ((4, 0), ValueError),
        ((-4, 4), ValueError),
        ((4, 12), ValueError),
        ((4.0, 4), TypeError),
        ((True, 4), TypeError),
    ):
        for method in (schedule.block_lists, schedule.key_block_order):
            with pytest.raises(exc, match="BLOCK_[MN] must be"):
                method(*blocks)
    assert schedule.block_lists(np.int64(4), 2).count.numel() == 2  # NumPy ints are ints


def test_schedule_keeps_the_tree_it_was_built_from():
    """build_schedule copies subtree_end: writing the tensor afterwards changes neither the schedule's
    mask nor its block lists (which would disagree with each other)."""
    end = torch.arange(1, 33, dtype=torch.int32, device=DEVICE)
    q, k, v = make_qkv(1, 1, 1, 32, 32, 16, torch.float32)
    schedule = build_schedule(end)
    before = tree_attention(q, k, v, schedule=schedule)
    end.fill_(32)
    after = tree_attention(q, k, v, schedule=schedule)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    torch.testing.assert_close(after, tree_attention(q, k, v, torch.arange(1, 33, device=DEVICE)), rtol=0, atol=0)
    assert not torch.equal(after, tree_attention(q, k, v, end))  # the tree written since differs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree_shape", [(6,), (0, 6)])  # one tree shared by no rows; one tree per row, of none
def test_empty_batch_with_gqa(tree_shape, dtype):
    q, k, v = (x.requires_grad_() for x in make_qkv(0, 4, 2, 6, 6, 16, dtype))
    out = tree_attention(q, k, v, torch.full(tree_shape, 6, device=DEVICE))
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("loss", ["square", "linear"])
def test_second_derivatives_are_refused_not_dropped(loss):
    """The backward builds no graph: create_graph=True raises instead of giving a gradient without its
    second-order part (for a loss linear in the output too, whose incoming gradient has no graph)."""
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 2, 1, 6, 6, 16, torch.float32))
    out = tree_attention(q, k, v, torch.full((6,), 6, device=DEVICE))
    objective = out.pow(2).sum() if loss == "square" else (out * torch.randn_like(out)).sum()
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(objective, q, create_graph=True)


def test_twins_under_autocast():
    """Under bfloat16 autocast, as a model's RoPE leaves them: float32 q and k beside a bfloat16 v. Both
    twins cast all three to bfloat16 (as SDPA's inputs are cast) and agree in output and gradients."""
    from dta_ref import attention

    end = subtree_end_from_depths(random_depths(24, np.random.default_rng(6))).to(DEVICE)
    q, k, v = make_qkv(1, 2, 1, 24, 24, 16, torch.float32)
    v = v.to(torch.bfloat16)
    mask = dta_fast_mask(end, 24)

    def run(fn):
        inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = fn(*inputs)
        out.float().pow(2).sum().backward()
        return out, [x.grad for x in inputs]

    out, grads = run(lambda q, k, v: tree_attention(q, k, v, end))
    ref, ref_grads = run(lambda q, k, v: attention(q, k, v, mask))
    assert out.dtype == ref.dtype == torch.bfloat16
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, torch.bfloat16]
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=5e-2, atol=5e-2)


def test_float64_under_autocast_stays_float64():
    """Autocast leaves float64 alone (SDPA's inputs too): the float64 reference keeps its digits under it,
    and the kernels refuse float64 there as they do outside it."""
    import torch.nn.functional as F

    from dta_ref import attention

    end = torch.tensor([5, 3, 3, 5, 5], device=DEVICE)
    q, k, v = make_qkv(1, 2, 1, 5, 5, 16, torch.float64)
    mask = dta_fast_mask(end, 5)
    truth = attention(q, k, v, mask)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        ref = attention(q, k, v, mask)
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])
        with pytest.raises(TypeError, match="float64"):
            tree_attention(q, k, v, end)
    assert ref.dtype == sdpa.dtype == torch.float64
    torch.testing.assert_close(ref, truth, rtol=0, atol=0)
    torch.testing.assert_close(sdpa, truth, rtol=1e-12, atol=1e-12)
    # a scale past float32's range would make every float32 score inf: refused, as by the kernels
    with pytest.raises(ValueError, match="scale must be finite and at most"):
        attention(q.float(), k.float(), v.float(), mask, scale=1e39)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's bfloat16 path")
def test_bfloat16_under_the_interpreter():
    """The Triton interpreter's bfloat16 dot is wrong by orders of magnitude; tree_attention runs its
    kernels in float32 there and returns bfloat16, gradients included."""
    end = torch.arange(1, 21)
    q, k, v = (x.to(torch.bfloat16).requires_grad_() for x in make_qkv(1, 2, 1, 20, 20, 32, torch.float32))
    out, lse = tree_attention(q, k, v, end, return_lse=True)
    ref_q, ref_k, ref_v = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = dta_fast.tree_attention(ref_q, ref_k, ref_v, end)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref.to(torch.bfloat16), rtol=0, atol=0)
    out.sum().backward()
    ref.sum().backward()
    for x, r in ((q, ref_q), (k, ref_k), (v, ref_v)):
        assert x.grad.dtype == torch.bfloat16
        torch.testing.assert_close(x.grad, r.grad.to(torch.bfloat16), rtol=0, atol=0)
    from dta_ref import attention, mask_from_subtree_end

    expected = attention(*(x.detach().double() for x in (q, k, v)), mask_from_subtree_end(end, torch.arange(20)))
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def test_public_api():
    assert dta_fast.tree_attention is tree_attention


# ----------------------------------------------------------------- GPU sizes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        dict(name="grpo", P=4096, N=8, R=1024),
        dict(name="grpo_odd", P=3001, N=5, R=777),
        dict(name="agentic"),
        dict(name="random", T=20011),
    ],
    ids=lambda s: s["name"],
)
def test_gpu_real_sizes(shape, dtype):
    if shape["name"].startswith("grpo"):
        end = PrefixTree.from_sequences(grpo_batch(1, shape["P"], shape["N"], shape["R"])).subtree_end
    elif shape["name"] == "agentic":
        end = PrefixTree.from_sequences(agentic_batch(2048, 3, 100, 3, 4, 150, 300)).subtree_end
    else:
        end = subtree_end_from_depths(random_depths(shape["T"], np.random.default_rng(0), p_up=0.01))
    T = end.shape[0]
    q, k, v = make_qkv(1, 2, 1, T, T, 128, dtype)
    check_tree_attention(q, k, v, end.cuda())


VARIANTS = {
    "gemma3-window1024": dict(window=1024),
    "gpt-oss-sinks-window128": dict(window=128, sinks=True),
    "gemma2-softcap": dict(softcap=50.0, window=4096),
    "mla-192-128": dict(dims=(192, 128)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_variants_real_sizes(variant, dtype):
    """The variants compiled, on a GRPO tree whose rollouts outgrow the windows, GQA, a cached prefix."""
    options = dict(VARIANTS[variant])
    tree = PrefixTree.from_sequences(grpo_batch(1, 2048, 4, 1024))
    T = tree.num_tokens
    D, Dv = options.pop("dims", (128, 128))
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(1, 4, T - 1000, D, generator=g, device="cuda", dtype=dtype)
    k = torch.randn(1, 2, T, D, generator=g, device="cuda", dtype=dtype)
    v = torch.randn(1, 2, T, Dv, generator=g, device="cuda", dtype=dtype)
    sinks = torch.randn(4, generator=g, device="cuda") if options.pop("sinks", False) else None
    pos = tree.position_ids.cuda() if "window" in options else None
    check_tree_attention(q, k, v, tree.subtree_end.cuda(), position_ids=pos, sinks=sinks, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
def test_gpu_head_dims_cached_prefix(D):
    end = subtree_end_from_depths(random_depths(3000, np.random.default_rng(D), p_up=0.02)).cuda()
    q, k, v = make_qkv(2, 4, 2, 1100, 3000, D, torch.bfloat16, seed=D)
    check_tree_attention(q, k, v, end)


@pytest.mark.gpu
def test_gpu_deterministic():
    end = PrefixTree.from_sequences(grpo_batch(2, 2048, 8, 512)).subtree_end.cuda()
    T = end.shape[0]
    q, k, v = make_qkv(1, 8, 2, T, T, 128, torch.bfloat16)
    do = torch.randn_like(q)

    def run():
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = tree_attention(*x, end)
        return [out, *torch.autograd.grad(out, x, do)]

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def expected_run_lengths(blocks):
    """At the first entry of each run of consecutive key blocks, the run's length; 0 at the others."""
    lengths = [0] * len(blocks)
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            lengths[start] = i - start
            start = i
    return lengths


@pytest.mark.parametrize("Tq", [70, 23, 1])
@pytest.mark.parametrize("BM, BN", [(16, 8), (8, 16), (16, 16), (8, 4)])
def test_block_lists_are_the_live_key_blocks(Tq, BM, BN):
    """Each query block lists exactly the key blocks holding a key one of its queries sees: first, in
    key order, those whose every (query, key) pair is visible, then the others in key order; and each
    group's runs of consecutive blocks carry their length at their first entry (with 4-key blocks a
    row holds more entries than the schedule kernel looks at per step)."""
    rng = np.random.default_rng(Tq + BM)
    Tk = 70
    chain, lone = torch.full((Tk,), Tk), torch.arange(1, Tk + 1)  # a causal chain, and every token alone
    grpo = PrefixTree.from_sequences(grpo_batch(1, 16, 3, 18)).subtree_end  # a prompt and 3 responses
    end = torch.stack([subtree_end_from_depths(random_depths(Tk, rng)) for _ in range(2)] + [chain, lone, grpo])
    schedule = build_schedule(end.to(DEVICE), Tq)
    Mq, Nk = -(-Tq // BM), -(-Tk // BN)
    mask = dta_fast_mask(end, Tq)
    visible = torch.nn.functional.pad(mask, (0, Nk * BN - Tk, 0, Mq * BM - Tq))
    live = visible.view(len(end), Mq, BM, Nk, BN).any(4).any(2).flatten(0, 1)  # [B * Mq, Nk]
    # full: every pair of real queries and keys visible (padding queries count as seeing, padding keys not)
    padded = torch.nn.functional.pad(
        torch.nn.functional.pad(mask, (0, 0, 0, Mq * BM - Tq), value=True), (0, Nk * BN - Tk)
    )
    full = padded.view(len(end), Mq, BM, Nk, BN).all(4).all(2).flatten(0, 1)
    expected = [(torch.nonzero(f)[:, 0].tolist(), torch.nonzero(l & ~f)[:, 0].tolist()) for l, f in zip(live, full)]
    lists = schedule.block_lists(BM, BN)
    rows = lists.rows()
    assert rows == expected
    assert any(f for f, _ in rows) and any(p for _, p in rows)  # both kinds occur
    runs = [expected_run_lengths(f) + expected_run_lengths(p) for f, p in expected]
    assert lists.run_lengths() == runs
    if BN <= 8:  # the prompt and a response's own blocks: full blocks in two runs
        assert any(sum(1 for n in expected_run_lengths(f) if n) > 1 for f, _ in expected)


@pytest.mark.parametrize("Tq", [70, 33, 1])
def test_queries_seeing_flagged_keys(Tq):
    """The isolation's scan marks exactly the queries whose mask row holds a flagged key, per batch row
    and head, for a tree per row and for one tree shared by the batch."""
    from dta_fast.attention.function import queries_seeing

    rng = np.random.default_rng(Tq)
    Tk, H = 70, 3
    ends = torch.stack([subtree_end_from_depths(random_depths(Tk, rng)) for _ in range(2)])
    flags = torch.from_numpy(rng.random((2, H, Tk)) < 0.04).to(torch.int8)
    for end in (ends, ends[:1]):
        mask = dta_fast_mask(end, Tq).expand(2, Tq, Tk)  # [B, Tq, Tk]
        expected = (mask[:, None] & flags[:, :, None, :].bool()).any(-1).to(torch.int8)
        got = queries_seeing(flags.to(DEVICE), end.to(torch.int32).to(DEVICE), Tq)
        assert torch.equal(got.cpu(), expected)


def test_autotune_bucket_by_query_count():
    """Tuning is kept per bucket of query counts: a decode step does not pick the training chunk's warps."""
    from dta_fast.attention import kernels

    for kernel in (
        kernels.tree_attention_fwd_kernel,
        kernels.tree_attention_bwd_dkdv_kernel,
        kernels.tree_attention_bwd_dq_kernel,
    ):
        assert "SIZE_CLASS" in kernel.keys
    size_class = kernels.size_class
    assert [size_class(n) for n in (1, 63, 64, 1023, 1024, 16383, 16384, 10**6)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.fixture
def no_dead_graphs():
    """Collect garbage before a test captures. torch.cuda.graph no longer does (unless
    torch.compiler.config.force_cudagraph_gc): an earlier test's graph left in a reference cycle
    (make_graphed_callables' autograd Function holds its graphs in one) was then freed by a collection
    during this test's capture, and its destructor's CUDA calls invalidated the capture (or hung it)."""
    gc.collect()


@pytest.mark.gpu
@pytest.mark.usefixtures("no_dead_graphs")
@pytest.mark.parametrize("D, dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (128, torch.float32)])
def test_gpu_cuda_graph_replays_forward_and_backward(D, dtype):
    """tree_attention as torch.cuda.make_graphed_callables graphs it (forward and backward each captured
    after its warm-up, what takes a small call's host cost away), called on new inputs: the output and
    every gradient are bitwise an eager call's. On an H100 16-bit runs the Hopper kernels, float32 the
    Triton ones. (bench_cuda_graphs.py captures a whole forward + backward in one graph instead.)"""
    end = PrefixTree.from_sequences(grpo_batch(1, 300, 4, 100)).subtree_end.cuda()
    T = end.numel()
    schedule = build_schedule(end)
    sample = [x.requires_grad_(True) for x in make_qkv(1, 4, 2, T, T, D, dtype)]
    graphed = torch.cuda.make_graphed_callables(
        lambda q, k, v: tree_attention(q, k, v, schedule=schedule), tuple(sample)
    )
    values = make_qkv(1, 4, 2, T, T, D, dtype, seed=5)
    do = torch.randn(values[0].shape, device="cuda", dtype=dtype)
    results = []
    for fn in (graphed, lambda q, k, v: tree_attention(q, k, v, schedule=schedule)):
        leaves = [x.clone().requires_grad_(True) for x in values]
        out = fn(*leaves)
        out.backward(do)
        results.append([out.detach()] + [x.grad for x in leaves])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        differ = (got != want) & ~(got.isnan() & want.isnan())
        assert torch.equal(got, want), (
            f"{name}: {int(differ.sum())} of {got.numel()} differ, NaN graphed {int(got.isnan().sum())} eager "
            f"{int(want.isnan().sum())}, max diff {(got - want).nan_to_num().abs().max().item():.3e}, "
            f"first at {differ.nonzero()[:3].tolist()}"
        )
    assert torch.isfinite(results[0][0]).all() and results[0][0].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.usefixtures("no_dead_graphs")
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # the refused capture records nothing
def test_gpu_cuda_graph_checks_a_tree_before_the_capture():
    """subtree_end checked before the capture (by an eager call) may be passed inside it, the schedule
    then built in the graph; an unchecked one is a ValueError saying so, not CUDA's unnamed capture error
    (the check reads the tree on the host)."""
    end = PrefixTree.from_sequences(grpo_batch(1, 200, 3, 50)).subtree_end.cuda()
    T = end.numel()
    q, k, v = make_qkv(1, 2, 2, T, T, 64, torch.bfloat16)
    want = tree_attention(q, k, v, end)  # checks end, compiles: the warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_attention(q, k, v, end)
    graph.replay()
    assert torch.equal(out, want)
    unchecked = end.clone()
    with pytest.raises(ValueError, match="CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            tree_attention(q, k, v, unchecked)
    assert torch.equal(tree_attention(q, k, v, unchecked), want)  # outside a capture it is checked and runs


def test_schedule_keeps_nothing_built_inside_a_capture(monkeypatch):
    """Inside a CUDA graph capture a kernel only records its work, so block lists or a key-block order
    built there hold nothing until the graph replays: the schedule hands them to that call and keeps
    none, and a later call builds its own."""
    from dta_fast.attention import TreeSchedule

    end = PrefixTree.from_sequences(grpo_batch(1, 40, 3, 20)).subtree_end.to(DEVICE)
    schedule = build_schedule(end)
    eager = build_schedule(end)
    monkeypatch.setattr(TreeSchedule, "_capturing", lambda self: True)
    assert schedule.block_lists(16, 16).rows() == eager.block_lists(16, 16).rows()
    assert torch.equal(schedule.key_block_order(16, 16), eager.key_block_order(16, 16))
    assert not schedule._lists and not schedule._order
    monkeypatch.setattr(TreeSchedule, "_capturing", lambda self: False)
    lists = schedule.block_lists(16, 16)
    assert schedule.block_lists(16, 16) is lists and schedule._lists


@pytest.mark.gpu
@pytest.mark.usefixtures("no_dead_graphs")
def test_gpu_cuda_graph_capturing_first_leaves_the_schedule_usable():
    """A schedule first used inside a capture (no warm-up with it): an eager call with it before the
    graph ever replays gives the right output, and so does the replay."""
    end = PrefixTree.from_sequences(grpo_batch(1, 200, 3, 50)).subtree_end.cuda()
    T = end.numel()
    q, k, v = make_qkv(1, 4, 2, T, T, 128, torch.bfloat16)
    want = tree_attention(q, k, v, schedule=build_schedule(end))  # compiles, with another schedule
    schedule = build_schedule(end)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_attention(q, k, v, schedule=schedule)
    assert torch.equal(tree_attention(q, k, v, schedule=schedule), want)
    graph.replay()
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_gpu_prebuilt_schedule_path_never_syncs():
    """Per layer, tree_attention with a schedule and its backward launch work without waiting on the GPU
    (as far as CUDA's sync debug mode sees: device-to-host copies such as nonzero's count)."""
    end = PrefixTree.from_sequences(grpo_batch(1, 1024, 8, 256)).subtree_end.cuda()
    T = end.shape[0]
    q, k, v = (x.requires_grad_(True) for x in make_qkv(1, 4, 2, T, T, 64, torch.bfloat16))
    tree_attention(q, k, v, end).sum().backward()  # autotuning and compiling sync; done here
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        schedule = build_schedule(end, validate=False)
        out = tree_attention(q, k, v, schedule=schedule)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("layout", ["fused_qkv", "stride0_heads"])
def test_model_layouts_equal_contiguous(layout):
    """Views a model hands tree_attention: q, k, v sliced from one fused projection [B, T, (Hq + 2 Hkv) D]
    (rows (Hq + 2 Hkv) D apart, a storage offset), or K and V one head expanded over the K/V heads
    (stride 0). Outputs and gradients are bitwise those of the same values made contiguous (on a GPU
    through the TMA descriptors and the Hopper kernels)."""
    gpu = DEVICE == "cuda"
    end = PrefixTree.from_sequences(grpo_batch(1, 300 if gpu else 12, 4, 200 if gpu else 7)).subtree_end.to(DEVICE)
    T, Hq, Hkv, D = end.numel(), 8, 2, 128 if gpu else 16
    dtype = torch.bfloat16 if gpu else torch.float32
    g = torch.Generator(device=DEVICE).manual_seed(0)
    if layout == "fused_qkv":
        W = torch.randn(1, T, (Hq + 2 * Hkv) * D, generator=g, device=DEVICE, dtype=dtype)
        q, k, v = (
            W[..., a * D : b * D].unflatten(-1, (b - a, D)).transpose(1, 2)
            for a, b in ((0, Hq), (Hq, Hq + Hkv), (Hq + Hkv, Hq + 2 * Hkv))
        )
    else:
        q = torch.randn(1, Hq, T, D, generator=g, device=DEVICE, dtype=dtype)
        k, v = (torch.randn(1, 1, T, D, generator=g, device=DEVICE, dtype=dtype).expand(1, Hkv, T, D) for _ in "kv")
        assert k.stride(1) == 0
    do = torch.randn(1, Hq, T, D, generator=g, device=DEVICE, dtype=dtype)
    schedule = build_schedule(end)
    results = []
    for inputs in ((q, k, v), tuple(x.contiguous() for x in (q, k, v))):
        leaves = [x.detach().requires_grad_() for x in inputs]
        out = tree_attention(*leaves, schedule=schedule)
        out.backward(do)
        results.append([out.detach(), *(x.grad for x in leaves)])
    assert not q.is_contiguous() or not k.is_contiguous()
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.isfinite(b).all() and torch.equal(a, b), name
