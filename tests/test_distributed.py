"""distributed_tree_backward on CPU with the gloo backend, 2 and 3 ranks spawned by the test.

After the call every rank's gradients (with FSDP2, its shard of them) must
equal the single-process per-sequence (flat) gradients of the whole batch,
in float64, for a plain model, DistributedDataParallel and FSDP2.
"""

from __future__ import annotations

import contextlib
import gc
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
    """``kind``: "decoder" or an HF family, with "+reentrant" / "+non-reentrant" for gradient checkpointing."""
    from tests.helpers import HF_FAMILIES, tiny_decoder, tiny_family_model, tiny_hf_model

    family, _, checkpointing = kind.partition("+")
    if family == "decoder":
        return tiny_decoder(torch.float64, seed=1)
    if family not in HF_FAMILIES:  # the other text families (a hybrid: recurrent states across chunks)
        return tiny_family_model(family, torch.float64, "sdpa")
    model = tiny_hf_model(family, torch.float64, "sdpa")
    if checkpointing:
        reentrant = checkpointing == "reentrant"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if reentrant:
            model.enable_input_require_grads()
        model.train()
    return model


def _loss_inputs(tree, flat):
    g = torch.Generator().manual_seed(5)
    old = flat.detach() + 0.2 * torch.randn(flat.shape, generator=g, dtype=torch.float64)
    adv = torch.randn(tree.num_sequences, generator=g, dtype=torch.float64)
    return old, adv, tree.logprob_mask


def _expected(kind, sequences, generic, model=None, inputs=None):
    """Single process, each sequence alone: loss and parameter gradients (of a fresh model by default)."""
    model = _model(kind.partition("+")[0]) if model is None else model
    tree = PrefixTree.from_sequences(sequences)
    flat = dta_ref.flat_logprobs(model, sequences)
    old, adv, mask = _loss_inputs(tree, flat) if inputs is None else inputs
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


def _destroy_group():
    dist.destroy_process_group()
    # Wrappers' reference cycles (DDP's, FSDP's) can keep the gloo group alive past destroy; if
    # Python's shutdown frees it, its worker thread may drop a finished work holding Python objects
    # after the interpreter is gone and abort the process (torch 2.13). Free it now.
    gc.collect()


