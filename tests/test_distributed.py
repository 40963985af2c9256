"""distributed_tree_backward on CPU with the gloo backend, 2 and 3 ranks spawned by the test.

After the call every rank's gradients must equal the single-process
per-sequence (flat) gradients of the whole batch, in float64.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dta_ref
from dta_ref import PolicyGradientLoss, PrefixTree, agentic_batch, grpo_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batch(name="mixed"):
    if name == "duplicates":
        return [[5, 6, 7, 8, 9, 10]] * 3 + [[1, 2]]
    return (
        grpo_batch(2, 9, 3, 5, vocab_size=64, seed=3)
        + agentic_batch(12, 2, 3, 2, 3, 3, 4, vocab_size=64, seed=4)
        + [[7], [7, 8]]
    )


def _model(kind):
    from tests.helpers import tiny_decoder, tiny_hf_model

    return tiny_decoder(torch.float64, seed=1) if kind == "decoder" else tiny_hf_model(kind, torch.float64, "sdpa")


def _loss_inputs(tree, flat):
    g = torch.Generator().manual_seed(5)
    old = flat.detach() + 0.2 * torch.randn(flat.shape, generator=g, dtype=torch.float64)
    adv = torch.randn(tree.num_sequences, generator=g, dtype=torch.float64)
    return old, adv, tree.logprob_mask


def _expected(kind, sequences, generic):
    """Single process, each sequence alone: loss and parameter gradients."""
    model = _model(kind)
    tree = PrefixTree.from_sequences(sequences)
    flat = dta_ref.flat_logprobs(model, sequences)
    old, adv, mask = _loss_inputs(tree, flat)
    if generic:
        lengths = (tree.lengths - 1).tolist()
        loss = sum(_generic_loss(adv)(i, flat[i, : lengths[i]]) for i in range(tree.num_sequences))
    else:
        loss = dta_ref.policy_gradient_loss(flat, old, adv, mask, 0.2, 0.28, "token_mean")
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.detach(), [g.detach() for g in grads], (old, adv, mask)


def _generic_loss(adv):
    def loss_fn(i, lp):
        return -(lp.sum() * adv[i]).tanh() if lp.numel() else lp.sum()

    return loss_fn


def _worker(rank, world, init_file, *args):
    sys.path.insert(0, ROOT)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _check_rank(world, *args)  # a function of its own: its DDP wrapper is gone before the group is
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check_rank(world, kind, wrap_ddp, generic, chunk, batch, expected, shards=None):
    import dta_fast

    sequences = _batch(batch)
    exp_loss, exp_grads, (old, adv, mask) = expected
    model = _model(kind)
    start = [torch.full_like(p, 0.25) for p in model.parameters()]
    for p, s in zip(model.parameters(), start):
        p.grad = s.clone()  # gradients already there are kept and added to
    if wrap_ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    loss_fn = _generic_loss(adv) if generic else PolicyGradientLoss(old, adv, mask, 0.2, 0.28, "token_mean")
    loss, logprobs, indices = dta_fast.distributed_tree_backward(
        model, sequences, loss_fn, max_chunk_tokens=chunk, plan=shards  # a forced plan, e.g. with empty shards
    )
    module = model.module if wrap_ddp else model
    # transformers runs RMSNorm in float32 even in a float64 model (CONTRIBUTING.md, tolerance policy)
    rel = 1e-10 if kind == "decoder" else 1e-5
    torch.testing.assert_close(loss, exp_loss, rtol=rel, atol=rel)
    scale = max(g.abs().max().item() for g in exp_grads)
    for p, s, g in zip(module.parameters(), start, exp_grads):
        torch.testing.assert_close(p.grad - s, g, rtol=0, atol=rel * scale)
    if indices:  # this rank's logprobs are those of its sequences
        flat = dta_ref.flat_logprobs(module, [sequences[i] for i in indices])
        torch.testing.assert_close(logprobs, flat.detach(), rtol=0, atol=rel)
    all_indices = [None] * world
    dist.all_gather_object(all_indices, indices)
    assert sorted(i for part in all_indices for i in part) == list(range(len(sequences)))


def _spawn(tmp_path, world, kind="decoder", wrap_ddp=False, generic=False, chunk=None, batch="mixed", shards=None):
    expected = _expected(kind, _batch(batch), generic)
    mp.spawn(
        _worker,
        args=(world, str(tmp_path / "init"), kind, wrap_ddp, generic, chunk, batch, expected, shards),
        nprocs=world,
        join=True,
    )


@pytest.mark.parametrize("world", [2, 3])
def test_decoder_matches_flat(tmp_path, world):
    _spawn(tmp_path, world, chunk=7)


def test_empty_shards_take_part(tmp_path):
    """Ranks with nothing to train still join every collective (no hang) and get the whole gradient."""
    _spawn(tmp_path, 3, batch="duplicates", wrap_ddp=True, shards=[[], [0, 1, 2, 3], []])


def test_ddp_reduces_once(tmp_path):
    _spawn(tmp_path, 2, wrap_ddp=True)


def test_generic_loss(tmp_path):
    _spawn(tmp_path, 2, generic=True, chunk=5)


def test_hf_model(tmp_path):
    pytest.importorskip("transformers")
    _spawn(tmp_path, 2, kind="qwen3", wrap_ddp=True, chunk=9)


def _empty_shard_worker(rank, world, init_file):
    sys.path.insert(0, ROOT)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        import dta_fast

        with pytest.raises(ValueError, match="more ranks"):
            dta_fast.distributed_tree_backward(_model("decoder"), [[1, 2, 3]], lambda i, lp: lp.sum())
        # a bad plan fails on every rank (rank 0 checks it and tells the others), no hang
        with pytest.raises(ValueError, match="exactly one rank"):
            dta_fast.distributed_tree_backward(_model("decoder"), [[1], [2], [3]], lambda i, lp: lp.sum(), plan=[[0], [0, 2]])
        with pytest.raises(ValueError, match="one list of sequence indices per rank"):
            dta_fast.distributed_tree_backward(_model("decoder"), [[1], [2]], lambda i, lp: lp.sum(), plan=[[0, 1]])
    finally:
        dist.destroy_process_group()


def test_more_ranks_than_sequences_and_bad_plans(tmp_path):
    mp.spawn(_empty_shard_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


def test_needs_process_group():
    import dta_fast

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="process group"):
        dta_fast.distributed_tree_backward(_model("decoder"), [[1, 2]], lambda i, lp: lp.sum())


def _nccl_worker(rank, world, init_file, expected):
    sys.path.insert(0, ROOT)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _check_nccl_rank(rank, expected)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check_nccl_rank(rank, expected):
    import dta_fast

    exp_loss, exp_grads, (old, adv, mask) = expected
    model = _model("decoder").float().cuda()
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    loss_fn = PolicyGradientLoss(old, adv, mask, 0.2, 0.28, "token_mean")
    loss, _, _ = dta_fast.distributed_tree_backward(model, _batch(), loss_fn, max_chunk_tokens=8)
    torch.testing.assert_close(loss.cpu(), exp_loss, rtol=1e-4, atol=1e-5)
    scale = max(g.abs().max().item() for g in exp_grads)
    for p, g in zip(model.module.parameters(), exp_grads):
        torch.testing.assert_close(p.grad.double().cpu(), g, rtol=0, atol=1e-4 * scale)


@pytest.mark.gpu
def test_nccl_kernel_path(tmp_path):
    """Two GPUs, NCCL, the Triton kernel: the same whole-batch gradients as one process."""
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip("needs at least 2 GPUs")
    expected = _expected("decoder", _batch(), False)
    mp.spawn(_nccl_worker, args=(min(world, 4), str(tmp_path / "init"), expected), nprocs=min(world, 4), join=True)
