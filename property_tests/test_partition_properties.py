"""partition on generated batches: an exact cover, exact shard reports, and the bounds LPT guarantees.

Costs are recomputed here from distinct prefixes (a prefix of length k is one
unique token with k attention pairs) or from dta_ref.PrefixTree, never with
the partition module's own arithmetic.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import dta_ref
from dta_fast.partition import CostModel, Partition, lpt_shards, partition, split_pieces
from dta_fast.sorted_batch import SortedBatch, token_arrays
from dta_ref import PrefixTree
from property_tests.strategies import random_trie_rollouts, rollout_sets

# partition is cheap next to the model-running properties: run twice the profile's examples.
cheap = settings(max_examples=2 * settings.default.max_examples)
REL = 1e-9


def prefixes(sequences) -> set[tuple[int, ...]]:
    return {tuple(s[: k + 1]) for s in sequences for k in range(len(s))}


def reference_cost(model: CostModel, sequences) -> float:
    if not sequences:
        return 0.0
    p = prefixes(sequences)
    return model.token * len(p) + model.pair * sum(map(len, p)) + model.sequence * len(sequences) + model.constant


def tree_cost(model: CostModel, tree: PrefixTree) -> float:
    pairs = int((tree.subtree_end - torch.arange(tree.num_tokens)).sum())
    return model.token * tree.num_tokens + model.pair * pairs + model.sequence * tree.num_sequences + model.constant


def leq(a: float, b: float) -> bool:
    return a <= b + REL * max(abs(a), abs(b), 1.0)


@st.composite
def cost_models(draw):
    def coef(high):
        return draw(st.one_of(st.just(0.0), st.floats(0.0, high, allow_subnormal=False)))

    token, pair, sequence, constant = coef(4.0), coef(1.0), coef(10.0), coef(10.0)
    if token == pair == sequence == constant == 0.0:
        token = 1.0
    return draw(st.sampled_from([CostModel(), CostModel(token, pair, sequence, constant)]))


@st.composite
def cases(draw, sets=None):
    sequences = draw(rollout_sets() if sets is None else sets)
    world_size = draw(st.integers(1, len(sequences)))
    return sequences, world_size, draw(cost_models())


@st.composite
def small_forests(draw):
    """Two to ten small trees with distinct first tokens, each a random trie below its root."""
    roots = draw(st.lists(st.integers(0, 63), min_size=2, max_size=10, unique=True))
    sequences = []
    for r in roots:
        below = draw(random_trie_rollouts(max_sequences=3, max_len=5, max_nodes=8))
        sequences += [[r] + s for s in below]
    sequences = draw(st.permutations(sequences))
    world_size = draw(st.integers(1, min(4, len(sequences))))
    return list(sequences), world_size, draw(cost_models())


def check_lpt_bound(part: Partition) -> None:
    W = part.world_size
    bound = sum(part.piece_costs) / W + max(part.piece_costs)
    assert leq(part.candidates["lpt"], bound), (part.candidates["lpt"], bound)


@cheap
@given(cases())
def test_every_sequence_on_exactly_one_rank(case):
    sequences, world_size, model = case
    part = partition(sequences, world_size, model)
    assert len(part.shards) == len(part.costs) == len(part.unique_tokens) == world_size
    assert sorted(i for shard in part.shards for i in shard) == list(range(len(sequences)))
    assert all(shard == sorted(shard) for shard in part.shards)
    assert sorted(i for piece in part.pieces for i in piece) == list(range(len(sequences)))


@cheap
@given(cases())
def test_shard_reports_match_their_prefix_trees(case):
    sequences, world_size, model = case
    part = partition(sequences, world_size, model)
    for r, shard in enumerate(part.shards):
        own = [sequences[i] for i in shard]
        if not own:
            assert (part.costs[r], part.unique_tokens[r], part.flat_tokens[r]) == (0.0, 0, 0)
            continue
        tree = dta_ref.PrefixTree.from_sequences(own)
        assert [tree.sequence(k).tolist() for k in range(len(own))] == own
        assert part.unique_tokens[r] == tree.num_tokens
        assert part.flat_tokens[r] == tree.flat_tokens
        assert abs(part.costs[r] - tree_cost(model, tree)) <= REL * part.costs[r]
        assert abs(part.compression[r] - tree.compression_ratio) <= 1e-12
    assert part.max_cost == max(part.costs) == min(part.candidates.values())
    assert abs(part.balance - max(part.costs) * world_size / sum(part.costs)) <= 1e-12


@cheap
@given(cases(sets=rollout_sets(max_sequences=6)))
def test_lower_bound_holds_and_no_assignment_beats_the_optimum(case):
    sequences, world_size, model = case
    world_size = min(world_size, 3)
    part = partition(sequences, world_size, model)
    whole = reference_cost(model, sequences) / world_size
    single = max(reference_cost(model, [s]) for s in sequences)
    assert abs(part.lower_bound - max(whole, single)) <= REL * part.lower_bound
    best = min(
        max(reference_cost(model, [s for s, o in zip(sequences, owner) if o == r]) for r in range(world_size))
        for owner in itertools.product(range(world_size), repeat=len(sequences))
    )
    assert leq(part.lower_bound, best)
    assert leq(best, part.max_cost)


@cheap
@given(cases())
def test_pieces_are_subtrees_and_lpt_bound_holds(case):
    sequences, world_size, model = case
    part = partition(sequences, world_size, model)
    check_lpt_bound(part)
    preorder = sorted(range(len(sequences)), key=lambda i: (sequences[i], i))
    rank = {i: k for k, i in enumerate(preorder)}
    for piece, cost in zip(part.pieces, part.piece_costs):
        own = [sequences[i] for i in piece]
        assert abs(cost - reference_cost(model, own)) <= REL * cost
        positions = sorted(rank[i] for i in piece)
        assert positions == list(range(positions[0], positions[0] + len(piece))), "a piece is a preorder run"
        if cost > part.piece_target * (1 + REL):
            longest = max(own, key=len)
            assert all(longest[: len(s)] == s for s in own), "only a chain may stay above the target"
        assert len({s[0] for s in own}) == 1, "a piece lies inside one tree"


@cheap
@given(small_forests())
def test_small_forests_stay_close_to_the_lower_bound(case):
    sequences, world_size, model = case
    part = partition(sequences, world_size, model)
    check_lpt_bound(part)
    num_trees = len({s[0] for s in sequences})
    if len(part.pieces) != num_trees:
        event("a tree was split")
        return
    event("whole trees")
    # whole trees share nothing: the pieces' costs add up to the batch's, one constant per extra piece
    n = len(part.pieces)
    assert abs(sum(part.piece_costs) - reference_cost(model, sequences) - (n - 1) * model.constant) <= REL * (
        sum(part.piece_costs)
    )
    slack = max(part.piece_costs) + (n - 1) * model.constant / world_size
    assert leq(part.max_cost, part.lower_bound + slack)
    if n <= 7 and world_size <= 3:
        groups = [[sequences[i] for i in piece] for piece in part.pieces]
        best = min(
            max(
                reference_cost(model, [s for g, o in zip(groups, owner) if o == r for s in g])
                for r in range(world_size)
            )
            for owner in itertools.product(range(world_size), repeat=n)
        )
        assert leq(part.candidates["lpt"], (4 / 3 - 1 / (3 * world_size)) * best)


@cheap
@given(
    world_size=st.integers(1, 4),
    per_rank=st.integers(1, 3),
    prompt_len=st.integers(1, 20),
    num_responses=st.integers(1, 4),
    response_len=st.integers(1, 10),
    seed=st.integers(0, 2**16),
)
def test_equal_grpo_groups_balance_perfectly(world_size, per_rank, prompt_len, num_responses, response_len, seed):
    num_groups = world_size * per_rank
    sequences = dta_ref.grpo_batch(num_groups, prompt_len, num_responses, response_len, seed=seed)
    groups = [sequences[g * num_responses : (g + 1) * num_responses] for g in range(num_groups)]
    # random tokens may collide and make groups differ; keep the batches whose groups have equal trees
    assume(all(len(prefixes(g)) == prompt_len + num_responses * response_len for g in groups))
    assume(len({g[0][0] for g in groups}) == num_groups)
    model = CostModel()
    part = partition(sequences, world_size, model)
    assert abs(part.max_cost - part.lower_bound) <= REL * part.lower_bound
    assert abs(part.balance - 1.0) <= REL


@cheap
@given(
    world_size=st.integers(1, 4),
    num_tasks=st.integers(1, 4),
    rollouts=st.integers(1, 3),
    turns=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    model=cost_models(),
)
def test_agentic_batches(world_size, num_tasks, rollouts, turns, seed, model):
    sequences = dta_ref.agentic_batch(
        system_len=30,
        num_tasks=num_tasks,
        task_len=5,
        rollouts_per_task=rollouts,
        turns=turns,
        assistant_len=4,
        tool_len=6,
        seed=seed,
    )
    assume(world_size <= len(sequences))
    part = partition(sequences, world_size, model)
    assert sorted(i for shard in part.shards for i in shard) == list(range(len(sequences)))
    for r, shard in enumerate(part.shards):
        assert abs(part.costs[r] - reference_cost(model, [sequences[i] for i in shard])) <= REL * max(part.costs[r], 1)
    check_lpt_bound(part)
    assert leq(part.lower_bound, part.max_cost)
    assert part.max_cost <= part.candidates["token_greedy"]


@cheap
@given(cases(), st.sampled_from([0.25, 0.5, 1.0]))
def test_lpt_tracks_the_true_shard_costs(case, slack):
    sequences, world_size, model = case
    batch = SortedBatch(token_arrays(sequences))
    total = reference_cost(model, sequences)
    pieces = split_pieces(batch, model, slack * total / world_size)
    piece_costs = [reference_cost(model, [sequences[i] for i in batch.order[a : b + 1]]) for a, b in pieces]
    shards, loads = lpt_shards(batch, model, pieces, piece_costs, world_size)
    for positions, load in zip(shards, loads):
        exact = reference_cost(model, [sequences[i] for i in batch.order[positions]])
        assert abs(load - exact) <= REL * max(exact, 1.0), (load, exact)