def _worker(rank, world, init_file, *args):
    sys.path.insert(0, ROOT)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _check_rank(world, *args)  # a function of its own: its DDP wrapper is gone before the group is
        dist.barrier()
    finally:
        _destroy_group()


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
    logprobs, loss, indices = dta_fast.distributed_tree_backward(
        model,
        sequences,
        loss_fn,
        max_chunk_tokens=chunk,
        plan=shards,  # a forced plan, e.g. with empty shards
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


def test_a_plan_in_any_order(tmp_path):
    """A plan whose shards list their sequences out of order: each sequence keeps its own loss inputs."""
    n = len(_batch())
    evens = list(range(0, n, 2))
    _spawn(tmp_path, 2, shards=[list(range(n - 1, 0, -2)), evens[1::2] + evens[::2]])


def test_ddp_reduces_once(tmp_path):
    _spawn(tmp_path, 2, wrap_ddp=True)


def test_generic_loss(tmp_path):
    _spawn(tmp_path, 2, generic=True, chunk=5)


def test_hf_model(tmp_path):
    pytest.importorskip("transformers")
    _spawn(tmp_path, 2, kind="qwen3", wrap_ddp=True, chunk=9)


def test_hybrid_model(tmp_path):
    """A hybrid (Gated DeltaNet layers) in chunks on each rank: the states cross its shard's chunks."""
    pytest.importorskip("transformers")
    _spawn(tmp_path, 2, kind="qwen3.5", chunk=7)


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
def test_hf_model_with_gradient_checkpointing(tmp_path, checkpointing):
    """Layers recomputed in the backward stay on the tree path, on every rank."""
    _spawn(tmp_path, 2, kind=f"qwen2+{checkpointing}", chunk=9)


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
            dta_fast.distributed_tree_backward(
                _model("decoder"), [[1], [2], [3]], lambda i, lp: lp.sum(), plan=[[0], [0, 2]]
            )
        with pytest.raises(ValueError, match="one list of sequence indices per rank"):
            dta_fast.distributed_tree_backward(_model("decoder"), [[1], [2]], lambda i, lp: lp.sum(), plan=[[0, 1]])
        for index in (1.9, float("inf"), True):  # not truncated or read as 1; no rank left waiting in the broadcast
            with pytest.raises(TypeError, match="integer sequence indices"):
                dta_fast.distributed_tree_backward(
                    _model("decoder"), [[1], [2]], lambda i, lp: lp.sum(), plan=[[0], [index]]
                )
        # errors name sequences by their index in the batch, not in a rank's shard
        sequences = [[1, 2], [3, 4], [5, 6], [7, -8]]
        with pytest.raises(ValueError, match="sequence 3: tokens must be non-negative"):
            dta_fast.distributed_tree_backward(
                _model("decoder"), sequences, lambda i, lp: lp.sum(), plan=[[0, 1], [2, 3]]
            )
        # a loss built for other lengths is refused as on one process, not cut to each shard's width
        sequences = [[1, 2, 3, 4, 5, 6], [1, 2, 3], [9, 10, 11]]
        mask = torch.zeros(3, 7, dtype=torch.bool)
        with pytest.raises(ValueError, match=r"built for logprobs of shape \(3, 7\), the tree has \(3, 5\)"):
            dta_fast.distributed_tree_backward(_model("decoder"), sequences, dta_ref.SFTLoss(mask), plan=[[0], [1, 2]])
        mask = torch.zeros(3, 5, dtype=torch.bool)
        mask[2, 3] = True  # past the end of sequence 2
        with pytest.raises(ValueError, match="step 3 of sequence 2"):
            dta_fast.distributed_tree_backward(_model("decoder"), sequences, dta_ref.SFTLoss(mask), plan=[[0, 2], [1]])
        # an interrupt while rank 0 plans stays itself there, and the others learn of it rather than wait
        import dta_fast.distributed as distributed

        planned = distributed.partition
        if rank == 0:
            distributed.partition = lambda *args: (_ for _ in ()).throw(KeyboardInterrupt("stop"))
        try:
            expected = (
                (KeyboardInterrupt, "stop") if rank == 0 else (RuntimeError, "on rank 0 while planning: Keyboard")
            )
            with pytest.raises(expected[0], match=expected[1]):
                dta_fast.distributed_tree_backward(_model("decoder"), [[1], [2]], lambda i, lp: lp.sum())
        finally:
            distributed.partition = planned
        # a parameter no term reaches keeps None on every rank, as with loss.backward(); one a term reaches on
        # one rank only (a direct term of sequence 0's loss) is reduced on every rank
        model = _model("decoder")
        model.value_head, model.unused = torch.nn.Linear(4, 1).double(), torch.nn.Linear(4, 1).double()

        def with_value_term(i, lp):
            return -lp.sum() + (model.value_head.weight.sum() if i == 0 else 0)

        dta_fast.distributed_tree_backward(model, [[1, 2, 3], [1, 2, 4]], with_value_term, plan=[[0], [1]])
        assert model.unused.weight.grad is None and model.unused.bias.grad is None
        assert torch.equal(model.value_head.weight.grad, torch.ones_like(model.value_head.weight))
        assert model.value_head.bias.grad is None
        assert all(p.grad is not None for p in model.layers.parameters())
        # a rank outside the group is told so
        alone = dist.new_group([0])
        if rank == 1:
            with pytest.raises(ValueError, match="not a member of group"):
                dta_fast.distributed_tree_backward(_model("decoder"), [[1], [2]], lambda i, lp: lp.sum(), group=alone)
    finally:
        _destroy_group()


def test_more_ranks_than_sequences_and_bad_plans(tmp_path):
    mp.spawn(_empty_shard_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


def test_needs_process_group():
    import dta_fast

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="process group"):
        dta_fast.distributed_tree_backward(_model("decoder"), [[1, 2]], lambda i, lp: lp.sum())


def _nccl_worker(rank, world, init_file, check, expected):
    sys.path.insert(0, ROOT)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        check(rank, world, expected)
        dist.barrier()
    finally:
        _destroy_group()


def _check_nccl_rank(rank, world, expected):
    import dta_fast

    exp_loss, exp_grads, (old, adv, mask) = expected
    model = _model("decoder").float().cuda()
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    loss_fn = PolicyGradientLoss(old, adv, mask, 0.2, 0.28, "token_mean")
    _, loss, _ = dta_fast.distributed_tree_backward(model, _batch(), loss_fn, max_chunk_tokens=8)
    torch.testing.assert_close(loss.cpu(), exp_loss, rtol=1e-4, atol=1e-5)
    scale = max(g.abs().max().item() for g in exp_grads)
    for p, g in zip(model.module.parameters(), exp_grads):
        torch.testing.assert_close(p.grad.double().cpu(), g, rtol=0, atol=1e-4 * scale)


def _spawn_nccl(tmp_path, check):
    """One process per GPU (2 to 4), each running ``check(rank, world, expected)``."""
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip("needs at least 2 GPUs")
    expected = _expected("decoder", _batch(), False)
    world = min(world, 4)
    mp.spawn(_nccl_worker, args=(world, str(tmp_path / "init"), check, expected), nprocs=world, join=True)


@pytest.mark.gpu
def test_nccl_kernel_path(tmp_path):
    """Two GPUs, NCCL, the Triton kernel: the same whole-batch gradients as one process."""
    _spawn_nccl(tmp_path, _check_nccl_rank)


# ------------------------------------------------------------------ FSDP2


def _fsdp_model(kind, world):
    """The test model sharded with FSDP2 over all ranks as for training: every decoder layer, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(kind)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers if kind == "decoder" else model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@contextlib.contextmanager
def _fsdp_collectives_counted():
    """Count FSDP2's all-gathers and reduce-scatters (its default collectives, one per parameter group)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    counts = {"all_gather": 0, "reduce_scatter": 0}
    patched = {"all_gather": collectives.DefaultAllGather, "reduce_scatter": collectives.DefaultReduceScatter}
    originals = {name: cls.__call__ for name, cls in patched.items()}

    def counting(name):
        def call(self, *args, **kwargs):
            counts[name] += 1
            return originals[name](self, *args, **kwargs)

        return call

    for name, cls in patched.items():
        cls.__call__ = counting(name)
    try:
        yield counts
    finally:
        for name, cls in patched.items():
            cls.__call__ = originals[name]


def _fsdp_worker(rank, world, init_file, check, *args):
    sys.path.insert(0, ROOT)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        check(world, *args)
        dist.barrier()
    finally:
        _destroy_group()


def _assert_whole_gradient(model, expected_grads, rel, already=0.0):
    """Every rank's .grad is its shard of the whole batch's gradient (plus what was there before)."""
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in model.parameters())  # sharded again, as FSDP leaves them
    scale = max(g.abs().max().item() for g in expected_grads)
    for p, g in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(p.grad.full_tensor() - already, g, rtol=0, atol=rel * scale)


