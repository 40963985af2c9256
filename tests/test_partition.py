"""partition and CostModel on hand-made batches with known answers, and bad input."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

import dta_ref
from dta_fast.partition import (
    CostModel,
    Partition,
    TreeStats,
    dfs_contiguous_shards,
    lpt_shards,
    nnls_numpy,
    partition,
    split_pieces,
    tree_stats,
)
from dta_fast.sorted_batch import SortedBatch, token_arrays
from dta_ref import PrefixTree

TOKENS_ONLY = CostModel(token=1.0, pair=0.0)
METHODS = {"lpt", "dfs_contiguous", "token_greedy"}


def reference_stats(sequences) -> TreeStats:
    """Unique tokens = distinct prefixes; a prefix of length k is a token at depth k-1 with k attention pairs."""
    prefixes = {tuple(s[: k + 1]) for s in sequences for k in range(len(s))}
    return TreeStats(len(prefixes), sum(len(p) for p in prefixes), len(sequences))


def check_partition(part: Partition, sequences, world_size: int, model: CostModel) -> None:
    """Every invariant a Partition promises, recomputed without the module's own cost code."""
    sequences = [list(map(int, s)) for s in sequences]
    assert len(part.shards) == world_size
    assert sorted(i for shard in part.shards for i in shard) == list(range(len(sequences)))
    for r, shard in enumerate(part.shards):
        assert shard == sorted(shard), f"shard {r} is not sorted"
        own = [sequences[i] for i in shard]
        stats = reference_stats(own)
        assert part.unique_tokens[r] == stats.unique_tokens, f"shard {r}"
        assert part.flat_tokens[r] == sum(len(s) for s in own), f"shard {r}"
        assert part.costs[r] == pytest.approx(model.of_stats(stats), rel=1e-12, abs=1e-12), f"shard {r}"
        if own:
            assert part.compression[r] == pytest.approx(part.flat_tokens[r] / part.unique_tokens[r])
    assert set(part.candidates) == METHODS
    assert part.max_cost == pytest.approx(min(part.candidates.values()), rel=1e-12)
    assert part.candidates[part.method] == pytest.approx(part.max_cost, rel=1e-12)
    assert part.balance == pytest.approx(part.max_cost / (sum(part.costs) / world_size))
    whole = model.of_stats(reference_stats(sequences))
    singles = max(model.of_stats(reference_stats([s])) for s in sequences)
    assert part.lower_bound == pytest.approx(max(whole / world_size, singles), rel=1e-12)
    assert part.lower_bound <= part.max_cost * (1 + 1e-12)
    assert sorted(i for piece in part.pieces for i in piece) == list(range(len(sequences)))
    for piece, cost in zip(part.pieces, part.piece_costs):
        assert cost == pytest.approx(model.of_stats(reference_stats([sequences[i] for i in piece])), rel=1e-12)


def group_of(sequences, prompt_len):
    """Map each sequence to the index of its prompt among the distinct prompts."""
    prompts = {}
    return [prompts.setdefault(tuple(s[:prompt_len]), len(prompts)) for s in sequences]


# ------------------------------------------------------------------ named batches


