"""The Gated DeltaNet convolution and delta rule on random trees, both twins, against each path run alone.

Each rollout alone is the model's own computation on its tokens: transformers' Qwen3-Next
``causal_conv1d_fn`` and ``torch_recurrent_gated_delta_rule``. On the tree, every token's output must
be that of its path, and the gradients of the inputs (q, k, v, gates, betas, convolution weights) the
sums over the paths that hold each token.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

import dta_fast  # noqa: E402
import dta_fast.linear_attention as fast  # noqa: E402
import dta_ref  # noqa: E402
import dta_ref.linear_attention as ref  # noqa: E402
from property_tests.strategies import rollout_sets, seeds  # noqa: E402

HK, HV, DK, DV, C, K = 2, 4, 4, 3, 5, 4  # key heads, value heads, head dims, conv channels, conv width


def _modeling():
    from transformers.models.qwen3_next import modeling_qwen3_next

    return modeling_qwen3_next


def _inputs(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).requires_grad_()

    return dict(
        query=leaf(1, T, HK, DK), key=leaf(1, T, HK, DK), value=leaf(1, T, HV, DV),
        g=(-torch.rand(1, T, HV, generator=g, dtype=torch.float64)).requires_grad_(),
        beta=torch.rand(1, T, HV, generator=g, dtype=torch.float64).requires_grad_(),
    )  # fmt: skip


def _paths(tree):
    """Each rollout's packed token indices, root first."""
    return [tree.seq_index[i, : int(tree.lengths[i])] for i in range(tree.num_sequences)]


def _loss(out, tree, seed):
    """A random weighting of every rollout's outputs at every step (one term per (rollout, step))."""
    g = torch.Generator().manual_seed(seed + 1)
    weights = torch.randn(tree.num_sequences, tree.max_length, *out.shape[2:], generator=g, dtype=torch.float64)
    return sum((out[0, path] * weights[i, : len(path)].to(out)).sum() for i, path in enumerate(_paths(tree)))


def _grads(loss, leaves):
    return torch.autograd.grad(loss, list(leaves.values()))


def _varlen(chunked):
    """``chunked`` with flash-linear-attention's variable-length contract: ``cu_seqlens`` splits one row
    into sequences, each starting from its row of ``initial_state`` [N, H, K, V]."""

    def run(q, k, v, g, beta, initial_state=None, cu_seqlens=None, **kwargs):
        outs, finals = [], []
        for j, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            initial = None if initial_state is None else initial_state[j : j + 1]
            x = (t[:, a:b] for t in (q, k, v, g, beta))
            out, final = chunked(*x, initial_state=initial, **kwargs)
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1), torch.cat(finals)

    return run


@settings(max_examples=20, deadline=None)
@given(rollout_sets(max_sequences=6, max_len=10), seeds())
def test_delta_rule_on_the_tree_is_each_path_alone(sequences, seed):
    tree = dta_ref.PrefixTree.from_sequences(sequences)
    modeling = _modeling()
    inputs = _inputs(tree.num_tokens, seed)
    # the truth: each path alone through the model's own recurrence, its outputs scattered back per rollout
    alone = torch.zeros(1, tree.num_sequences, tree.max_length, HV, DV, dtype=torch.float64)
    want_loss = 0
    g = torch.Generator().manual_seed(seed + 1)
    weights = torch.randn(tree.num_sequences, tree.max_length, HV, DV, generator=g, dtype=torch.float64)
    for i, path in enumerate(_paths(tree)):
        out, _ = modeling.torch_recurrent_gated_delta_rule(
            **{name: x[:, path] for name, x in inputs.items()}, use_qk_l2norm_in_kernel=True
        )
        alone[0, i, : len(path)] = out[0].detach()
        want_loss = want_loss + (out[0] * weights[i, : len(path)]).sum()
    want = _grads(want_loss, inputs)
    chunked = modeling.torch_chunk_gated_delta_rule
    segs = fast.segments(tree.parent)
    runs = {  # the reference, the fast twin, and the fast twin's level-by-level schedule
        twin.__module__: lambda twin=twin: twin(tree.parent).delta_rule(chunked, **inputs, use_qk_l2norm_in_kernel=True)
        for twin in (ref.TreeLinearMixing, fast.TreeLinearMixing)
    } | {
        "levels": lambda: (
            fast.run_segments(_varlen(chunked), *inputs.values(), segs, [None] * len(segs), True, varlen=True)[0],
            None,
        ),
    }
    for twin, run in runs.items():
        out, final = run()
        assert final is None and out.shape == (1, tree.num_tokens, HV, DV)
        for i, path in enumerate(_paths(tree)):
            torch.testing.assert_close(out[0, path].detach(), alone[0, i, : len(path)], rtol=2e-5, atol=2e-5)
        got = _grads(_loss(out, tree, seed), inputs)
        for name, a, b in zip(inputs, got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, n=name, w=twin: f"{w} {n}: {m}")