def _check_fsdp_rank(world, kind, generic, options, batch, expected, shards, next_step):
    from torch.distributed.fsdp import FSDPModule

    import dta_fast

    sequences = _batch(batch)
    exp_loss, exp_grads, inputs = expected
    old, adv, mask = inputs
    model = _fsdp_model(kind, world)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)  # this rank's shard of gradients already there: kept and added to
    loss_fn = _generic_loss(adv) if generic else PolicyGradientLoss(old, adv, mask, 0.2, 0.28, "token_mean")
    with _fsdp_collectives_counted() as counts:
        logprobs, loss, indices = dta_fast.distributed_tree_backward(model, sequences, loss_fn, plan=shards, **options)
    # each parameter group: gathered once before the shard trains, reduced once after, whatever the chunks
    groups = sum(isinstance(m, FSDPModule) for m in model.modules())
    assert counts == {"all_gather": groups, "reduce_scatter": groups}
    rel = 1e-10 if kind == "decoder" else 1e-5
    torch.testing.assert_close(loss, exp_loss, rtol=rel, atol=rel)
    _assert_whole_gradient(model, exp_grads, rel, already=0.25)
    if indices:
        flat = dta_ref.flat_logprobs(_model(kind), [sequences[i] for i in indices])
        torch.testing.assert_close(logprobs, flat.detach(), rtol=0, atol=rel)
    if next_step:
        _check_fsdp_next_steps(model, world, kind, sequences, loss_fn, options, [g + 0.25 for g in exp_grads], inputs)


