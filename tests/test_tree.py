"""PrefixTree on hand-made rollout sets with known packings."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import dta_fast
import dta_ref
from dta_ref import PrefixTree, agentic_batch, grpo_batch


def assert_tree(tree: PrefixTree, **expected):
    for name, value in expected.items():
        got = getattr(tree, name)
        got = got.tolist() if isinstance(got, torch.Tensor) else got
        assert got == value, f"{name}: got {got}, expected {value}"


def test_single_sequence():
    tree = PrefixTree.from_sequences([[4, 9, 2]])
    assert_tree(
        tree,
        tokens=[4, 9, 2],
        position_ids=[0, 1, 2],
        parent=[-1, 0, 1],
        subtree_end=[3, 3, 3],
        seq_index=[[0, 1, 2]],
        lengths=[3],
        num_tokens=3,
        flat_tokens=3,
        compression_ratio=1.0,
    )
    assert torch.equal(dta_ref.tree_attention_mask(tree), torch.ones(3, 3, dtype=torch.bool).tril())


def test_single_token():
    tree = PrefixTree.from_sequences([[7]])
    assert_tree(tree, tokens=[7], position_ids=[0], parent=[-1], subtree_end=[1], seq_index=[[0]], lengths=[1])
    assert tuple(tree.logprob_mask.shape) == (1, 0)
    assert dta_ref.tree_attention_mask(tree).tolist() == [[True]]


def test_branching_known_packing_and_mask():
    tree = PrefixTree.from_sequences([[1, 2, 4], [1, 5], [1, 2, 3]])
    # children in increasing token order: 1 -> (2 -> (3, 4), 5)
    assert_tree(
        tree,
        tokens=[1, 2, 3, 4, 5],
        position_ids=[0, 1, 2, 2, 1],
        parent=[-1, 0, 1, 1, 0],
        subtree_end=[5, 4, 3, 4, 5],
        seq_index=[[0, 1, 3], [0, 4, -1], [0, 1, 2]],
        lengths=[3, 2, 3],
        flat_tokens=8,
    )
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 1, 0, 1, 0],
            [1, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(dta_ref.tree_attention_mask(tree), expected)
    assert tree.logprob_mask.tolist() == [[True, True], [True, False], [True, True]]
    assert tree.sequence(1).tolist() == [1, 5]


def test_response_mask_by_hand():
    """True where the scored token (step t scores token t+1) is at or past the prompt's length."""
    tree = PrefixTree.from_sequences([[1, 2, 3], [1, 2, 4, 5], [7, 8]])
    assert tree.response_mask([2, 3, 1]).tolist() == [[False, True, False], [False, False, True], [True, False, False]]
    assert tree.response_mask([1, 1, 1]).tolist() == tree.logprob_mask.tolist()
    assert tree.response_mask([3, 4, 2]).tolist() == [[False] * 3] * 3  # no response: nothing to train on
    with pytest.raises(ValueError, match="between 1 and its rollout's length"):
        tree.response_mask([2, 5, 1])  # longer than the rollout (lengths given in another order, say)
    with pytest.raises(ValueError, match="between 1 and its rollout's length"):
        tree.response_mask([0, 3, 1])


def test_padded_layout_by_hand():
    """A batch with left, right and no padding: tree layout entry [i, t] is row i's token t+1."""
    layout = dta_ref.PaddedLayout.of(torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]))
    assert layout.start.tolist() == [1, 0, 3] and layout.length.tolist() == [3, 5, 2] and layout.tree_width == 4
    values = torch.arange(15.0).view(3, 5)  # the value of column c of row i: 5 i + c
    assert layout.to_tree(values, 0, fill=-1).tolist() == [[2, 3, -1, -1], [6, 7, 8, 9], [14, -1, -1, -1]]
    # a block of the last three columns: tokens before it get the fill too
    assert layout.to_tree(values[:, 2:], 2, fill=-1).tolist() == [[2, 3, -1, -1], [-1, 7, 8, 9], [14, -1, -1, -1]]
    tree_values = layout.to_tree(values, 0)
    assert layout.from_tree(tree_values, 0, 5).tolist() == [[0, 0, 2, 3, 0], [0, 6, 7, 8, 9], [0, 0, 0, 0, 14]]
    assert layout.from_tree(tree_values, 3, 2).tolist() == [[3, 0], [8, 9], [0, 14]]


def test_duplicates_share_every_token():
    tree = PrefixTree.from_sequences([[3, 1, 2], [3, 1, 2], [3, 1, 2]])
    assert_tree(tree, tokens=[3, 1, 2], seq_index=[[0, 1, 2]] * 3, num_tokens=3, flat_tokens=9, compression_ratio=3.0)