@settings(max_examples=20, deadline=None)
@given(rollout_sets(max_sequences=6, max_len=10), seeds(), st.sampled_from([None, "silu"]))
def test_convolution_on_the_tree_is_each_path_alone(sequences, seed, activation):
    """The model's causal convolution on each path (float64, exact) against the tree's, values and the
    gradients of the inputs and the weight."""
    tree = dta_ref.PrefixTree.from_sequences(sequences)
    modeling = _modeling()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, C, tree.num_tokens, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(C, K, generator=g, dtype=torch.float64).requires_grad_()
    weights = torch.randn(tree.num_sequences, C, tree.max_length, generator=g, dtype=torch.float64)
    want_loss, alone = 0, []
    for i, path in enumerate(_paths(tree)):
        out = modeling.causal_conv1d_fn(x[:, :, path], weight, None, activation=activation)
        alone.append(out.detach())
        want_loss = want_loss + (out[0] * weights[i, :, : len(path)]).sum()
    want = torch.autograd.grad(want_loss, [x, weight])
    out = ref.TreeLinearMixing(tree.parent).conv(modeling.causal_conv1d_fn, x, weight, None, activation=activation)
    loss = 0
    for i, path in enumerate(_paths(tree)):
        torch.testing.assert_close(out[:, :, path].detach(), alone[i], rtol=1e-12, atol=1e-12)
        loss = loss + (out[0][:, path] * weights[i, :, : len(path)]).sum()
    for a, b in zip(torch.autograd.grad(loss, [x, weight]), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_segments_and_ancestors():
    """A prompt [0 1 2], branches after it ([3 4], [5]) and after 3 ([6]): unbranched segments and the
    convolution's taps along each path."""
    parent = torch.tensor([-1, 0, 1, 2, 3, 3, 2, -1])  # tokens 0-2 prompt; 3 -> {4, 5}; 2 -> 6; 7 a root
    assert fast.segments(parent) == [(0, 3, -1), (3, 4, 0), (4, 5, 1), (5, 6, 1), (6, 7, 0), (7, 8, -1)]
    ancestors = ref.path_ancestors(parent, 3)
    assert ancestors[5].tolist() == [5, 3, 2] and ancestors[6].tolist() == [6, 2, 1]
    assert ancestors[1].tolist() == [1, 0, -1] and ancestors[7].tolist() == [7, -1, -1]


def test_a_cached_state_or_packed_offsets_are_refused():
    modeling = _modeling()
    inputs = _inputs(3, 0)
    mixing = ref.TreeLinearMixing(torch.tensor([-1, 0, 1]))
    with pytest.raises(ValueError, match="passed a cached state"):
        mixing.delta_rule(modeling.torch_chunk_gated_delta_rule, **inputs, initial_state=torch.zeros(1, HV, DK, DV))
    with pytest.raises(ValueError, match="packed-sequence offsets"):
        mixing.delta_rule(modeling.torch_chunk_gated_delta_rule, **inputs, cu_seqlens=torch.tensor([0, 3]))


def test_levels_are_batched_only_where_flash_linear_attention_imports(monkeypatch):
    """A flash-linear-attention whose delta rule fails to import leaves transformers on its PyTorch form,
    which takes no variable-length calls: then each segment is one call."""
    import importlib.util
    import sys

    fast.fla_available.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "fla" else None)
    monkeypatch.setitem(sys.modules, "fla", None)  # an import of it raises
    try:
        assert not fast.fla_available()
    finally:
        fast.fla_available.cache_clear()


@settings(max_examples=15, deadline=None)
@given(
    rollout_sets(max_sequences=6, max_len=10),
    st.integers(1, 12),
    st.booleans(),
    st.sampled_from(["qwen3.5", "qwen3-next"]),
    st.booleans(),
)
def test_hybrid_chunks_equal_each_rollout_alone(sequences, chunk, recompute, family, checkpoint_layers):
    """tree_backward on a hybrid in chunks of any size (states and convolution inputs read across chunks,
    kept or recomputed, layers checkpointed or not): logprobs and gradients of each rollout alone through
    the model's own forward (which computes its delta rule in float32, hence 3e-5)."""
    from tests.helpers import assert_grads_close, param_grads, tiny_family_model

    model = tiny_family_model(family, torch.float64)
    tree = dta_ref.PrefixTree.from_sequences(sequences)
    flat = dta_ref.flat_logprobs(model, sequences)
    expected = param_grads(model, dta_ref.sft_loss(flat, tree.logprob_mask, "sequence_mean"))
    lp, _ = dta_fast.tree_backward(
        model, tree, dta_ref.SFTLoss(tree.logprob_mask, "sequence_mean"), max_chunk_tokens=chunk, recompute=recompute,
        checkpoint_layers=checkpoint_layers,
    )  # fmt: skip
    torch.testing.assert_close(lp, flat.detach(), rtol=0, atol=3e-5)
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, expected, rel=3e-5)
