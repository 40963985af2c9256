"""Distributed tree training: partition the batch across ranks, train each shard as a tree, reduce once.

Every rank passes the same full batch and the same ``loss_fn(i, logprobs_i)``
(i is the global sequence index). Rank 0 partitions the batch and sends the
plan to the others, with a hash of each sequence that the others check
their batch against; each rank runs :func:`dta_fast.tree_backward` on its own shard, and
the parameter gradients are summed over ranks, so every rank ends with the
gradient of the whole batch's loss, the same as one process training the
whole batch. A model wrapped with FSDP2 (``fully_shard``) is handled in
:mod:`dta_fast.fsdp2`.

No rank waits on a rank that failed: each rank checks its shard (its tree,
token ids, the loss built for it) and then trains it inside a guard, and the
ranks agree on "did anyone fail" before the first gradient collective and
before the reduction. If one did, every rank raises the same error, naming
the rank and its message, within the time of one small all-reduce.
"""

from __future__ import annotations

import contextlib
import operator
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from dta_ref.adapter import adapt
from dta_ref.logprobs import logprob_dtype
from dta_ref.losses import TokenLoss
from dta_ref.multimodal import pack_images
from dta_ref.tree import _as_token_list

from .chunked import checked_options, tree_backward
from .fsdp2 import check_root_sharded, fsdp2_shard_backward, is_fsdp2
from .partition import partition
from .tree import build_tree


def _unwrap(model):
    """The module to run and a context that keeps a DDP wrapper from reducing on its own.

    An FSDP2 model (``is_fsdp2``) runs as it is: ``fsdp2_shard_backward``
    arranges its one reduction.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module, model.no_sync()
    check_root_sharded(model)
    return model, contextlib.nullcontext()


def _checked_shards(plan, num_sequences, world) -> list[list[int]]:
    """A user's plan as shard lists, or a clear error: one list per rank, every sequence exactly once."""
    shards = getattr(plan, "shards", plan)
    if not isinstance(shards, (list, tuple)) or len(shards) != world:
        raise ValueError(f"plan must give one list of sequence indices per rank ({world}), got {shards!r:.80}")
    try:
        shards = [[_index(i) for i in shard] for shard in shards]
    except TypeError:
        raise TypeError(f"plan must hold integer sequence indices, got {shards!r:.80}") from None
    if sorted(i for shard in shards for i in shard) != list(range(num_sequences)):
        raise ValueError(f"plan must place each of the {num_sequences} sequences on exactly one rank")
    return shards


def _index(i) -> int:
    """An integer index; a bool (True is 1 to ``operator.index``) is a mistake, not sequence 1."""
    if isinstance(i, (bool, np.bool_)) or (isinstance(i, torch.Tensor) and i.dtype == torch.bool):
        raise TypeError("a bool is not a sequence index")
    return operator.index(i)


def _trainable(model) -> list[tuple[str, tuple, str]]:
    """Name, shape and dtype of each trainable parameter: what every rank's model must agree on, since
    each one is all-reduced (a mismatch would abort or hang the collective, not raise). Not a module:
    none here; ``prepare`` names the mistake."""
    if not isinstance(model, torch.nn.Module):
        return []
    return [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters() if p.requires_grad]


def _check_same_trainable(mine: list, rank0: list) -> None:
    """A clear error where this rank's trainable parameters are not rank 0's (``_trainable`` of each)."""
    for (name, shape, dtype), (name0, shape0, dtype0) in zip(mine, rank0):
        if (shape, dtype) != (shape0, dtype0):
            raise ValueError(
                f"trainable parameter {name!r} is {list(shape)} {dtype} here, {name0!r} {list(shape0)} "
                f"{dtype0} on rank 0: every rank must train the same model"
            )
    if len(mine) != len(rank0):
        raise ValueError(
            f"this rank's model has {len(mine)} trainable parameters, rank 0's {len(rank0)}: every "
            "rank must train the same parameters (requires_grad alike)"
        )


def _fingerprints(sequences) -> list[int]:
    """A hash of each sequence's tokens: what a rank compares with rank 0's to learn that it was given
    another batch (its own rollouts, another order), which rank 0's plan would split into wrong shards."""
    return [hash(tuple(_as_token_list(seq, i))) for i, seq in enumerate(sequences)]


def _check_same_batch(mine: list[int], rank0: list[int]) -> None:
    """A clear error where this rank's batch is not rank 0's (``_fingerprints`` of each)."""
    if len(mine) != len(rank0):
        raise ValueError(
            f"this rank's batch has {len(mine)} sequences, rank 0's {len(rank0)}: every rank must "
            "pass the same full batch"
        )
    for i, (a, b) in enumerate(zip(mine, rank0)):
        if a != b:
            raise ValueError(f"sequence {i} differs from rank 0's: every rank must pass the same full batch")