def _check_fsdp_next_steps(model, world, kind, sequences, loss_fn, options, first_grads, inputs):
    """After the call FSDP trains on: an optimizer step, a second call, then FSDP's own mean-reduced backward."""
    import dta_fast

    lr = 0.1
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    optimizer.step()
    plain = _model(kind)
    with torch.no_grad():
        for p, g in zip(plain.parameters(), first_grads):
            p -= lr * g
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=0, atol=1e-12)

    optimizer.zero_grad()
    _, exp_grads, _ = _expected(kind, sequences, False, model=plain, inputs=inputs)
    dta_fast.distributed_tree_backward(model, sequences, loss_fn, **options)
    _assert_whole_gradient(model, exp_grads, 1e-10)

    # the model's own settings are back: sync on, gradients averaged over ranks
    optimizer.zero_grad()
    rank_ids = [torch.tensor([[3, 1, 4, 1, 5 + r]]) for r in range(world)]
    model(rank_ids[dist.get_rank()]).square().mean().backward()
    per_rank = [torch.autograd.grad(plain(ids).square().mean(), list(plain.parameters())) for ids in rank_ids]
    _assert_whole_gradient(model, [sum(gs) / world for gs in zip(*per_rank)], 1e-10)


def _spawn_fsdp(tmp_path, world, kind="decoder", generic=False, batch="mixed", shards=None, next_step=False, **options):
    expected = _expected(kind, _batch(batch), generic)
    args = (_check_fsdp_rank, kind, generic, options, batch, expected, shards, next_step)
    mp.spawn(_fsdp_worker, args=(world, str(tmp_path / "init"), *args), nprocs=world, join=True)


def _peft_model(targets):
    from peft import LoraConfig, get_peft_model

    model = _model("qwen3")
    torch.manual_seed(9)  # the same adapters on every rank and in the expected gradients
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, config)


def _check_fsdp_peft_rank(world, shard_layers, targets, expected):
    """A PEFT root: its adapter runs the base model, not the root, so the root's FSDP hooks do not run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import dta_fast

    sequences = _batch()
    exp_loss, exp_grads, (old, adv, mask) = expected
    model = _peft_model(targets)
    mesh = init_device_mesh("cpu", (world,))
    if shard_layers:
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss_fn = PolicyGradientLoss(old, adv, mask, 0.2, 0.28, "token_mean")
    _, loss, _ = dta_fast.distributed_tree_backward(model, sequences, loss_fn, max_chunk_tokens=9)
    torch.testing.assert_close(loss, exp_loss, rtol=1e-5, atol=1e-5)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(isinstance(p, DTensor) for p in model.parameters())  # sharded again
    scale = max(g.abs().max().item() for g in exp_grads)
    for p, g in zip(trainable, exp_grads):
        torch.testing.assert_close(p.grad.full_tensor(), g, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize(
    "shard_layers,targets",
    [(False, ["q_proj", "v_proj"]), (True, ["lm_head"])],
    ids=["root_only", "adapters_in_the_root_group"],
)
def test_fsdp2_peft_root(tmp_path, shard_layers, targets):
    """Every trainable parameter in the root's group (the root sharded alone, or LoRA on the head only):
    no sharded module below the root trains, and the root's hooks do not run under PEFT, so the reduction
    must not wait for FSDP to queue its final callback (it gave unreduced, unsharded gradients)."""
    pytest.importorskip("peft")
    sequences = _batch()
    model = _peft_model(targets)
    tree = PrefixTree.from_sequences(sequences)
    flat = dta_ref.flat_logprobs(model, sequences)
    old, adv, mask = _loss_inputs(tree, flat)
    loss = dta_ref.policy_gradient_loss(flat, old, adv, mask, 0.2, 0.28, "token_mean")
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    expected = (loss.detach(), [g.detach() for g in grads], (old, adv, mask))
    args = (_check_fsdp_peft_rank, shard_layers, targets, expected)
    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "init"), *args), nprocs=2, join=True)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_many_chunks(tmp_path, world):
    """Many chunks, recomputed: every chunk's backward accumulates locally, one reduce-scatter at the end."""
    _spawn_fsdp(tmp_path, world, max_chunk_tokens=7)


