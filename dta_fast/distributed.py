"""Distributed tree training: partition the batch across ranks, train each shard as a tree, reduce once.

Every rank passes the same full batch and the same ``loss_fn(i, logprobs_i)``
(i is the global sequence index). Rank 0 partitions the batch and sends the
plan to the others; each rank runs :func:`dta_fast.tree_backward` on its own shard, and
the parameter gradients are summed over ranks, so every rank ends with the
gradient of the whole batch's loss, the same as one process training the
whole batch. A model wrapped with FSDP2 (``fully_shard``) is handled in
:mod:`dta_fast._fsdp2`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from dta_ref.losses import TokenLoss

from ._fsdp2 import check_root_sharded, fsdp2_shard_backward, is_fsdp2
from .engine import tree_backward
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
    shards = [[int(i) for i in shard] for shard in shards]
    if sorted(i for shard in shards for i in shard) != list(range(num_sequences)):
        raise ValueError(f"plan must place each of the {num_sequences} sequences on exactly one rank")
    return shards


def _shared_plan(sequences, world, cost_model, plan, rank, group):
    """Rank 0 partitions (or checks the given plan) and sends it (or its error) to all, so ranks agree
    and none waits forever."""
    message = [None]
    if rank == 0:
        try:
            if plan is None:
                message[0] = ("ok", partition(sequences, world, cost_model).shards)
            else:
                message[0] = ("ok", _checked_shards(plan, len(sequences), world))
        except (TypeError, ValueError) as error:
            message[0] = (type(error).__name__, str(error))
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(message, src=src, group=group)
    status, payload = message[0]
    if status != "ok":
        raise (TypeError if status == "TypeError" else ValueError)(payload)
    return payload


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
    (``max_chunk_tokens``, ``memory_budget_bytes``, ``recompute``, ...).
    Gradients already in ``.grad`` are kept and added to, not reduced again.

    Returns ``(loss, logprobs, indices)``: the whole batch's total loss (the
    same on every rank), and this rank's per-sequence logprobs with the global
    indices of its sequences.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("distributed_tree_backward needs an initialised torch.distributed process group")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(i, logprobs_i), got {type(loss_fn).__name__}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shard = _shared_plan(sequences, world, cost_model, plan, rank, group)[rank]
    module, no_sync = _unwrap(model)

    def run_shard(module):
        """This rank's tree_backward (nothing if its shard is empty): its loss and logprobs."""
        device = next(module.parameters()).device
        if not shard:
            return torch.zeros((), dtype=torch.float64, device=device), torch.zeros(0, 0, device=device)
        tree = build_tree([sequences[i] for i in shard])
        width = tree.max_length - 1
        if isinstance(loss_fn, TokenLoss):
            local_fn = loss_fn.rows(shard, width)  # the shard's rows only, moved to the GPU once
        else:

            def local_fn(j, lp):
                return loss_fn(shard[j], lp)

        with no_sync:
            logprobs, loss = tree_backward(module, tree, local_fn, **options)
        return loss.detach().double(), logprobs

    if is_fsdp2(module):  # FSDP2 reduce-scatters once, at the end, adding to the .grad already there
        local_loss, logprobs = fsdp2_shard_backward(module, run_shard, group)
        dist.all_reduce(local_loss, group=group)
        return local_loss, logprobs, list(shard)

    params = [p for p in module.parameters() if p.requires_grad]
    kept = [p.grad for p in params]  # reduce only this call's gradients
    for p in params:
        p.grad = None
    local_loss, logprobs = run_shard(module)
    for p in params:  # a rank with an empty shard still takes part in every collective
        if p.grad is None:
            p.grad = torch.zeros_like(p)

    handles = [dist.all_reduce(p.grad, group=group, async_op=True) for p in params]
    dist.all_reduce(local_loss, group=group)
    for h in handles:
        h.wait()
    for p, g in zip(params, kept):
        if g is not None:
            p.grad += g
    return local_loss, logprobs, list(shard)
