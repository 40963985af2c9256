"""The memory model of a chunked step: what a plan keeps alive at its worst moment, from the model's
shape (docs/chunked_execution.md, "Memory budget")."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from dta_ref.adapter import adapt
from dta_ref.checks import check_flag, check_int, check_tree
from dta_ref.hf import linear_layers_of, linear_module_of, text_config_of
from dta_ref.logprobs import logprob_dtype
from dta_ref.tree import PrefixTree

from ..logprobs import head_weight, window_rows
from .options import checked_options
from .plan import ChunkPlan, plan_chunks


@dataclass(frozen=True)
class MemoryModel:
    """What a step keeps alive beyond the weights and their gradients: bytes per token from the model's
    shape, and the vocabulary head's transients (docs/chunked_execution.md, "Memory budget")."""

    activation: int  # what autograd saves per chunk token, all layers
    kv: int  # one token's K/V, all layers
    kv_grad: int  # its gradient accumulators (at least float32)
    head_row: int  # the head's backward, per row of its logits window
    head_weight: int  # ... and beside the window: the weight-sized gradient the windows add into
    logits_rows: int  # rows of the default window (a plan may run a smaller one)
    closing: int  # the end of a chunk's backward: the embedding's weight-sized gradients
    new_grads: int = 0  # parameter gradients the step creates: none exists yet when its first backward starts
    # with every layer under activation checkpointing (docs/chunked_execution.md, "Checkpointed layers"):
    checkpointed: int = 0  # what a chunk's graph keeps per token: each layer's input
    layer: int = 0  # one layer's activations and backward temporaries per token, while its backward recomputes it
    layer_kv: int = 0  # one layer's K/V per token: its copies for attention live as long
    model_checkpoints: bool = False  # the model checkpoints every layer itself (plans can only be so)
    linear_backward: int = 0  # per chunk token: a linear-attention mixer's backward temporaries (twice what it saves)
    linear_state: int = 0  # per exported token (a later chunk continues from it): its recurrent states and gradients

    @classmethod
    def of(cls, model, head=None) -> MemoryModel:
        """The model's, with ``head`` as its output head (None: its vocabulary head; a value head's last
        linear layer stands for it)."""
        adapter = adapt(model)
        shape, weight = adapter.shape, head_weight(adapter.head) if head is None else _output_weight(head)
        vocab, w = weight.shape[0], weight.element_size()
        W = weight.numel() * w
        z = torch.finfo(logprob_dtype(weight.dtype)).bits // 8
        # a window's backward: its float32 gradient, formed in place of its log-probabilities, and the
        # gradient's cast (z + w per logit), beside the one buffer the windows' weight gradients are
        # summed into (W)
        cast = w if w != z else 0
        size, own, linear = shape.bytes_per_element, adapter.checkpointed_layers, shape.linear_layers
        mixer, conv = linear_mixer_bytes(adapter.core) if linear else (0, 0)
        # K/V of the attention layers, the convolution inputs of the linear-attention ones (a chunk keeps both)
        kv = (shape.layers - linear) * shape.kv_heads * (shape.head_dim + shape.value_dim) + linear * conv
        layer, trunk = _layer_bytes_per_token(shape), _trunk_bytes_per_token(shape)
        checkpointed = shape.layers * shape.hidden * size + trunk + 2 * shape.head_dim * size  # + RoPE's cos, sin
        # a linear-attention layer: its mixer as measured, the norms and the MLP as an attention layer's
        linear_layer = _norms_and_mlp_bytes_per_token(shape) + mixer
        saved = (shape.layers - linear) * layer + linear * linear_layer if own == 0 else (shape.layers - own) * layer
        return cls(
            # 2% over the closed form: what autograd saves beyond it (docs/design_notes.md, calibration)
            activation=(saved + own * shape.hidden * size + trunk) * 51 // 50,
            kv=kv * size,
            kv_grad=kv * max(size, 4),
            head_row=(z + cast) * vocab,
            head_weight=W,
            logits_rows=window_rows(vocab),
            closing=2 * W,
            new_grads=unset_grad_bytes(model),
            checkpointed=checkpointed * 51 // 50,
            # ... and its backward's temporaries: about three MLP-intermediate-sized gradients (a linear-attention
            # layer's, with its mixer's own temporaries, where it is the larger)
            layer=(max(layer, linear_layer + 2 * mixer if linear else 0) + 3 * shape.intermediate * size) * 51 // 50,
            layer_kv=kv * size // max(shape.layers - linear, 1),
            model_checkpoints=own == shape.layers,
            linear_backward=2 * mixer,
            linear_state=2 * linear * linear_state_bytes(adapter.core) if linear else 0,
        )

    def head(self, logits_rows: int | None = None) -> int:
        """The head's backward with a full window of ``logits_rows`` rows (None: the default)."""
        return self.head_row * (logits_rows or self.logits_rows) + self.head_weight

    def step_bytes(self, plan: ChunkPlan) -> int:
        """The largest, over chunks, of what is alive when the chunk's backward starts (the head's) or ends.

        Its graph holds its K/V copies: the concatenation of prefix and own K/V and the copy of its
        value rows that isolation makes (P + L tokens). With recompute, the graph is the running
        chunk's, and a chunk that stays open holds its own K/V twice (from its first forward, and in
        the recomputed graph); without, every open chunk keeps its graph. The head's window holds at
        most the chunk's rows.
        """
        if plan.num_chunks == 0:
            return self.head_weight
        L, P = plan.lengths, plan.prefix_tokens
        head = self.head_row * np.minimum(L, plan.logits_rows or self.logits_rows) + self.head_weight
        if plan.checkpoint_layers:
            # the graphs keep each layer's input. After the head's backward, a layer's activations and
            # K/V copies (P + L tokens) live while its backward recomputes it, beside the head's
            # weight-sized gradient (held until the tied embedding's joins it, or the embedding's own
            # comes). In the step's first backward the parameter gradients appear layer by layer: at
            # the last layer most exist and most inputs are gone, so the inputs count only where they
            # outweigh the gradients still missing.
            inputs = self.checkpointed * (L if plan.recompute else plan.held)
            heads = inputs + head
            layers = inputs + self.head_weight
            heads[plan.first_close] -= self.new_grads
            layers[plan.first_close] = max(layers[plan.first_close] - self.new_grads, 0)
            alive = self.kv * plan.held + np.maximum(heads, layers + self.layer * L + self.layer_kv * (P + L))
        elif plan.recompute:
            alive = self.activation * L + self.kv * (plan.held - L * plan.keeps_graph + P + L)
        else:
            alive = self.activation * plan.held + self.kv * (plan.held + plan.saved)
        if not plan.checkpoint_layers:
            alive = alive + head + self.linear_backward * L
            alive[plan.first_close] -= self.new_grads
        alive = alive + self.kv_grad * plan.graded
        # the end of its backward: the open chunks' K/V, the accumulators it filled (those of every open
        # chunk under it, when it has a prefix) or found, and the embedding's gradients
        graded = np.where(P > 0, np.maximum(plan.graded, plan.held - L), plan.graded)
        ending = self.kv * plan.held + self.kv_grad * graded + self.closing
        if self.linear_state:  # the open chunks' exported recurrent states, with their gradients
            states = self.linear_state * plan.exported_held
            alive, ending = alive + states, ending + states
        return int(max(alive.max(), ending.max()))

    def floor_bytes(
        self, path: int, recompute: bool, logits_rows: int | None = None, checkpoint_layers: bool = False
    ) -> int:
        """A lower bound on :meth:`step_bytes` over every chunk size, for a forest whose longest path
        holds ``path`` tokens (docs/chunked_execution.md, "Choosing the chunk size").

        When the chunk (L tokens) of a deepest token closes, the P ancestors of its first token are in
        open chunks and P >= path - L, so ``held`` >= P + L >= path. With recompute what is alive is
        then at least activation L + kv (2 path - L) with the head's window of min(L, rows) rows,
        concave in L in [1, path], so least at an end; without, (activation + kv) path and a window of
        at least one row; with checkpointed layers, at least one token's layer inputs, kv path and one
        row. Less the gradients not yet created, if it closes first; and the end of its backward holds
        kv path.
        """
        if path == 0:
            return self.head_weight
        rows = logits_rows or self.logits_rows
        one_row = self.activation + self.kv * (2 * path - 1) + self.head_row
        if checkpoint_layers:
            start = self.checkpointed + self.kv * path + self.head_row
        elif recompute:
            start = min(one_row, (self.activation + self.kv) * path + self.head_row * min(path, rows))
        else:
            start = (self.activation + self.kv) * path + self.head_row
        return max(start + self.head_weight - self.new_grads, self.kv * path + self.closing)


