"""FSDP2 (``fully_shard``) models in :func:`dta_fast.distributed_tree_backward`.

FSDP2 all-gathers a module's parameters in its forward hooks and
reduce-scatters its gradients in its backward hooks, every forward and every
backward. The tree engine runs many of both, and how many depends on the
rank's shard, so the ranks' collectives would not pair up (a hang, or sums of
unrelated tensors). For the length of the call, then:

- every FSDP module is unsharded once, up front (the same all-gathers on every
  rank, in the same order), and kept whole: no reshard after forward or after
  backward, so the hooks communicate nothing while the shard trains;
- gradient sync is off, so each backward adds into the whole (unsharded)
  gradients locally;
- at the end, sync goes back on with a divide factor of 1 and sum-only
  collectives (the loss is a sum over sequences, not a mean over ranks), and
  a forward and backward of one token with a zero cotangent runs every
  module's post-backward hook once (FSDP's final callback, queued here too,
  runs those whose hooks did not fire): each reduce-scatters its accumulated
  gradient into its sharded ``.grad`` (FSDP2 adds to a ``.grad`` already
  there) and reshards as the model was set up to;
- the model's own FSDP settings are put back.

Parameters and gradients are whole on every rank during the call (sharded
again on return), so the memory FSDP2 saves here is that of the optimizer
state and of everything between calls.

FSDP2 has setters but no getters for these settings, so saving and restoring
them reads the parameter groups' attributes; both the list of groups of torch
2.12 and later and the single group of earlier versions are handled.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from dta_ref.adapter import adapt

# per parameter group: what the setters used here change
_GROUP_SETTINGS = (
    "reduce_grads",
    "all_reduce_grads",
    "post_forward_mesh_info",  # reshard after forward (None: no)
    "reshard_after_backward",
    "gradient_divide_factor",
    "force_sum_reduction_for_comms",
)


def is_fsdp2(module) -> bool:
    # A module can only be sharded with FSDP2 once torch.distributed.fsdp is loaded, so look it up
    # rather than import it: the import is slow, and made after init_process_group it keeps a gloo
    # group alive past destroy_process_group (a crash at interpreter exit in torch 2.13).
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None)  # None in a torch without FSDP2
    return fsdp_module is not None and isinstance(module, fsdp_module)


def check_root_sharded(model) -> None:
    """FSDP2 submodules under a root that is not sharded: the root's own parameters would never be reduced."""
    if not is_fsdp2(model) and any(is_fsdp2(m) for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__} has fully_shard submodules but is not sharded itself: "
            "apply fully_shard to the root module too (after its layers), as FSDP2 expects"
        )


def _param_groups(module) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: a list
    if groups is None:
        group = state._fsdp_param_group  # earlier: one group or None
        groups = [] if group is None else [group]
    return list(groups)


class _SavedSettings:
    """The FSDP settings of every module under ``root``, to put back after the call."""

    def __init__(self, root):
        modules = [m for m in root.modules() if is_fsdp2(m)]
        groups = [g for m in modules for g in _param_groups(m)]
        self.groups = [(g, {name: getattr(g, name) for name in _GROUP_SETTINGS}) for g in groups]
        # set_reshard_after_forward also clears this flag (used at lazy init)
        self.auto_reshard = [(s, s._auto_reshard_after_forward) for s in (m._get_fsdp_state() for m in modules)]
        self.context = root._get_fsdp_state()._state_ctx  # shared by all states after lazy init
        self.is_last_backward = self.context.is_last_backward

    def restore(self) -> None:
        for group, values in self.groups:
            for name, value in values.items():
                setattr(group, name, value)
        for state, value in self.auto_reshard:
            state._auto_reshard_after_forward = value
        self.context.is_last_backward = self.is_last_backward