@pytest.mark.parametrize("world_size", [2, 3, 4], ids=lambda w: f"W{w}")
def test_grpo_groups(world_size):
    sequences = dta_ref.grpo_batch(num_groups=6, prompt_len=64, num_responses=4, response_len=32, seed=1)
    model = CostModel()
    part = partition(sequences, world_size)
    check_partition(part, sequences, world_size, model)
    group = group_of(sequences, 64)
    assert len(part.pieces) == 6  # one per group: no group costs more than a rank's share
    groups_per_shard = [{group[i] for i in shard} for shard in part.shards]
    if 6 % world_size == 0:
        # whole groups, the same number on every rank: nothing duplicated, perfect balance
        assert all(len(g) == 6 // world_size for g in groups_per_shard)
        assert sum(len(g) for g in groups_per_shard) == 6
        assert part.balance == pytest.approx(1.0, abs=1e-12)
        assert part.max_cost == pytest.approx(part.lower_bound, rel=1e-12)
    else:
        # whole groups cannot balance 6 over 4; contiguous cuts through a group duplicate only its prompt
        one_group = model.cost(sequences[:4])
        prompt = model.cost([sequences[0][:64]])
        assert part.candidates["lpt"] <= 2 * one_group * (1 + 1e-12)
        assert part.max_cost < 2 * one_group
        assert part.max_cost <= part.lower_bound + prompt
    assert part.candidates["token_greedy"] > part.max_cost


def huge_tree_batch():
    """A 374-token tree (a 50-token chain, four child subtrees of two responses) and four 10-token trees."""
    rng = np.random.default_rng(3)

    def fresh(n):
        return rng.integers(100, 30000, size=n).tolist()

    prompt = [7] + fresh(49)
    huge = [list(prompt)]  # a sequence that ends on the shared chain
    child_of = [None]
    for child in range(4):
        branch = prompt + [10 + child] + fresh(20)  # 71 tokens, shared by the child's two responses
        for _ in range(2):
            huge.append(branch + fresh(30))
            child_of.append(child)
    small = [[50 + k] + fresh(9) for k in range(4)]
    return huge + small, child_of


def prefixes(sequences):
    return {tuple(s[: k + 1]) for s in sequences for k in range(len(s))}


def test_huge_tree_is_split_at_subtree_boundaries():
    sequences, child_of = huge_tree_batch()
    assert reference_stats(sequences).unique_tokens == 50 + 4 * (21 + 2 * 30) + 4 * 10 == 414
    part = partition(sequences, 4, TOKENS_ONLY, slack=1.0)
    check_partition(part, sequences, 4, TOKENS_ONLY)
    assert part.piece_target == pytest.approx(414 / 4)
    # the tree (374) and each child subtree (131) cost more than the share 103.5: every response is a piece,
    # the sequence that ends on the chain joins the first one, and the small trees stay whole
    pieces = sorted(part.pieces)
    assert pieces[-4:] == [[9], [10], [11], [12]]
    split = pieces[:-4]
    assert sorted(len(p) for p in split) == [1] * 7 + [2]
    assert [0, 1] in split or [0, 2] in split
    assert all(c <= part.piece_target for c in part.piece_costs)
    # only ancestors are duplicated: two pieces share exactly the chain above the node where they part
    for a in split:
        for b in split:
            if a < b:
                ca, cb = child_of[a[-1]], child_of[b[-1]]
                depth = 71 if ca == cb else 50
                assert prefixes(sequences[i] for i in a) & prefixes(sequences[i] for i in b) == prefixes(
                    [sequences[a[-1]][:depth]]
                )


def test_huge_tree_coarser_pieces_win():
    sequences, child_of = huge_tree_batch()
    part = partition(sequences, 4, TOKENS_ONLY)
    check_partition(part, sequences, 4, TOKENS_ONLY)
    # best: one child subtree (131 tokens) and one small tree (10) per rank; splitting the children
    # into single responses makes two of them share only the 50-token chain
    assert part.max_cost == pytest.approx(141)
    assert part.method == "lpt"
    fine = partition(sequences, 4, TOKENS_ONLY, slack=1.0)
    assert fine.candidates["lpt"] > 141
    children = [{child_of[i] for i in shard if i < 9 and child_of[i] is not None} for shard in part.shards]
    assert sorted(map(sorted, children)) == [[0], [1], [2], [3]]


def skewed_groups(seed, max_groups=4, max_prompt=30, max_responses=5, max_response=20):
    """GRPO-like groups of random sizes; the first token of a group is its index."""
    rng = np.random.default_rng(seed)
    sequences = []
    for g in range(int(rng.integers(1, max_groups))):
        prompt = [g] + rng.integers(100, 999, size=int(rng.integers(1, max_prompt))).tolist()
        for _ in range(int(rng.integers(1, max_responses))):
            sequences.append(prompt + rng.integers(100, 999, size=int(rng.integers(1, max_response))).tolist())
    return sequences


def least_loaded_lpt(sequences, pieces, world_size, model):
    """Classic LPT on the same pieces: always the least-loaded rank, blind to shared ancestors."""
    cost = lambda idx: model.of_stats(reference_stats([sequences[i] for i in idx])) if idx else 0.0
    shards = [[] for _ in range(world_size)]
    for piece in sorted(pieces, key=lambda p: -cost(p)):
        r = min(range(world_size), key=lambda r: cost(shards[r]))
        shards[r] += piece
    return max(cost(s) for s in shards)


def test_lpt_puts_pieces_of_one_tree_together_when_that_is_cheaper():
    # a group of two rollouts (37 tokens) and one of three (48 tokens) over two ranks: the second is above
    # the share (42.5) and split into its rollouts; the least-loaded rank would scatter them
    sequences = skewed_groups(6)
    assert [s[0] for s in sequences] == [0, 0, 1, 1, 1]
    assert [reference_stats(sequences[a:b]).unique_tokens for a, b in [(0, 2), (2, 5)]] == [37, 48]
    part = partition(sequences, 2, TOKENS_ONLY, slack=1.0)
    check_partition(part, sequences, 2, TOKENS_ONLY)
    assert sorted(part.pieces) == [[0, 1], [2], [3], [4]]
    assert part.candidates["lpt"] == 48 < least_loaded_lpt(sequences, part.pieces, 2, TOKENS_ONLY) == 64
    assert sorted(part.shards) == [[0, 1], [2, 3, 4]]


def test_split_goes_one_level_down_at_a_time():
    # the children 10 and 11 of the chain [7, 1, 2] branch again right below them
    rng = np.random.default_rng(4)
    sequences = [
        [7, 1, 2, child, grandchild] + rng.integers(100, 999, size=20).tolist()
        for child in (10, 11)
        for grandchild in (20, 21)
    ]
    sequences += [[50 + k] + rng.integers(100, 999, size=20).tolist() for k in range(3)]
    # tree 3 + 2 * (1 + 2 * 21) = 89 > share (89 + 63) / 3; each child's 46 fits, so no grandchild split
    part = partition(sequences, 3, TOKENS_ONLY, slack=1.0)
    check_partition(part, sequences, 3, TOKENS_ONLY)
    assert sorted(part.pieces) == [[0, 1], [2, 3], [4], [5], [6]]


def test_repeats_stay_together():
    # eight copies cost one tree: a single rank does it all as cheaply as any split (ties go to the smaller total)
    sequences = [[3, 1, 4, 1, 5]] * 8
    part = partition(sequences, 4)
    check_partition(part, sequences, 4, CostModel())
    assert part.method == "lpt"
    assert sorted(map(len, part.shards)) == [0, 0, 0, 8]
    assert part.max_cost == pytest.approx(part.lower_bound)
    assert part.balance == pytest.approx(4.0)


def reference_token_greedy(sequences, world_size, model):
    flat = [0] * world_size
    shards = [[] for _ in range(world_size)]
    for i in sorted(range(len(sequences)), key=lambda i: (-len(sequences[i]), i)):
        r = min(range(world_size), key=lambda r: (flat[r], r))
        flat[r] += len(sequences[i])
        shards[r].append(i)
    return max(model.of_stats(reference_stats([sequences[i] for i in s])) if s else 0.0 for s in shards)


@pytest.mark.parametrize("seed", range(4))
def test_token_greedy_is_longest_first_onto_fewest_tokens(seed):
    sequences = skewed_groups(seed, max_groups=6, max_responses=8)
    if seed == 0:
        sequences = [[0], [1], [2] * 10]  # in preorder the long one comes last
    for world_size in range(1, min(4, len(sequences)) + 1):
        part = partition(sequences, world_size, TOKENS_ONLY)
        expected = reference_token_greedy(sequences, world_size, TOKENS_ONLY)
        assert part.candidates["token_greedy"] == pytest.approx(expected, rel=1e-12)
    if seed == 0:
        assert partition(sequences, 2, TOKENS_ONLY).candidates["token_greedy"] == 10


def test_contiguous_split_uses_idle_ranks_evenly():
    # the long sequence alone sets the bound; the short tree fits in one run, and the idle rank takes half of it
    rng = np.random.default_rng(0)
    sequences = [[0] + rng.integers(100, 999, size=99).tolist()]
    sequences += [[5, 6] + rng.integers(100, 999, size=9).tolist() for _ in range(4)]
    batch = SortedBatch(token_arrays(sequences))
    runs = dfs_contiguous_shards(batch, TOKENS_ONLY, 3)
    assert [r.tolist() for r in runs] == [[0], [1, 2], [3, 4]]  # preorder positions
    part = partition(sequences, 3, TOKENS_ONLY)
    check_partition(part, sequences, 3, TOKENS_ONLY)
    assert part.max_cost == part.lower_bound == 100


def test_forest_of_equal_trees_balances_perfectly():
    rng = np.random.default_rng(5)
    shape = [(0, 12), (0, 12), (1, 5), (3, 9)]  # (branch depth below the root, tokens after it)
    sequences = []
    for root in range(8):
        stem = [root] + rng.integers(100, 30000, size=6).tolist()
        for depth, extra in shape:
            sequences.append(
                stem[: 1 + depth] + [root * 100 + len(sequences)] + rng.integers(100, 30000, size=extra).tolist()
            )
    for world_size in (1, 2, 4, 8):
        part = partition(sequences, world_size)
        check_partition(part, sequences, world_size, CostModel())
        assert part.method == "lpt"
        assert part.balance == pytest.approx(1.0, abs=1e-12)
        assert part.max_cost == pytest.approx(part.lower_bound, rel=1e-12)
        roots = [{sequences[i][0] for i in shard} for shard in part.shards]
        assert all(len(r) == 8 // world_size for r in roots)


def test_world_size_one():
    sequences = dta_ref.agentic_batch(
        system_len=40, num_tasks=3, task_len=10, rollouts_per_task=2, turns=3, assistant_len=6, tool_len=8
    )
    part = partition(sequences, 1)
    tree = PrefixTree.from_sequences(sequences)
    check_partition(part, sequences, 1, CostModel())
    assert part.shards == [list(range(len(sequences)))]
    assert part.unique_tokens == [tree.num_tokens]
    assert part.compression[0] == pytest.approx(tree.compression_ratio)
    assert part.costs[0] == pytest.approx(CostModel().cost(tree))
    assert part.balance == 1.0
    assert part.max_cost == pytest.approx(part.lower_bound)
    assert len(part.pieces) == 1  # nothing exceeds the whole batch


def test_chains_are_never_split():
    # one rollout of five turns: each sample a prefix of the next; splitting would duplicate nearly everything
    sequences = dta_ref.agentic_batch(
        system_len=20, num_tasks=1, task_len=5, rollouts_per_task=1, turns=5, assistant_len=4, tool_len=6
    )
    part = partition(sequences, 2, TOKENS_ONLY)
    check_partition(part, sequences, 2, TOKENS_ONLY)
    assert part.pieces == [list(range(5))]
    assert part.candidates["lpt"] == pytest.approx(len(sequences[-1]))


def test_more_ranks_than_sequences():
    with pytest.raises(ValueError, match=r"world_size=4 is more ranks than sequences \(3\)"):
        partition([[1, 2], [1, 3], [2]], 4)


def test_tensor_and_array_inputs_match_lists():
    sequences = dta_ref.grpo_batch(num_groups=3, prompt_len=10, num_responses=3, response_len=5, seed=2)
    expected = partition(sequences, 2)
    for batch in (
        [torch.tensor(s) for s in sequences],
        [np.array(s, dtype=np.int32) for s in sequences],
        torch.tensor(sequences),
        [tuple(s) for s in sequences],
    ):
        got = partition(batch, 2)
        assert got.shards == expected.shards
        assert got.costs == expected.costs


def test_skewed_batches_lpt_beats_token_greedy():
    wins = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        sequences = []
        for g in range(int(rng.integers(3, 7))):
            prompt = [g] + rng.integers(100, 30000, size=int(rng.integers(20, 400))).tolist()
            for _ in range(int(rng.integers(1, 12))):
                sequences.append(prompt + rng.integers(100, 30000, size=int(rng.integers(5, 200))).tolist())
        for world_size in (2, 3, 4):
            part = partition(sequences, world_size)
            check_partition(part, sequences, world_size, CostModel())
            assert part.candidates["lpt"] <= part.candidates["token_greedy"] * (1 + 1e-12)
            wins += part.candidates["lpt"] < part.candidates["token_greedy"]
    assert wins >= 12  # scattering a group's rollouts duplicates its prompt


def test_candidates_are_populated():
    sequences = dta_ref.agentic_batch(
        system_len=100, num_tasks=5, task_len=20, rollouts_per_task=3, turns=3, assistant_len=10, tool_len=15
    )
    part = partition(sequences, 3)
    check_partition(part, sequences, 3, CostModel())
    assert set(part.candidates) == METHODS
    for method, cost in part.candidates.items():
        assert math.isfinite(cost) and cost >= part.lower_bound * (1 - 1e-12), method
    assert part.method in METHODS
    assert "balance=" in repr(part) and "lpt" in repr(part)


def test_forced_method_returns_that_candidate():
    sequences = dta_ref.agentic_batch(40, 3, 5, 3, 6, 8, 4, vocab_size=50, seed=2)
    sequences += dta_ref.grpo_batch(2, 30, 4, 9, vocab_size=50, seed=3)
    best = partition(sequences, 3)
    for method in METHODS:
        forced = partition(sequences, 3, method=method)
        assert forced.method == method
        assert forced.candidates == best.candidates
        assert max(forced.costs) == pytest.approx(best.candidates[method])
        assert sorted(i for shard in forced.shards for i in shard) == list(range(len(sequences)))
    assert best.shards == partition(sequences, 3, method=best.method).shards


def test_medium_batch():
    sequences = dta_ref.agentic_batch(num_tasks=8, rollouts_per_task=8, turns=8)  # 512 samples, ~250K unique tokens
    part = partition(sequences, 8)
    assert sorted(i for s in part.shards for i in s) == list(range(512))
    assert sum(part.flat_tokens) == sum(len(s) for s in sequences)


@pytest.mark.large
def test_large_batch():
    sequences = dta_ref.agentic_batch(num_tasks=16, rollouts_per_task=16, turns=8)  # 2048 samples, ~850K unique
    part = partition(sequences, 64)
    tree = PrefixTree.from_sequences(sequences)
    assert part.lower_bound >= CostModel().cost(tree) / 64 * (1 - 1e-12)


# ------------------------------------------------------------------ cost model


def test_default_cost_model_is_the_documented_model():
    assert CostModel() == CostModel.for_model(1.5e9, 28, 16, 128)
    assert CostModel().pair == pytest.approx(12 * 128 * 16 * 28 / (6 * 1.5e9))
    assert CostModel().token == 1.0 and CostModel().sequence == 0.0 and CostModel().constant == 0.0


def test_tree_stats_match_prefix_tree():
    sequences = [[1, 2, 3], [1, 2, 4, 5], [1, 2], [6], [1, 2, 3]]
    tree = PrefixTree.from_sequences(sequences)
    expected = TreeStats(tree.num_tokens, int((tree.position_ids + 1).sum()), 5)
    # tokens 1,2,3 | 4,5 | 6 at depths 0,1,2 | 2,3 | 0
    assert expected == TreeStats(6, 1 + 2 + 3 + 3 + 4 + 1, 5)
    assert tree_stats(sequences) == expected == tree_stats(tree) == reference_stats(sequences)
    assert CostModel(token=2.0, pair=0.5, sequence=3.0, constant=7.0).cost(sequences) == pytest.approx(
        2.0 * expected.unique_tokens + 0.5 * expected.attention_pairs + 3.0 * 5 + 7.0
    )


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 65])
def test_sorted_batch_answers_by_brute_force(n):
    """SortedBatch's order, common prefixes of any two positions and first later position with lcp at most
    a limit, against sorting and comparing the sequences directly (sizes around powers of two)."""
    rng = np.random.default_rng(n)
    sequences = [rng.integers(0, 3, size=int(rng.integers(1, 6))).tolist() for _ in range(n)]
    batch = SortedBatch(token_arrays(sequences))
    ordered = sorted(sequences)
    assert [sequences[i] for i in batch.order] == ordered

    def common(a, b):
        return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    for p in range(n):
        for r in range(p + 1, n):
            assert batch.common(p, r) == common(ordered[p], ordered[r])
    after = np.repeat(np.arange(n), 6)
    limit = np.tile(np.arange(6), n)
    expected = [next((q for q in range(a + 1, n) if batch.lcp[q] <= t), n) for a, t in zip(after, limit)]
    assert batch.first_later_at_most(after, limit).tolist() == expected