def test_fsdp2_one_chunk(tmp_path):
    _spawn_fsdp(tmp_path, 2)


def test_fsdp2_kept_graphs(tmp_path):
    """recompute=False: several forwards run before their backwards."""
    _spawn_fsdp(tmp_path, 2, max_chunk_tokens=5, recompute=False)


def test_fsdp2_generic_loss(tmp_path):
    """A loss that is not a TokenLoss: a forward-only pass first, then the chunked backward."""
    _spawn_fsdp(tmp_path, 2, generic=True, max_chunk_tokens=5)


def test_fsdp2_empty_shards_take_part(tmp_path):
    _spawn_fsdp(tmp_path, 3, batch="duplicates", shards=[[], [0, 1, 2, 3], []], max_chunk_tokens=3)


def test_fsdp2_next_steps(tmp_path):
    """An optimizer step and a second call work, and FSDP's own settings (mean reduction) are back."""
    _spawn_fsdp(tmp_path, 2, next_step=True, max_chunk_tokens=6)


def test_fsdp2_hf_model(tmp_path):
    pytest.importorskip("transformers")
    _spawn_fsdp(tmp_path, 2, kind="qwen3", max_chunk_tokens=9)


def _check_fsdp_after_a_failure(world, expected, failure):
    """A call that fails on one rank (the others trained their whole shard) leaves no gradient behind for
    the next call to reduce: the retry gives the whole batch's gradient, on top of what was there. A
    SystemExit on rank 1 stays itself there; rank 0 raises the error that names it."""
    import dta_fast

    sequences = _batch()
    _, exp_grads, (_, adv, _) = expected
    model = _fsdp_model("decoder", world)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    loss_fn = _generic_loss(adv)

    def failing(i, lp):
        if failure == "exception" and i == len(sequences) - 1:
            raise ZeroDivisionError("boom")
        if failure == "exit" and dist.get_rank() == 1:
            raise SystemExit("preempted")
        return loss_fn(i, lp)

    expected_error = (RuntimeError, "ZeroDivisionError: boom")
    if failure == "exit":
        expected_error = (SystemExit, "preempted") if dist.get_rank() == 1 else (RuntimeError, "rank 1: SystemExit")
    with pytest.raises(expected_error[0], match=expected_error[1]):
        dta_fast.distributed_tree_backward(model, sequences, failing, max_chunk_tokens=4)
    for p in model.parameters():
        torch.testing.assert_close(p.grad.full_tensor(), torch.full_like(p.full_tensor(), 0.25), rtol=0, atol=0)
    dta_fast.distributed_tree_backward(model, sequences, loss_fn, max_chunk_tokens=4)
    _assert_whole_gradient(model, exp_grads, 1e-10, already=0.25)


@pytest.mark.parametrize("failure", ["exception", "exit"])
def test_fsdp2_retry_after_a_failed_call(tmp_path, failure):
    expected = _expected("decoder", _batch(), True)
    args = (2, str(tmp_path / "init"), _check_fsdp_after_a_failure, expected, failure)
    mp.spawn(_fsdp_worker, args=args, nprocs=2, join=True)


def _check_fsdp_misuse(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dta_fast

    model = _model("decoder")
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    with pytest.raises(ValueError, match="root module too"):
        dta_fast.distributed_tree_backward(model, _batch(), lambda i, lp: lp.sum())
    model = _fsdp_model("decoder", world)
    alone = dist.new_group([0])
    if dist.get_rank() == 0:  # the batch split over fewer ranks than the model is sharded over
        with pytest.raises(ValueError, match="sharded over ranks"):
            dta_fast.distributed_tree_backward(model, _batch(), lambda i, lp: lp.sum(), group=alone)


def test_fsdp2_misuse(tmp_path):
    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "init"), _check_fsdp_misuse), nprocs=2, join=True)