def _check_same_ranks(root, group) -> None:
    """FSDP2 must reduce over exactly the ranks the batch was split across."""
    ranks = sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    for module in (m for m in root.modules() if is_fsdp2(m)):
        for param_group in _param_groups(module):
            mesh_ranks = sorted(param_group.mesh_info.mesh.mesh.flatten().tolist())
            if mesh_ranks != ranks:
                raise ValueError(
                    f"the model is sharded over ranks {mesh_ranks} but the batch is split over ranks {ranks}: "
                    "pass the FSDP mesh's process group as group"
                )


def _keep_whole(root) -> None:
    """Settings while the shard trains: no communication in any hook, gradients kept locally."""
    root.set_requires_gradient_sync(False)
    root.set_reshard_after_forward(False)
    root.set_reshard_after_backward(False)
    root.set_is_last_backward(True)  # every backward's end waits on its own work


def _drop_unreduced(root) -> None:
    """Forget the whole gradients a failed call accumulated: kept on the unsharded parameters, the next
    call would reduce them with its own. The sharded ``.grad`` from before the call stays."""
    for param in root.parameters():  # the whole (unsharded) parameters while the call holds them
        param.grad = None
    for module in (m for m in root.modules() if is_fsdp2(m)):
        for group in _param_groups(module):
            for fsdp_param in group.fsdp_params:
                if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                    fsdp_param.unsharded_accumulated_grad = None  # where a reduce dtype keeps them


def _reduce_once(root) -> None:
    """One reduce-scatter per FSDP parameter group of the gradients accumulated on this rank."""
    for param in root.parameters():  # whole parameters now; a rank with no shard contributes zeros
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)
    root.set_requires_gradient_sync(True)
    root.set_reshard_after_forward(False)  # still whole: no all-gather again in this backward
    for module in (m for m in root.modules() if is_fsdp2(m)):
        module.set_gradient_divide_factor(1.0)  # a sum over ranks, not FSDP's mean
        module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    root.set_is_last_backward(True)
    token = torch.zeros(1, 1, dtype=torch.long, device=next(root.parameters()).device)
    state = root._get_fsdp_state()
    with torch.enable_grad():
        # a backward even where no parameter on the path trains; a zero cotangent adds nothing
        out = adapt(root).logits(token) + torch.zeros((), device=token.device, requires_grad=True)
        # FSDP's final callback reduce-scatters every group whose own backward hook did not run; FSDP
        # queues it from a sharded module's backward, which may not come (the adapter runs a PEFT root's
        # base model, not the root; nothing sharded below the root may train), so queue it here too
        out.register_hook(lambda grad: state._register_root_post_backward_final_callback())
        torch.autograd.backward(out, torch.zeros_like(out))


def fsdp2_shard_backward(root, run_shard, group):
    """``run_shard(module)`` on the whole (unsharded) model, then one reduction of its gradients.

    Returns what ``run_shard`` returns. Gradients already in the sharded
    ``.grad`` are kept and added to; the model's FSDP settings are unchanged.
    ``run_shard`` must fail on every rank or on none (the caller agrees on it):
    then nothing is reduced and the modules are resharded.
    """
    if not hasattr(root, "set_force_sum_reduction_for_comms"):
        raise RuntimeError(
            f"FSDP2 models need a torch with FSDPModule.set_force_sum_reduction_for_comms, got {torch.__version__}"
        )
    # the root must claim the other FSDP modules before any of their hooks runs (as its first forward would)
    root._get_fsdp_state()._lazy_init()
    _check_same_ranks(root, group)
    saved = _SavedSettings(root)
    try:
        _keep_whole(root)
        handles = [m.unshard(async_op=True) for m in root.modules() if is_fsdp2(m)]
        for handle in handles:
            handle.wait()
        try:
            result = run_shard(root)
        except BaseException:  # every rank fails here together (distributed.py agrees first): no reduction
            _drop_unreduced(root)
            for module in (m for m in root.modules() if is_fsdp2(m)):
                module.reshard()
            raise
        saved.restore()  # reshard after backward (or not) as the model was set up to
        _reduce_once(root)
    finally:
        saved.restore()
    return result