def test_lpt_counts_a_shards_constant_once():
    """With a per-shard constant, a rank that takes a second tree pays the constant once: four separate
    trees of 2, 3, 4 and 5 tokens on two ranks cost (4 + 3) + 5 and (5 + 2) + 5 as LPT tracks them."""
    sequences = [[1, 2], [3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13, 14]]
    model = CostModel(token=1.0, pair=0.0, sequence=0.0, constant=5.0)
    batch = SortedBatch(token_arrays(sequences))
    pieces = split_pieces(batch, model, 1.0)  # one piece per tree
    piece_costs = [model.cost([sequences[i] for i in batch.order[a : b + 1]]) for a, b in pieces]
    shards, loads = lpt_shards(batch, model, pieces, piece_costs, 2)
    exact = [model.cost([sequences[i] for i in batch.order[positions]]) for positions in shards]
    assert sorted(exact) == [12.0, 12.0] and loads == pytest.approx(exact)


def test_stats_given_by_hand_are_checked():
    """TreeStats passed to cost or fit are counts: negative, fractional or non-numeric ones are named."""
    assert CostModel().cost(TreeStats(np.int64(5), 3, 1)) == CostModel().cost(TreeStats(5, 3, 1))
    for stats, exc, match in (
        (TreeStats(-100, 0, 1), ValueError, "unique_tokens must be non-negative, got -100"),
        (TreeStats(5, float("nan"), 1), TypeError, "attention_pairs must be an int, got float"),
        (TreeStats(5, 3, "1"), TypeError, "num_sequences must be an int, got str"),
        (TreeStats(5, 3, True), TypeError, "num_sequences must be an int, got bool"),
    ):
        with pytest.raises(exc, match=match):
            CostModel().cost(stats)
        with pytest.raises(exc, match=f"sample 1: TreeStats.{match}"):
            CostModel.fit([([[1, 2]], 1.0), (stats, 2.0)])