def test_prefix_of_another_ends_inside_the_path():
    tree = PrefixTree.from_sequences([[5, 6, 7, 8], [5, 6]])
    assert_tree(
        tree,
        tokens=[5, 6, 7, 8],
        parent=[-1, 0, 1, 2],
        subtree_end=[4, 4, 4, 4],
        seq_index=[[0, 1, 2, 3], [0, 1, -1, -1]],
        lengths=[4, 2],
    )
    assert tree.logprob_mask.tolist() == [[True, True, True], [True, False, False]]


def test_forest_roots_do_not_see_each_other():
    tree = PrefixTree.from_sequences([[3, 1], [1, 2], [2]])
    assert_tree(
        tree,
        tokens=[1, 2, 2, 3, 1],
        position_ids=[0, 1, 0, 0, 1],
        parent=[-1, 0, -1, -1, 3],
        subtree_end=[2, 2, 3, 5, 5],
        seq_index=[[3, 4], [0, 1], [2, -1]],
    )
    mask = dta_ref.tree_attention_mask(tree)
    roots = [0, 2, 3]
    for a in roots:
        for b in roots:
            assert bool(mask[a, b]) == (a == b)


def test_deep_chain_of_thousands_of_tokens():
    T = 3000
    rng = np.random.default_rng(0)
    chain = rng.integers(0, 50_000, size=T).tolist()
    cuts = [1, 17, 1000, 2999, T]  # multi-turn samples: prefixes of each other
    tree = PrefixTree.from_sequences([chain[:c] for c in cuts])
    assert tree.num_tokens == T
    assert tree.tokens.tolist() == chain
    assert torch.equal(tree.position_ids, torch.arange(T))
    assert torch.equal(tree.parent, torch.arange(T) - 1)
    assert bool((tree.subtree_end == T).all())
    for s, c in enumerate(cuts):
        assert tree.seq_index[s, :c].tolist() == list(range(c))
        assert bool((tree.seq_index[s, c:] == -1).all())
    assert tree.flat_tokens == sum(cuts)


def test_wide_fan_of_thousands_of_branches():
    width = 3000
    rng = np.random.default_rng(1)
    leaves = rng.permutation(width).tolist()
    tree = PrefixTree.from_sequences([[7, t] for t in leaves])
    T = width + 1
    assert tree.num_tokens == T
    assert tree.tokens.tolist() == [7] + list(range(width))
    assert tree.subtree_end.tolist() == [T] + list(range(2, T + 1))
    assert tree.parent.tolist() == [-1] + [0] * width
    assert tree.position_ids.tolist() == [0] + [1] * width
    assert tree.seq_index[:, 1].tolist() == [t + 1 for t in leaves]
    assert tree.compression_ratio == 2 * width / T


def test_forest_of_thousands_of_single_tokens():
    n = 2000
    tree = PrefixTree.from_sequences([[t] for t in reversed(range(n))])
    assert tree.tokens.tolist() == list(range(n))
    assert tree.parent.tolist() == [-1] * n
    assert tree.subtree_end.tolist() == list(range(1, n + 1))
    assert tree.seq_index[:, 0].tolist() == list(reversed(range(n)))


SEQS = [[1, 2, 3], [1, 2, 4], [9, 2, 3]]


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param(torch.tensor(SEQS), id="2d-int64-tensor"),
        pytest.param(torch.tensor(SEQS, dtype=torch.int32), id="2d-int32-tensor"),
        pytest.param([torch.tensor(s) for s in SEQS], id="list-of-tensors"),
        pytest.param(np.array(SEQS), id="2d-numpy"),
        pytest.param([np.array(s, dtype=np.int32) for s in SEQS], id="list-of-numpy"),
        pytest.param([[np.int64(t) for t in s] for s in SEQS], id="numpy-scalars"),
        pytest.param(tuple(tuple(s) for s in SEQS), id="tuples"),
    ],
)
def test_tensor_and_numpy_inputs(batch):
    ref = PrefixTree.from_sequences(SEQS)
    tree = PrefixTree.from_sequences(batch)
    for name in ref.__dataclass_fields__:
        assert torch.equal(getattr(tree, name), getattr(ref, name)), name


def test_large_token_ids_are_kept():
    tree = PrefixTree.from_sequences([[151_000, 0], [151_000, 2**40]])
    assert tree.tokens.tolist() == [151_000, 0, 2**40]


def test_to_and_repr():
    tree = PrefixTree.from_sequences([[1, 2], [1, 3]])
    moved = tree.to("cpu")
    for name in tree.__dataclass_fields__:
        assert torch.equal(getattr(moved, name), getattr(tree, name))
    assert repr(tree) == "PrefixTree(num_sequences=2, num_tokens=3, flat_tokens=4, compression_ratio=1.33)"


