"""Activation checkpointing of decoder layers at a small host cost.

A checkpointed layer keeps only its inputs and recomputes the rest in the backward. torch's non-reentrant
form (the default of transformers 5 and TRL, and what ``dta_ref`` runs) records the forward's graph and
calls Python hooks for every tensor autograd saves, in the forward and again in the recompute; its
reentrant form runs the forward without a graph and, in the backward, recomputes the layer with one and
back-propagates through it. The two give the same gradients from the same kernels on the same inputs
(the random state restored), and keep the same tensors; the reentrant form costs far less host time
(docs/design_notes.md, "The host cost of checkpointing"), which is what a tree step is bound by on
small models, since the tree leaves the GPU fewer tokens than the host has launches.

Reentrant checkpointing has two known limits: its backward accumulates into ``.grad`` (so
``torch.autograd.grad`` and ``backward(inputs=...)`` through it raise torch's error), and it needs an
input that requires gradients. Here it runs only inside dta's trainers and ``tree_backward``, whose
backward is a plain one, and a constant anchor that requires gradients stands in for frozen inputs
(LoRA's frozen embeddings). A layer falls back to the non-reentrant form (or the model's own function)
where the reentrant one could lose gradients or run hooks without a graph: a keyword tensor that
requires gradients, module hooks on the layer (FSDP's gathers), a forward that records router logits,
linear-attention layers (whose chunked states the forward exports), or DDP with
``find_unused_parameters`` (which would find the layers' parameters unused).
``DTA_REENTRANT_CHECKPOINT=0`` turns it off.
"""

from __future__ import annotations

import functools
import os
from contextlib import ExitStack, contextmanager

import torch
from torch.nn.modules import module as _module
from torch.utils.checkpoint import checkpoint

from dta_ref.adapter import adapt
from dta_ref.hf import linear_layers_of

ENABLED = os.environ.get("DTA_REENTRANT_CHECKPOINT", "1") != "0"
# requires gradients and is never used: the recompute's output needs an input that requires them
_ANCHOR = torch.zeros((), requires_grad=True)


def _requires_grad(values) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return True
        if isinstance(v, (tuple, list)) and _requires_grad(v):
            return True
    return False


def _dropping_anchor(forward):
    return lambda *args: forward(*args[:-1])


def reentrant_checkpoint(forward, *args, **kwargs):
    """``forward(*args, **kwargs)`` under torch's reentrant checkpoint (keyword arguments bound to it, an
    anchor where no positional tensor requires gradients), or its non-reentrant one where a keyword tensor
    requires gradients (the reentrant form would not pass them on)."""
    if not ENABLED or _requires_grad(kwargs.values()):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    bound = functools.partial(forward, **kwargs) if kwargs else forward
    if _requires_grad(args):
        return checkpoint(bound, *args, use_reentrant=True)
    return checkpoint(_dropping_anchor(bound), *args, _ANCHOR, use_reentrant=True)


def _model_checkpoint(original, function, *args):
    """transformers' layer call, ``_gradient_checkpointing_func(partial(forward, self, **kwargs), *args)``,
    reentrant where it can be; the model's own function otherwise."""
    keywords = getattr(function, "keywords", None)
    if keywords is None or _requires_grad(keywords.values()):
        return original(function, *args)
    return reentrant_checkpoint(function, *args)


def _hooked(layer) -> bool:
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in layer.modules()
    )


def reentrant_applies(model) -> bool:
    """Whether the layers of ``model`` may run under reentrant checkpointing: on, no global module hooks,
    no hooks on any layer, no linear-attention layers, not in a DDP that looks for unused parameters."""
    if not ENABLED or not torch.is_grad_enabled():
        return False
    if _module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks:
        return False
    adapter = adapt(model)
    if adapter.is_hf and linear_layers_of(adapter.core):
        return False
    # DDP looking for unused parameters would find the layers' (reached only inside the recompute) unused
    if getattr(adapter.data_parallel, "find_unused_parameters", False):
        return False
    return not any(_hooked(layer) for layer in adapter.layers)


def _plain_torch_checkpoint(function) -> bool:
    """``function`` is torch's checkpoint with no options but the mode (not offloading to the host, not
    selective, not a function of the user's)."""
    if isinstance(function, functools.partial):
        return function.func is checkpoint and not function.args and set(function.keywords) <= {"use_reentrant"}
    return function is checkpoint


@contextmanager
def model_checkpointing_reentrant(model, recording: bool = False):
    """For the duration, the layers ``model`` checkpoints itself (Hugging Face's
    ``gradient_checkpointing_enable()``, torch's checkpoint without options) run under reentrant
    checkpointing where :func:`reentrant_applies`; their own function is put back after.
    ``recording``: the forward records outputs through hooks (MoE router logits: transformers installs
    the hooks on the first call that asks), which would record them without a graph: nothing changes."""
    if recording:
        yield
        return
    adapter = adapt(model)
    layers = [
        layer
        for layer in adapter.layers
        if getattr(layer, "gradient_checkpointing", False)
        and _plain_torch_checkpoint(vars(layer).get("_gradient_checkpointing_func"))
    ]
    if not layers or not reentrant_applies(adapter):
        yield
        return
    with ExitStack() as stack:
        for layer in layers:
            original = layer._gradient_checkpointing_func
            layer._gradient_checkpointing_func = functools.partial(_model_checkpoint, original)
            stack.callback(setattr, layer, "_gradient_checkpointing_func", original)
        yield