def _shared_plan(model, sequences, world, cost_model, plan, rank, group):
    """Rank 0 partitions (or checks the given plan) and sends it (or its error) to all, so ranks agree
    and none waits forever; with it, the fingerprints of its batch (``_check_same_batch``) and its
    trainable parameters (``_check_same_trainable``)."""
    message, interrupt = [None], None
    if rank == 0:
        try:
            if plan is None:
                shards = partition(sequences, world, cost_model).shards
            else:
                shards = _checked_shards(plan, len(sequences), world)
            message[0] = ("ok", (shards, _fingerprints(sequences), _trainable(model)))
        except BaseException as error:  # any: the other ranks are waiting in the broadcast below
            message[0] = (type(error).__name__, str(error))
            if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: itself here, after the others learn
                interrupt = error
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(message, src=src, group=group)
    if interrupt is not None:
        raise interrupt
    status, payload = message[0]
    if status in ("TypeError", "ValueError"):
        raise (TypeError if status == "TypeError" else ValueError)(payload)
    if status != "ok":
        raise RuntimeError(f"distributed_tree_backward failed on rank 0 while planning: {status}: {payload}")
    return payload


class DistributedResult(NamedTuple):
    """What :func:`distributed_tree_backward` returns; unpacks as ``logprobs, loss, indices``."""

    logprobs: torch.Tensor  # this rank's sequences' logprobs [n, Lmax-1], detached
    loss: torch.Tensor  # the whole batch's total loss, the same on every rank
    indices: list  # global indices of this rank's sequences, in the rows' order


def _agree(error: BaseException | None, group) -> None:
    """Every rank learns whether any rank of ``group`` failed; then all raise the same error.

    Costs one all-reduce of one integer when nothing failed.
    """
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    failed = torch.tensor([0 if error is None else 1], device=device)
    dist.all_reduce(failed, group=group)
    if int(failed.item()) == 0:
        return
    world = dist.get_world_size(group)
    mine = None if error is None else (type(error).__name__, str(error))
    reports = [None] * world
    dist.all_gather_object(reports, mine, group=group)
    failures = [(r, kind, text) for r, report in enumerate(reports) if report is not None for kind, text in [report]]
    kinds = {kind for _, kind, _ in failures}
    cls = TypeError if kinds == {"TypeError"} else ValueError if kinds <= {"ValueError", "TypeError"} else RuntimeError
    message = "distributed_tree_backward failed on " + "; ".join(
        f"rank {r}: {kind}: {text}" for r, kind, text in failures
    )
    raise cls(message) from error


def _guarded(step, group):
    """``step()`` on every rank, then agreement: its result, or the same error on every rank. A
    KeyboardInterrupt or SystemExit stays itself on the rank that met it; the others raise the error
    that names it, instead of waiting for that rank in a collective until the group's timeout."""
    try:
        result, error = step(), None
    except BaseException as caught:  # any failure: the other ranks must not wait on this one
        result, error = None, caught
    try:
        _agree(error, group)
    except Exception:
        if error is not None and not isinstance(error, Exception):
            raise error from None
        raise
    return result


