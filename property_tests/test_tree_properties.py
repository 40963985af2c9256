"""Structural invariants of PrefixTree on generated rollout sets."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dta_fast
import dta_ref
from dta_ref import PrefixTree
from property_tests.strategies import rollout_sets
from tests.helpers import brute_force_tree_mask

# Tree checks are cheap (no model): run several times the profile's examples.
cheap = settings(max_examples=4 * settings.default.max_examples)


def distinct_prefixes(sequences) -> set[tuple[int, ...]]:
    return {tuple(s[: t + 1]) for s in sequences for t in range(len(s))}


@cheap
@given(
    bounds=st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 5)).flatmap(
        lambda b: st.tuples(st.just(b), rollout_sets(*b))
    )
)
def test_strategy_respects_bounds(bounds):
    (max_sequences, max_len, vocab_size), sequences = bounds
    assert 1 <= len(sequences) <= max_sequences
    for s in sequences:
        assert 1 <= len(s) <= max_len
        assert all(isinstance(t, int) and 0 <= t < vocab_size for t in s)


@cheap
@given(rollout_sets())
def test_tensors_are_long_and_shaped(sequences):
    tree = PrefixTree.from_sequences(sequences)
    T, N, L = tree.num_tokens, len(sequences), max(len(s) for s in sequences)
    for name, shape in [
        ("tokens", (T,)),
        ("position_ids", (T,)),
        ("parent", (T,)),
        ("subtree_end", (T,)),
        ("seq_index", (N, L)),
        ("lengths", (N,)),
    ]:
        x = getattr(tree, name)
        assert x.dtype == torch.long, name
        assert tuple(x.shape) == shape, name
    assert tree.num_sequences == N
    assert tree.max_length == L


@cheap
@given(rollout_sets())
def test_preorder_parent_precedes_child(sequences):
    tree = PrefixTree.from_sequences(sequences)
    parent = tree.parent.tolist()
    for i, p in enumerate(parent):
        assert -1 <= p < i, f"parent[{i}] = {p}"
    assert parent[0] == -1, "the first packed token must be a root"


@cheap
@given(rollout_sets())
def test_depth_is_parent_depth_plus_one(sequences):
    tree = PrefixTree.from_sequences(sequences)
    depth, parent = tree.position_ids.tolist(), tree.parent.tolist()
    for i, p in enumerate(parent):
        expected = 0 if p == -1 else depth[p] + 1
        assert depth[i] == expected, f"position_ids[{i}] = {depth[i]}, parent {p}"


@cheap
@given(rollout_sets())
def test_subtree_end_from_parent_array(sequences):
    tree = PrefixTree.from_sequences(sequences)
    parent, end = tree.parent.tolist(), tree.subtree_end.tolist()
    T = len(parent)
    descendants: list[set[int]] = [set() for _ in range(T)]
    for i in range(T):
        a = parent[i]
        while a != -1:
            descendants[a].add(i)
            a = parent[a]
    for j in range(T):
        # the subtree of j is contiguous in preorder: exactly j+1 .. subtree_end[j]-1
        assert descendants[j] == set(range(j + 1, end[j])), f"subtree of {j}: end {end[j]}"


@cheap
@given(rollout_sets())
def test_seq_index_rebuilds_every_sequence(sequences):
    tree = PrefixTree.from_sequences(sequences)
    assert tree.lengths.tolist() == [len(s) for s in sequences]
    parent = tree.parent
    for s, seq in enumerate(sequences):
        assert tree.sequence(s).tolist() == seq
        row = tree.seq_index[s]
        assert (row[len(seq) :] == -1).all(), "padding past the end must be -1"
        assert int(parent[row[0]]) == -1, "a sequence starts at a root"
        for t in range(1, len(seq)):
            assert int(parent[row[t]]) == int(row[t - 1]), f"sequence {s} step {t} is not a path"


@cheap
@given(rollout_sets())
def test_children_of_a_node_have_distinct_tokens(sequences):
    tree = PrefixTree.from_sequences(sequences)
    pairs = list(zip(tree.parent.tolist(), tree.tokens.tolist(), strict=True))
    assert len(set(pairs)) == len(pairs), "two siblings share a token: not a trie"


@cheap
@given(rollout_sets())
def test_token_counts_and_compression(sequences):
    tree = PrefixTree.from_sequences(sequences)
    assert tree.num_tokens == len(distinct_prefixes(sequences))
    flat = sum(len(s) for s in sequences)
    assert tree.flat_tokens == flat
    assert tree.compression_ratio == flat / tree.num_tokens
    assert tree.compression_ratio >= 1.0


@cheap
@given(rollout_sets())
def test_logprob_mask_marks_next_token_steps(sequences):
    tree = PrefixTree.from_sequences(sequences)
    mask = tree.logprob_mask
    L = max(len(s) for s in sequences)
    assert mask.dtype == torch.bool and tuple(mask.shape) == (len(sequences), L - 1)
    for s, seq in enumerate(sequences):
        assert mask[s].tolist() == [t < len(seq) - 1 for t in range(L - 1)]


@cheap
@given(rollout_sets())
def test_packing_is_lexicographic_preorder(sequences):
    """Children are visited in increasing token order, so packed order = sorted distinct prefixes."""
    tree = PrefixTree.from_sequences(sequences)
    order = sorted(distinct_prefixes(sequences))
    slot = {p: i for i, p in enumerate(order)}
    assert tree.tokens.tolist() == [p[-1] for p in order]
    assert tree.position_ids.tolist() == [len(p) - 1 for p in order]
    assert tree.parent.tolist() == [slot[p[:-1]] if len(p) > 1 else -1 for p in order]
    expected_end = []
    for i, p in enumerate(order):
        k = i + 1
        while k < len(order) and order[k][: len(p)] == p:
            k += 1
        expected_end.append(k)
    assert tree.subtree_end.tolist() == expected_end
    for s, seq in enumerate(sequences):
        assert tree.seq_index[s, : len(seq)].tolist() == [slot[tuple(seq[: t + 1])] for t in range(len(seq))]


@cheap
@given(rollout_sets())
def test_mask_is_the_prefix_relation(sequences):
    tree = PrefixTree.from_sequences(sequences)
    mask = dta_ref.tree_attention_mask(tree)
    expected = brute_force_tree_mask(tree, sequences)
    assert mask.dtype == torch.bool
    bad = (mask != expected).nonzero()
    assert bad.numel() == 0, f"mask differs from the prefix relation at (query, key) {bad[:5].tolist()}"


@cheap
@given(rollout_sets(), st.data())
def test_mask_rows_for_a_query_subset(sequences, data):
    tree = PrefixTree.from_sequences(sequences)
    full = dta_ref.tree_attention_mask(tree)
    rows = data.draw(st.lists(st.integers(0, tree.num_tokens - 1), min_size=1, max_size=tree.num_tokens))
    rows_t = torch.tensor(rows, dtype=torch.long)
    assert torch.equal(dta_ref.mask_from_subtree_end(tree.subtree_end, rows_t), full[rows_t])


@cheap
@given(rollout_sets(), st.randoms(use_true_random=False))
def test_input_order_does_not_change_the_packing(sequences, rnd):
    perm = list(range(len(sequences)))
    rnd.shuffle(perm)
    a = PrefixTree.from_sequences(sequences)
    b = PrefixTree.from_sequences([sequences[i] for i in perm])
    for name in ("tokens", "position_ids", "parent", "subtree_end"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.seq_index[perm], b.seq_index)
    assert torch.equal(a.lengths[perm], b.lengths)


@cheap
@given(rollout_sets())
def test_tensor_and_numpy_inputs_give_the_same_tree(sequences):
    ref = PrefixTree.from_sequences(sequences)
    variants = {
        "int64 tensors": [torch.tensor(s, dtype=torch.long) for s in sequences],
        "int32 tensors": [torch.tensor(s, dtype=torch.int32) for s in sequences],
        "numpy int64": [np.array(s, dtype=np.int64) for s in sequences],
        "numpy uint16": [np.array(s, dtype=np.uint16) for s in sequences],
        "tuples": [tuple(s) for s in sequences],
    }
    for label, seqs in variants.items():
        tree = PrefixTree.from_sequences(seqs)
        for name in ref.__dataclass_fields__:
            assert torch.equal(getattr(tree, name), getattr(ref, name)), f"{label}: {name}"


@cheap
@given(
    st.sampled_from([64, 300, 2**33]).flatmap(lambda vocab: rollout_sets(vocab_size=vocab)),
    st.sampled_from(["list", "tensor", "numpy", "int32 tensor"]),
)
def test_fast_builder_packs_exactly_as_the_reference(sequences, kind):
    """dta_fast.build_tree gives the reference's tensors, bit for bit, from any input kind (ids past one
    byte and past 32 bits too: its sort compares the ids' bytes)."""
    if kind == "int32 tensor" and max(map(max, sequences)) >= 2**31:
        kind = "tensor"
    convert = {
        "list": list,
        "tensor": torch.tensor,
        "numpy": np.array,
        "int32 tensor": lambda s: torch.tensor(s, dtype=torch.int32),
    }[kind]
    expected = PrefixTree.from_sequences(sequences)
    built = dta_fast.build_tree([convert(s) for s in sequences])
    for name in expected.__dataclass_fields__:
        a, b = getattr(expected, name), getattr(built, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


@cheap
@given(rollout_sets(), st.data())
def test_response_mask_is_each_rollouts_own(sequences, data):
    """response_mask: rollout i's step t (scoring token t+1) is trained on exactly when token t+1 is past
    its prompt, whatever the sharing with other rollouts."""
    tree = PrefixTree.from_sequences(sequences)
    prompts = [data.draw(st.integers(1, len(s)), label=f"prompt {i}") for i, s in enumerate(sequences)]
    mask = tree.response_mask(prompts)
    width = tree.max_length - 1
    expected = [[prompts[i] <= t + 1 < len(s) for t in range(width)] for i, s in enumerate(sequences)]
    assert mask.tolist() == expected