def unset_grad_bytes(model) -> int:
    """Bytes of the parameter gradients a step will create: those that train and are still unset."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None)


def activation_bytes_per_token(model) -> int:
    """Estimated bytes autograd saves per packed token for one forward + backward (all layers, none of
    them checkpointed)."""
    shape = adapt(model).shape
    return shape.layers * _layer_bytes_per_token(shape) + _trunk_bytes_per_token(shape)


def _layer_bytes_per_token(shape) -> int:
    """What autograd saves per token in one decoder layer: two RMSNorms over the hidden size (each a
    float32 copy of its input and its output), the inputs of the attention and MLP projections, the
    queries and attention output, the chunk's own K/V, four MLP intermediates, and the query/key norms'
    float32 copies where the model has them (Qwen3). A mixture of experts also keeps each token's
    hidden state copied to its k experts and their k outputs before they are summed."""
    hidden, size = shape.hidden, shape.bytes_per_element
    per_head = (shape.head_dim + shape.value_dim) // 2  # a query (or K/V) head's and its output's width
    q, kv = shape.heads * per_head, shape.kv_heads * per_head
    per_layer = _norms_and_mlp_bytes_per_token(shape) + hidden * size + 2 * q * size + 2 * kv * size
    if shape.qk_norm:
        per_layer += (q + kv) * (4 + size)
    return per_layer


def _norms_and_mlp_bytes_per_token(shape) -> int:
    """... of which the two norms, the MLP's input and intermediates, and a mixture's dispatch copies."""
    hidden, size = shape.hidden, shape.bytes_per_element
    dispatch = 2 * shape.experts_per_token * hidden
    return 2 * hidden * (4 + size) + (hidden + 4 * shape.intermediate + dispatch) * size


_MIXERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # linear-attention module -> its measure
PROBE_TOKENS = 128


def linear_mixer_bytes(model) -> tuple[int, int]:
    """(what autograd saves per token in one linear-attention mixer, its convolution's input width).

    Measured, since it depends on the kernel the mixer runs (flash-linear-attention's or the modeling
    file's PyTorch form): a fresh mixer of the first linear-attention layer's class, on that layer's
    device (a weightless model's: the CPU) with uninitialised weights, runs a chain of ``PROBE_TOKENS``
    tokens, and the storages it saves for backward are summed, the parameters' excluded. A fresh one
    leaves the model's own alone (its hooks, sharded or wrapped weights). Once per module."""
    index = linear_layers_of(model)[0]
    module = linear_module_of(model, index)
    if module in _MIXERS:
        return _MIXERS[module]
    weight = module.conv1d.weight
    device = torch.device("cpu") if weight.device.type == "meta" else weight.device
    with torch.device("meta"):
        probe = type(module)(text_config_of(model), index)
    probe = probe.to_empty(device=device).to(weight.dtype)
    params = {p.untyped_storage().data_ptr() for p in probe.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    # ones, not random: the probe must not draw from the caller's random streams (what it saves is shapes)
    x = torch.ones(1, PROBE_TOKENS, text_config_of(model).hidden_size, dtype=weight.dtype, device=device)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        probe(x.requires_grad_())
    _MIXERS[module] = (sum(saved.values()) // PROBE_TOKENS, weight.shape[0])
    return _MIXERS[module]


def linear_state_bytes(model) -> int:
    """One token's recurrent state in one linear-attention layer: [value heads, key dim, value dim], float32."""
    module = linear_module_of(model, linear_layers_of(model)[0])
    return module.num_v_heads * module.head_k_dim * module.head_v_dim * 4


def _trunk_bytes_per_token(shape) -> int:
    """... and outside the layers (the final norm)."""
    return 4 * shape.hidden * shape.bytes_per_element


def estimated_step_bytes(
    model, tree: PrefixTree, chunk_tokens: int, recompute: bool = True, checkpoint_layers: bool | None = None
) -> int:
    """Estimated activation memory of tree_backward with chunks of ``chunk_tokens``.

    Counts what the step allocates beyond the model's parameters, their
    gradients and optimizer state: the vocabulary head's backward, the K/V of
    every open chunk with the gradient accumulators its descendants filled,
    and what autograd saves: with ``recompute``, the running chunk's
    activations and K/V copies; without, those of every open chunk. Taken at
    the plan's worst moment. Gradients still unset (``None``) on the model
    are counted only from the end of the step's first backward, as the step
    creates them then. ``checkpoint_layers``: every layer under activation
    checkpointing (None: as the model runs them; layers it checkpoints itself
    through Hugging Face's ``gradient_checkpointing_enable()`` are counted so).
    benchmarks/bench_training.py measures the real peak.
    """
    check_tree(tree)
    recompute = check_flag("recompute", recompute)
    size = check_int("chunk_tokens", chunk_tokens, 1)
    memory = MemoryModel.of(model)
    checkpoint_layers = check_checkpoint_layers(checkpoint_layers, memory)
    return memory.step_bytes(plan_chunks(tree, size, recompute, checkpoint_layers=bool(checkpoint_layers)))


def check_checkpoint_layers(checkpoint_layers, memory: MemoryModel) -> bool | None:
    """None (the plan decides) or a bool; True where the model checkpoints every layer itself: False adds
    no checkpointing but cannot undo the model's own."""
    checkpoint_layers = checked_options(checkpoint_layers=checkpoint_layers).checkpoint_layers
    return True if memory.model_checkpoints else None if checkpoint_layers is None else bool(checkpoint_layers)


def format_bytes(num_bytes: float) -> str:
    """A byte count as people read it: 512 B, 3.25 MiB, 1.500 GiB."""
    for unit, digits, scale in (("GiB", 3, 2**30), ("MiB", 2, 2**20), ("KiB", 1, 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.{digits}f} {unit}"
    return f"{int(num_bytes)} B"


def _output_weight(head) -> torch.Tensor:
    """The [outputs, hidden] weight of a head's last linear layer (a value head's: [1, hidden])."""
    linear = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    if not linear:
        raise TypeError(f"the output head {type(head).__name__} has no linear layer to size its memory by")
    return linear[-1].weight