def distributed_tree_backward(model, sequences, loss_fn, *, group=None, cost_model=None, plan=None, **options):
    """Train the whole batch across the ranks of ``group``; every rank's ``.grad`` gets the whole gradient.

    ``model``: a plain module (its gradients are all-reduced here), a
    ``DistributedDataParallel`` wrapper (run under ``no_sync`` and reduced here
    once, so nothing is reduced twice) or an FSDP2 (``fully_shard``) model,
    root included (kept whole for the call, then reduce-scattered by FSDP
    once, as a sum: ``.grad`` is this rank's shard of the whole gradient;
    docs/distributed.md). ``plan``: which sequences each rank
    trains, a :class:`dta_fast.Partition` or one list of indices per rank (as
    rank 0 sees it); by default ``partition(sequences, world_size, cost_model)``.
    ``options`` go to ``tree_backward``
    (``max_chunk_tokens``, ``memory_budget_bytes``, ``recompute``, ...);
    ``images=(pixel_values, image_grid_thw)``, per sequence as
    ``dta_ref.pack_images`` takes them: each rank packs its shard's.
    Gradients already in ``.grad`` are kept and added to, not reduced again.

    Returns a :class:`DistributedResult` ``(logprobs, loss, indices)``, the
    order of ``tree_backward``'s ``(logprobs, loss)``: this rank's
    per-sequence logprobs, the whole batch's total loss (the same on every
    rank) and the global indices of this rank's sequences.

    An error on any rank (a bad token in its shard, a loss built for another
    shape, a failure while training) makes every rank raise the same
    ValueError/TypeError/RuntimeError naming the rank, before any gradient
    is reduced (a KeyboardInterrupt or SystemExit stays itself on its rank);
    ``.grad`` is then as it was before the call (plain, DDP and FSDP2 models).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("distributed_tree_backward needs an initialised torch.distributed process group")
    images = options.pop("images", None)
    if images is not None and (
        not isinstance(images, (tuple, list)) or len(images) != 2 or any(len(x) != len(sequences) for x in images)
    ):
        raise ValueError(
            "images must be (pixel_values, image_grid_thw), one entry of each per sequence as "
            "dta_ref.pack_images takes them (each rank packs its shard's)"
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this process is not a member of group: call distributed_tree_backward on its ranks only")
    shards, rank0_batch, rank0_trainable = _shared_plan(model, sequences, world, cost_model, plan, rank, group)
    shard = shards[rank]

    def prepare():
        """This rank's checks before any gradient collective: its batch, the module, its shard's tree and loss."""
        if rank != 0:
            _check_same_batch(_fingerprints(sequences), rank0_batch)
            _check_same_trainable(_trainable(model), rank0_trainable)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(i, logprobs_i), got {type(loss_fn).__name__}")
        module, no_sync = _unwrap(model)
        if not shard:
            return module, no_sync, None, None, None
        try:
            if images is None:
                tree, packed = build_tree([sequences[i] for i in shard]), None
            else:  # this shard's images, packed with its tree (each distinct image encoded once per rank)
                pixels, grids = ([x[i] for i in shard] for x in images)
                tree, packed = pack_images(module, [sequences[i] for i in shard], pixels, grids)
        except (TypeError, ValueError):
            for i in shard:  # name the bad sequence by its index in the batch, not in this rank's shard
                _as_token_list(sequences[i], i)
            raise
        adapt(module).check_token_ids(tree.tokens)
        if isinstance(loss_fn, TokenLoss):
            if loss_fn.shape[0] != len(sequences):
                raise ValueError(f"loss_fn was built for {loss_fn.shape[0]} sequences, the batch has {len(sequences)}")
            # the whole batch's lengths, as tree_backward on one process checks them: a loss wider than the
            # batch, or a mask past a sequence's end (named by its index in the batch)
            loss_fn.check_lengths(torch.tensor([len(sequences[i]) for i in range(len(sequences))]))
            local_fn = loss_fn.rows(shard, min(tree.max_length - 1, loss_fn.shape[1]))  # moved to the GPU once
        else:

            def local_fn(j, lp):
                return loss_fn(shard[j], lp)

        tree.validate(local_fn)
        return module, no_sync, tree, local_fn, packed

    module, no_sync, tree, local_fn, packed = _guarded(prepare, group)

    def run_shard(module):
        """This rank's tree_backward (nothing if its shard is empty): its loss and logprobs."""
        device = next(module.parameters()).device
        if tree is None:
            checked_options(**options)  # refused here too, as on the ranks that train them
            dtype = logprob_dtype(adapt(module).dtype)
            return torch.zeros((), dtype=torch.float64, device=device), torch.zeros(0, 0, dtype=dtype, device=device)
        with no_sync:
            logprobs, loss = tree_backward(module, tree, local_fn, images=packed, **options)
        for name, p in module.named_parameters():
            if p.grad is not None and p.grad.layout != torch.strided:
                raise ValueError(
                    f"parameter {name!r} got a sparse gradient (e.g. nn.Embedding(sparse=True)): "
                    "distributed_tree_backward all-reduces dense gradients; build it with sparse=False"
                )
        return loss.detach().double(), logprobs

    if is_fsdp2(module):  # FSDP2 reduce-scatters once, at the end, adding to the .grad already there
        local_loss, logprobs = fsdp2_shard_backward(module, lambda m: _guarded(lambda: run_shard(m), group), group)
        dist.all_reduce(local_loss, group=group)
        return DistributedResult(logprobs, local_loss, list(shard))

    params = [p for p in module.parameters() if p.requires_grad]
    kept = [p.grad for p in params]  # reduce only this call's gradients
    for p in params:
        p.grad = None
    try:
        local_loss, logprobs = _guarded(lambda: run_shard(module), group)
    except BaseException:  # KeyboardInterrupt and SystemExit too (_guarded)
        for p, g in zip(params, kept):  # as before the call
            p.grad = g
        raise
    # the parameters that got a gradient on some rank (a rank with an empty shard got none); the others keep
    # None, as loss.backward() leaves a parameter the loss does not reach
    reached = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=local_loss.device)
    dist.all_reduce(reached, op=dist.ReduceOp.MAX, group=group)
    reduced = [p for p, r in zip(params, reached.tolist()) if r]
    for p in reduced:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    handles = [dist.all_reduce(p.grad, group=group, async_op=True) for p in reduced]
    dist.all_reduce(local_loss, group=group)
    for h in handles:
        h.wait()
    for p, g in zip(params, kept):
        if g is not None:
            p.grad = g if p.grad is None else p.grad.add_(g)
    return DistributedResult(logprobs, local_loss, list(shard))