def _check_nccl_fsdp_rank(rank, world, expected):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dta_fast

    exp_loss, exp_grads, (old, adv, mask) = expected
    model = _model("decoder").float().cuda()
    mesh = init_device_mesh("cuda", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss_fn = PolicyGradientLoss(old, adv, mask, 0.2, 0.28, "token_mean")
    for recompute in (True, False):
        model.zero_grad()
        _, loss, _ = dta_fast.distributed_tree_backward(
            model, _batch(), loss_fn, max_chunk_tokens=8, recompute=recompute
        )
        torch.testing.assert_close(loss.cpu(), exp_loss, rtol=1e-4, atol=1e-5)
        scale = max(g.abs().max().item() for g in exp_grads)
        for p, g in zip(model.parameters(), exp_grads):
            torch.testing.assert_close(p.grad.full_tensor().double().cpu(), g, rtol=0, atol=1e-4 * scale)


@pytest.mark.gpu
def test_nccl_fsdp2(tmp_path):
    """FSDP2 on GPUs with NCCL and the Triton kernel: float32 sums (no PREMUL_SUM), recomputed and kept graphs."""
    _spawn_nccl(tmp_path, _check_nccl_fsdp_rank)


# ----------------------------------------------------------- errors agreed across ranks


def _check_errors_agreed(rank, world):
    """A bad input on one rank raises the same clear error on every rank, in seconds, and the group stays usable."""
    import time

    import dta_fast

    sequences = _batch()
    model = _model("decoder")
    vocab = model.embed.num_embeddings
    shards = [list(range(0, len(sequences), 2)), list(range(1, len(sequences), 2))]
    tree = PrefixTree.from_sequences(sequences)
    old = torch.zeros(tree.seq_index.shape[0], tree.max_length - 1, dtype=torch.float64)
    adv = torch.ones(tree.num_sequences, dtype=torch.float64)
    good = PolicyGradientLoss(old, adv, tree.logprob_mask)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)

    def bad_token():  # rank 1's shard holds a token outside the vocabulary; rank 0's is fine
        seqs = [list(s) for s in sequences]
        seqs[shards[1][0]][-1] = vocab + 7
        return seqs, good

    def wrong_shape():  # rank 1 passes a loss built for other logprobs
        return sequences, good if rank == 0 else PolicyGradientLoss(old[:, :-1], adv, tree.logprob_mask[:, :-1])

    def mask_past_end():  # rank 1's loss masks a token past a sequence's end
        mask = tree.logprob_mask.clone()
        mask[shards[1][0], -1] = True
        mask[shards[1][0], : int(tree.lengths[shards[1][0]]) - 1] = True
        return sequences, good if rank == 0 else PolicyGradientLoss(old, adv, mask)

    def loss_raises():  # a generic loss that fails while rank 1 trains
        def loss_fn(i, lp):
            if i == shards[1][-1]:
                raise ZeroDivisionError("no reward for this sequence")
            return lp.sum()

        return sequences, loss_fn

    def other_batch():  # rank 1 passes its own rollouts: one token differs
        seqs = [list(s) for s in sequences]
        if rank == 1:
            seqs[3][-1] = (seqs[3][-1] + 1) % vocab
        return seqs, good

    def shorter_batch():  # rank 1 passes a batch without its last sequence
        return (sequences if rank == 0 else sequences[:-1]), good

    cases = [
        (other_batch, ValueError, r"rank 1: ValueError: sequence 3 differs from rank 0's: every rank must pass"),
        (
            shorter_batch,
            ValueError,
            rf"rank 1: ValueError: this rank's batch has {len(sequences) - 1} sequences, "
            rf"rank 0's {len(sequences)}",
        ),
        (bad_token, ValueError, rf"rank 1: ValueError: token id {vocab + 7} is out of range"),
        (wrong_shape, ValueError, r"rank 1: ValueError: loss_fn was built for logprobs of shape"),
        (mask_past_end, ValueError, r"rank 1: ValueError: the loss mask is True at step"),
        (loss_raises, RuntimeError, r"rank 1: ZeroDivisionError: no reward for this sequence"),
    ]
    before = [p.grad.clone() for p in model.parameters()]
    for make, error, match in cases:
        seqs, loss_fn = make()
        start = time.monotonic()
        with pytest.raises(error, match=match):
            dta_fast.distributed_tree_backward(model, seqs, loss_fn, plan=shards, max_chunk_tokens=6)
        assert time.monotonic() - start < 20, f"{make.__name__}: the ranks took too long to agree"
        for p, g in zip(model.parameters(), before):  # .grad as before the call
            assert torch.equal(p.grad, g)

    # a SystemExit (or KeyboardInterrupt) inside one rank's step stays itself there; the other rank is
    # told, instead of waiting in a collective for the group's timeout
    def exits(i, lp):
        if i == shards[1][-1]:
            raise SystemExit("preempted")
        return lp.sum()

    start = time.monotonic()
    expected = (SystemExit, "preempted") if rank == 1 else (RuntimeError, r"rank 1: SystemExit: preempted")
    with pytest.raises(expected[0], match=expected[1]):
        dta_fast.distributed_tree_backward(model, sequences, exits, plan=shards, max_chunk_tokens=6)
    assert time.monotonic() - start < 20, "the ranks took too long to agree"
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad, g)
    # models that would pair collectives of other shapes, or another number of them, are refused first
    weight = model.embed.weight
    for change, match in [
        (
            lambda: weight.requires_grad_(rank == 0),
            r"rank 1: ValueError: trainable parameter 'layers.0.*' is .* "
            r"here, 'embed.weight' \[64, 32\] torch.float64 on rank 0",
        ),
        (
            lambda: setattr(weight, "data", weight.data.to(torch.float64 if rank == 0 else torch.float32)),
            r"rank 1: ValueError: trainable parameter 'embed.weight' is \[64, 32\] torch.float32 here",
        ),
    ]:
        change()
        with pytest.raises(ValueError, match=match):
            dta_fast.distributed_tree_backward(model, sequences, good, plan=shards)
        weight.requires_grad_(True)
        weight.data = weight.data.double()
        for p, g in zip(model.parameters(), before):
            assert torch.equal(p.grad, g)
    # a bad option passed by the rank whose shard is empty is refused there too, not skipped
    everything = [list(range(len(sequences))), []]
    for bad, exc, match in (
        (dict(max_chunk_tokens=0), ValueError, "max_chunk_tokens must be >= 1"),
        (dict(max_chunk_token=8), TypeError, "unexpected keyword argument 'max_chunk_token'"),
    ):
        with pytest.raises(exc, match=f"rank 1: {exc.__name__}: .*{match}"):
            dta_fast.distributed_tree_backward(model, sequences, good, plan=everything, **(bad if rank == 1 else {}))
        for p, g in zip(model.parameters(), before):
            assert torch.equal(p.grad, g)
    # a sparse gradient on rank 0 while rank 1's shard is empty: refused on both, not a hang in the reduction
    model.embed.sparse = True
    with pytest.raises(ValueError, match=r"rank 0: ValueError: parameter 'embed.weight' got a sparse gradient"):
        dta_fast.distributed_tree_backward(model, sequences, good, plan=[list(range(len(sequences))), []])
    model.embed.sparse = False
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad, g)
    # the collectives stayed paired: a good call afterwards works on every rank
    logprobs, loss, indices = dta_fast.distributed_tree_backward(model, sequences, good, plan=shards)
    assert indices == shards[rank] and torch.isfinite(loss)


def _timeout_worker(rank, world, init_file, check):
    """A gloo group whose collectives time out after 60 s: a hang fails the test instead of stalling it."""
    import datetime

    sys.path.insert(0, ROOT)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        check(rank, world)
        dist.barrier()
    finally:
        _destroy_group()


def test_errors_agreed_across_ranks(tmp_path):
    mp.spawn(_timeout_worker, args=(2, str(tmp_path / "init"), _check_errors_agreed), nprocs=2, join=True)