def test_masks_live_on_the_trees_device():
    """A tree moved to a device builds its masks there (the meta device stands in for a GPU on CPU)."""
    tree = PrefixTree.from_sequences([[1, 2, 3], [1, 2, 4, 5]])
    moved = tree.to("meta")
    assert moved.logprob_mask.device.type == "meta" and moved.logprob_mask.shape == tree.logprob_mask.shape


@pytest.mark.gpu
def test_masks_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tree = PrefixTree.from_sequences([[1, 2, 3], [1, 2, 4, 5]])
    moved = tree.to("cuda")
    assert torch.equal(moved.logprob_mask.cpu(), tree.logprob_mask)
    for prompts in ([1, 2], torch.tensor([1, 2]), torch.tensor([1, 2], device="cuda")):
        assert torch.equal(moved.response_mask(prompts).cpu(), tree.response_mask([1, 2]))


def test_grpo_batch_compression_matches_formula():
    G, P, N, R = 2, 50, 4, 10
    batch = dta_ref.grpo_batch(num_groups=G, prompt_len=P, num_responses=N, response_len=R, seed=0)
    assert len(batch) == G * N and all(len(s) == P + R for s in batch)
    tree = PrefixTree.from_sequences(batch)
    assert tree.flat_tokens == G * N * (P + R)
    assert tree.num_tokens == G * (P + N * R)


def test_agentic_batch_compression_matches_formula():
    system, tasks, task, rollouts, turns, asst, tool = 200, 2, 20, 3, 4, 5, 10
    batch = dta_ref.agentic_batch(
        system_len=system,
        num_tasks=tasks,
        task_len=task,
        rollouts_per_task=rollouts,
        turns=turns,
        assistant_len=asst,
        tool_len=tool,
        seed=0,
    )
    assert len(batch) == tasks * rollouts * turns
    tree = PrefixTree.from_sequences(batch)
    unique = system + tasks * (task + rollouts * (turns * asst + (turns - 1) * tool))
    per_rollout = sum(system + task + k * asst + (k - 1) * tool for k in range(1, turns + 1))
    assert tree.num_tokens == unique
    assert tree.flat_tokens == tasks * rollouts * per_rollout
    assert tree.compression_ratio == pytest.approx(tasks * rollouts * per_rollout / unique)
    assert tree.compression_ratio > 5


def test_fast_builder_on_nested_prefixes_and_wide_ids():
    """Multi-turn chains (each rollout a prefix of the next), nested prefixes, and ids whose bytes order
    differently in little-endian (255 < 256, 2**32 - 1 < 2**32): dta_fast.build_tree equals the reference."""
    batches = [
        [list(range(3 * (k + 1))) for k in range(60)],
        [[0] * (60 - k) + [1] for k in range(60)],
        [[7, 256, 1], [7, 255, 2], [7, 256], [2**32, 5], [2**32 - 1, 5], [2**32, 5, 0], [7]],
    ]
    for batch in batches:
        random.Random(1).shuffle(batch)
        expected, built = PrefixTree.from_sequences(batch), dta_fast.build_tree(batch)
        for name in expected.__dataclass_fields__:
            assert torch.equal(getattr(expected, name), getattr(built, name)), name


def test_fast_builder_on_training_shaped_batches():
    """dta_fast.build_tree equals the reference on the GRPO and agentic shapes, shuffled."""
    for batch in (grpo_batch(3, 300, 5, 40, seed=1), agentic_batch(500, 3, 20, 3, 4, 15, 30, seed=2)):
        random.Random(0).shuffle(batch)
        expected, built = PrefixTree.from_sequences(batch), dta_fast.build_tree(batch)
        for name in expected.__dataclass_fields__:
            assert torch.equal(getattr(expected, name), getattr(built, name)), name


def test_plot_writes_to_the_working_directory_unless_given_a_path(tmp_path, monkeypatch, capsys):
    """``python -m dta_ref.plot`` draws to ./prefix_tree.png (from a checkout it had overwritten the tracked
    docs/images/prefix_tree.png); an explicit path is still honoured."""
    pytest.importorskip("matplotlib")
    from dta_ref.plot import main

    monkeypatch.chdir(tmp_path)
    main([])
    assert [p.name for p in tmp_path.iterdir()] == ["prefix_tree.png"]
    main([str(tmp_path / "images" / "other.png")])
    assert (tmp_path / "images" / "other.png").stat().st_size > 0
    assert capsys.readouterr().out.split() == ["prefix_tree.png", str(tmp_path / "images" / "other.png")]