def synthetic_samples(true: CostModel, seed: int, noise: float = 0.0):
    rng = np.random.default_rng(seed)
    samples = []
    for k in range(14):
        if k % 2:
            batch = dta_ref.grpo_batch(
                num_groups=int(rng.integers(1, 4)),
                prompt_len=int(rng.integers(8, 200)),
                num_responses=int(rng.integers(1, 9)),
                response_len=int(rng.integers(4, 300)),
                seed=k,
            )
        else:
            batch = TreeStats(
                int(rng.integers(1_000, 50_000)), int(rng.integers(10**6, 10**9)), int(rng.integers(1, 64))
            )
        seconds = true.cost(batch) * (1 + noise * rng.standard_normal())
        samples.append((batch, max(seconds, 0.0)))
    return samples


@pytest.fixture(params=["scipy", "numpy"])
def solver(request, monkeypatch):
    if request.param == "scipy":
        pytest.importorskip("scipy.optimize")
    else:
        monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # import fails: the numpy solver runs
    return request.param


def test_fit_recovers_known_coefficients(solver):
    true = CostModel(token=2e-6, pair=3e-11, sequence=5e-5, constant=1e-3)
    fitted = CostModel.fit(synthetic_samples(true, seed=0))
    for name in ("token", "pair", "sequence", "constant"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    # a zero coefficient is found as zero, not as a small negative one
    true = CostModel(token=2e-6, pair=3e-11, sequence=0.0, constant=1e-3)
    fitted = CostModel.fit(synthetic_samples(true, seed=1))
    assert fitted.sequence == pytest.approx(0.0, abs=1e-9)
    assert fitted.token == pytest.approx(2e-6, rel=1e-6)


def kkt_violation(A, y, x):
    """Largest breach of the NNLS optimality conditions: x >= 0, gradient >= 0, gradient = 0 where x > 0."""
    g = A.T @ (A @ x - y)
    scale = np.abs(A.T @ y).max()
    return max(-x.min(), -g.min() / scale, np.abs(g[x > 0]).max(initial=0.0) / scale)


def test_fit_is_the_nonnegative_optimum_when_the_data_disagree(solver):
    # times fall with the sequence count: the unconstrained fit is negative there, NNLS clamps it
    true = CostModel(token=2e-6, pair=3e-11, sequence=0.0, constant=1e-3)
    samples = []
    for batch, seconds in synthetic_samples(true, seed=2, noise=0.02):
        samples.append((batch, max(seconds - 2e-4 * tree_stats(batch).num_sequences, 0.0)))
    A = np.array(
        [[s.unique_tokens, s.attention_pairs, s.num_sequences, 1.0] for s in map(tree_stats, (b for b, _ in samples))]
    )
    y = np.array([t for _, t in samples])
    free = np.linalg.lstsq(A / np.abs(A).max(0), y, rcond=None)[0]
    assert free[2] < 0  # the constraint matters in this data
    fitted = CostModel.fit(samples)
    x = np.array([fitted.token, fitted.pair, fitted.sequence, fitted.constant])
    scale = np.abs(A).max(0)
    assert kkt_violation(A / scale, y, x * scale) < 1e-8
    assert fitted.sequence == 0.0


def test_numpy_nnls_matches_scipy():
    optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(0)
    for _ in range(20):
        A = rng.standard_normal((12, 4))
        y = rng.standard_normal(12)
        np.testing.assert_allclose(nnls_numpy(A, y), optimize.nnls(A, y)[0], atol=1e-10)
        assert kkt_violation(A, y, nnls_numpy(A, y)) < 1e-10


# ------------------------------------------------------------------ bad input


def case(name, fn, exc, match):
    return pytest.param(fn, exc, match, id=name)


BAD = [
    case("world-size-zero", lambda: partition([[1]], 0), ValueError, "world_size must be >= 1, got 0"),
    case("world-size-negative", lambda: partition([[1]], -2), ValueError, "world_size must be >= 1"),
    case("world-size-float", lambda: partition([[1], [2]], 2.0), TypeError, "world_size must be an int, got float"),
    case("world-size-bool", lambda: partition([[1]], True), TypeError, "world_size must be an int, got bool"),
    case("world-size-str", lambda: partition([[1]], "1"), TypeError, "world_size must be an int, got str"),
    case("empty-batch", lambda: partition([], 1), ValueError, "empty batch"),
    case("none-batch", lambda: partition(None, 1), TypeError, "must be a list of token sequences"),
    case("flat-tensor-batch", lambda: partition(torch.tensor([1, 2]), 1), TypeError, "list of token sequences"),
    case("empty-sequence", lambda: partition([[1, 2], []], 1), ValueError, "sequence 1 is empty"),
    case("negative-token", lambda: partition([[1, 2], [3, -1]], 1), ValueError, "non-negative, got -1"),
    case("negative-tensor", lambda: partition([torch.tensor([4, -7])], 1), ValueError, "non-negative, got -7"),
    case("float-tokens", lambda: partition([[1, 2], [1.0, 2.0]], 1), TypeError, "sequence 1: tokens must be ints"),
    case("bool-among-ints", lambda: partition([[1, True]], 1), TypeError, "tokens must be ints, got True"),
    case("float-tensor", lambda: partition([torch.ones(3)], 1), TypeError, "must be integers"),
    case("string-sequence", lambda: partition(["abc"], 1), TypeError, "sequence 0: expected a list"),
    case("nested-sequence", lambda: partition([[[1, 2]]], 1), TypeError, "tokens must be ints"),
    case("cost-model-type", lambda: partition([[1]], 1, cost_model={"token": 1}), TypeError, "cost_model must be"),
    case("slack-zero", lambda: partition([[1]], 1, slack=0.0), ValueError, "slack must be finite and positive"),
    case("cost-negative", lambda: CostModel(token=-1.0), ValueError, "CostModel.token must be finite and non-negative"),
    case("cost-nan", lambda: CostModel(pair=float("nan")), ValueError, "CostModel.pair must be finite"),
    case("cost-all-zero", lambda: CostModel(token=0, pair=0), ValueError, "at least one positive"),
    case("cost-str", lambda: CostModel(sequence="1"), TypeError, "CostModel.sequence must be a number"),
    case(
        "for-model-zero-layers",
        lambda: CostModel.for_model(1e9, 0, 16, 128),
        ValueError,
        "num_layers must be finite and positive",
    ),
    case(
        "cost-overflow",
        lambda: partition([[1, 2], [3]], 2, CostModel(token=1e308)),
        ValueError,
        "prices this batch at inf",
    ),
    case(
        "cost-underflow",
        lambda: partition([[1]] * 4, 4, CostModel(token=0, pair=0, constant=5e-324)),
        ValueError,
        "too large or too small to partition over 4 ranks",
    ),
    case("method-unknown", lambda: partition([[1]], 1, method="greedy"), ValueError, "method must be 'best'"),
    case("fit-no-samples", lambda: CostModel.fit([]), ValueError, "at least one"),
    case("fit-negative-time", lambda: CostModel.fit([([[1, 2]], -1.0)]), ValueError, "sample 0: seconds must be"),
    case("fit-not-a-pair", lambda: CostModel.fit([[[1, 2]]]), TypeError, "sample 0: expected a"),
    case("fit-all-zero-times", lambda: CostModel.fit([([[1, 2]], 0.0)]), ValueError, "all zeros"),
]


@pytest.mark.parametrize("fn,exc,match", BAD)
def test_bad_input(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()
