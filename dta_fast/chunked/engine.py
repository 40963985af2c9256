"""Depth-first chunked execution: exact gradients with memory bounded by the path.

The preorder forest is cut into chunks of consecutive packed tokens, visited in order (depth-first). A
chunk's keys outside itself are exactly the ancestors of its first token, which live in the chunks still
*open* (with unfinished descendants); a chunk closes when all of them are done: its backward runs, seeded
by its loss terms and by the dK/dV its descendants left on its K/V (docs/chunked_execution.md).

:class:`ChunkEngine` runs a plan (plan.py) step by step. Attention reaches the stored K/V through an
autograd Function (:class:`AttendedKV`) that reads and writes the chunks' gradient accumulators when
autograd runs it, so the engine stays exact when a layer's forward runs twice (gradient checkpointing).
:func:`tree_backward` checks its arguments, picks the plan (budget.py) and runs the loss.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from dta_ref.adapter import adapt
from dta_ref.checks import check_tree
from dta_ref.hf import linear_layers_of, linear_module_of
from dta_ref.logprobs import logprob_dtype
from dta_ref.losses import TokenLoss
from dta_ref.multimodal import TreeImages, check_images
from dta_ref.tree import PrefixTree
from dta_ref.values import token_values, value_head_of

from ..checkpointing import model_checkpointing_reentrant, reentrant_applies, reentrant_checkpoint
from ..dispatch import tree_attend, uses_kernel
from ..linear_attention import TreeLinearMixing
from ..logprobs import HeadRows, LogprobPairs, head_logprobs, head_weight, window_rows
from .budget import choose_plan
from .images import ChunkImages
from .linear import ChunkLinearMixing, ChunkLinks
from .options import checked_options
from .plan import ChunkPlan


@dataclass
class _LayerKV:
    """One layer's detached K/V of an open chunk, and the gradient its descendants leave on them."""

    keys: torch.Tensor  # [1, Hkv, n, D]
    values: torch.Tensor
    dkeys: torch.Tensor | None = None  # at least float32, allocated on the first gradient
    dvalues: torch.Tensor | None = None

    def add_grad(self, lo: int, hi: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        if self.dkeys is None:
            dtype = torch.promote_types(self.keys.dtype, torch.float32)
            self.dkeys = torch.zeros(self.keys.shape, dtype=dtype, device=self.keys.device)
            self.dvalues = torch.zeros(self.values.shape, dtype=dtype, device=self.values.device)
        self.dkeys[:, :, lo:hi] += dk
        self.dvalues[:, :, lo:hi] += dv


class AttendedKV(torch.autograd.Function):
    """The keys and values a chunk's queries attend in one layer: its cached prefix, gathered from the
    open chunks' stores (detached), then its own k, v.

    The backward adds each prefix piece's gradient into its owner's
    accumulators, and passes the gradient of the own k, v on with the dK/dV
    the chunk's descendants accumulated on them. The accumulators are read
    when autograd runs this backward, which happens once, in whichever graph
    autograd actually runs (the forward's, or a gradient-checkpointing
    recompute's); the chunk closes only after every descendant, so they are
    complete by then.
    """

    @staticmethod
    def forward(ctx, k, v, own: _LayerKV, prefix: list[tuple[_LayerKV, int, int]]):
        ctx.own, ctx.prefix = own, prefix
        if not prefix:
            return k.view_as(k), v.view_as(v)
        keys = torch.cat([store.keys[:, :, lo:hi].to(k.dtype) for store, lo, hi in prefix] + [k], dim=2)
        values = torch.cat([store.values[:, :, lo:hi].to(v.dtype) for store, lo, hi in prefix] + [v], dim=2)
        return keys, values

    @staticmethod
    def backward(ctx, dkeys, dvalues):
        offset = 0
        for store, lo, hi in ctx.prefix:
            n = hi - lo
            store.add_grad(lo, hi, dkeys[:, :, offset : offset + n], dvalues[:, :, offset : offset + n])
            offset += n
        dk, dv = dkeys[:, :, offset:], dvalues[:, :, offset:]
        own = ctx.own
        if own.dkeys is not None:
            dk, dv = dk + own.dkeys.to(dk.dtype), dv + own.dvalues.to(dv.dtype)
        return dk, dv, None, None


@dataclass
class _ChunkPass:
    """What one forward of a chunk leaves: the roots of its backward."""

    hidden: torch.Tensor  # [n, hidden] final hidden states
    logprobs: torch.Tensor  # [pairs] logprobs of its (sequence, step) pairs
    linear: ChunkLinearMixing | None = None  # its linear-attention layers' reads and exports


@dataclass
class _OpenChunk:
    layers: dict  # layer index -> _LayerKV
    linear: dict = field(default_factory=dict)  # linear-attention layer index -> LinearStore
    graph: _ChunkPass | None = None  # kept from the forward when the plan says so
    rng: _RngState | None = None  # where its forward began drawing, when it will be redone (dropout)


class _RngState(NamedTuple):
    """The random generators a model's forward draws from (dropout): the CPU's and those of the CUDA
    devices its parameters are on."""

    cpu: torch.Tensor
    cuda: tuple  # (device, state) pairs

    @classmethod
    def now(cls, devices: tuple) -> _RngState:
        return cls(torch.get_rng_state(), tuple((d, torch.cuda.get_rng_state(d)) for d in devices))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in self.cuda:
            torch.cuda.set_rng_state(state, device)

    @contextlib.contextmanager
    def replayed(self):
        """The generators at this state inside, as they were outside after: a forward redone here draws
        the dropout masks of the first (what torch.utils.checkpoint's preserve_rng_state does)."""
        with torch.random.fork_rng(devices=[d for d, _ in self.cuda]):
            self.restore()
            yield


class ChunkEngine:
    """Runs a :class:`ChunkPlan`: forwards and closes in the plan's order."""

    def __init__(
        self,
        model,
        tree: PrefixTree,
        plan: ChunkPlan,
        kernel: bool,
        out_logprobs: torch.Tensor,
        temperature: float = 1.0,
        value_head=None,
        images: TreeImages | None = None,
    ):
        self.adapter, self.tree, self.plan, self.temperature = adapt(model), tree, plan, temperature
        # a vision-language model's images: the vision tower's forward now, once, each chunk reading its rows
        self.images = None if images is None else ChunkImages(self.adapter.core, images, tree)
        # a critic's chunks give values through ``value_head``, a policy's logprobs through its vocabulary head
        self.value_head = value_head
        self.head = self.adapter.head if value_head is None else value_head
        self.kernel = kernel  # the Triton kernel, else the reference attention (dta_fast.dispatch)
        self.pairs = LogprobPairs.of(tree) if value_head is None else LogprobPairs.of_values(tree)
        rows = self.pairs.rows.cpu().numpy()
        self.span_lo = np.searchsorted(rows, plan.start).tolist()
        self.span_hi = np.searchsorted(rows, plan.stop).tolist()
        # every chunk's head rows and windows at once: no chunk waits for the GPU to learn its own
        if value_head is not None:
            window = sys.maxsize  # one value per row: no logits window to keep small
        else:
            window = plan.logits_rows or window_rows(head_weight(self.head).shape[0])
        self.head_rows = HeadRows.of_chunks(
            rows, self.span_lo + [rows.size], plan.start.tolist(), window, self.pairs.rows.device
        )
        self.out = out_logprobs
        self.open: dict[int, _OpenChunk] = {}
        # linear-attention layers: each one's convolution weight names it; which states cross chunks
        core = self.adapter.core if self.adapter.is_hf else None
        linear = linear_layers_of(core) if core is not None else []
        self.linear_layer_of = {id(linear_module_of(core, i).conv1d.weight): i for i in linear}
        if linear and plan.num_chunks > 1:
            self.links = ChunkLinks(tree.parent.cpu().numpy(), plan.start, plan.stop)
        self.cuda_devices = tuple(sorted({p.device for p in model.parameters() if p.is_cuda}, key=str))

    def rng_state(self) -> _RngState:
        return _RngState.now(self.cuda_devices)

    def run(self, seed) -> None:
        """Forward and backward over the whole plan; ``seed(span, logprobs)`` is a chunk's loss."""
        for step in self.plan.steps:
            if step.forward:
                self.forward(step.chunk)
            else:
                self.close(step.chunk, seed)

    def run_forward_only(self) -> None:
        """Every logprob, no graphs: the first pass for a loss that is not a TokenLoss."""
        with torch.no_grad():
            for step in self.plan.steps:
                if step.forward:
                    self.open[step.chunk] = _OpenChunk({})
                    self.record(step.chunk, self.run_chunk(step.chunk, grad=False))
                else:
                    del self.open[step.chunk]

    def forward(self, c: int) -> None:
        keep = bool(self.plan.keeps_graph[c])
        chunk = self.open[c] = _OpenChunk({}, rng=None if keep else self.rng_state())
        chunk_pass = self.run_chunk(c, grad=keep)
        self.record(c, chunk_pass)
        if keep:
            chunk.graph = chunk_pass

    def close(self, c: int, seed) -> None:
        """Backward of a chunk whose descendants have all closed."""
        chunk = self.open[c]
        if chunk.graph is not None:
            chunk_pass = chunk.graph
        else:  # redone with its first forward's dropout masks: the K/V its descendants saw, the same graph
            with chunk.rng.replayed():
                chunk_pass = self.run_chunk(c, grad=True)
        chunk.graph = None
        # the hidden states with a zero gradient reach every layer even without loss terms, so the
        # K/V seeds of AttendedKV always run
        roots, grads = [chunk_pass.hidden], [torch.zeros_like(chunk_pass.hidden)]
        if chunk_pass.logprobs.numel():
            loss = seed(self.span(c), chunk_pass.logprobs)
            roots.append(loss)
            grads.append(torch.ones_like(loss))
        if chunk_pass.linear is not None:  # its exported states and inputs, with what its descendants left on them
            for root, grad in chunk_pass.linear.roots():
                roots.append(root)
                grads.append(grad)
        # a root that needs no gradient is left out: the hidden states when only the head trains, all of
        # them when nothing in the model does
        trained = [(root, grad) for root, grad in zip(roots, grads) if root.requires_grad]
        if trained:  # not under a caller's autocast: a backward runs in its forward's dtypes
            with torch.autocast(chunk_pass.hidden.device.type, enabled=False):
                torch.autograd.backward(*zip(*trained))
        if chunk_pass.linear is not None:
            chunk_pass.linear.send_gradients()
        del self.open[c]

    def span(self, c: int) -> slice:
        return slice(self.span_lo[c], self.span_hi[c])

    def record(self, c: int, chunk_pass: _ChunkPass) -> None:
        span = self.span(c)
        self.out[self.pairs.seq[span], self.pairs.step[span]] = chunk_pass.logprobs.detach().to(self.out.dtype)

    def run_chunk(self, c: int, grad: bool) -> _ChunkPass:
        """Chunk ``c``'s forward with its ancestors' K/V as a cached prefix."""
        a, b = int(self.plan.start[c]), int(self.plan.stop[c])
        pieces = self.plan.prefix(c)
        end, depth = self.tree.subtree_end, self.tree.position_ids
        spans = [slice(int(self.plan.start[p.owner]) + p.lo, int(self.plan.start[p.owner]) + p.hi) for p in pieces]
        P = int(self.plan.prefix_tokens[c])
        key_end = torch.cat([end[s] for s in spans] + [end[a:b]]).clamp(max=b) - a + P  # chunk-local key coordinates
        key_depth = torch.cat([depth[s] for s in spans] + [depth[a:b]])
        attend_tree = tree_attend(key_end, b - a, self.kernel, key_depth)
        chunk = self.open[c]

        def attend(layer, q, k, v, scale, **variant):
            if layer not in chunk.layers:  # idempotent: a checkpointed layer calls attend twice
                chunk.layers[layer] = _LayerKV(k.detach(), v.detach())
            prefix = [(self.open[p.owner].layers[layer], p.lo, p.hi) for p in pieces]
            k, v = AttendedKV.apply(k, v, chunk.layers[layer], prefix)
            return attend_tree(layer, q, k, v, scale, **variant)

        with torch.set_grad_enabled(grad), warnings.catch_warnings():
            # reentrant checkpointing warns of a forward without gradients; this one needs none
            warnings.filterwarnings("ignore", "None of the inputs have requires_grad", UserWarning)
            ids, positions = self.tree.tokens[a:b][None], self.tree.position_ids[a:b][None]
            images = None if self.images is None else self.images.chunk(a, b)
            linear = None
            if self.linear_layer_of:  # the path's convolution inputs and states from the open chunks
                linear = ChunkLinearMixing(self, c, self.linear_layer_of) if self.plan.num_chunks > 1 else None
                linear = linear or TreeLinearMixing(self.tree.parent[a:b] - a)  # one chunk: the whole forest
            # the layers checkpointed (by the plan or by the model itself) at a small host cost where they can be
            how = reentrant_checkpoint if self.plan.checkpoint_layers and reentrant_applies(self.adapter) else None
            with model_checkpointing_reentrant(self.adapter):
                hidden = self.adapter.hidden_states(
                    ids, positions, attend, how or self.plan.checkpoint_layers, linear=linear, images=images
                )[0]
            span = self.span(c)
            rows = self.head_rows[c]
            if self.value_head is None:
                logprobs = head_logprobs(hidden, self.head, rows, self.pairs.targets[span], self.temperature)
            else:  # a critic: one value per token
                logprobs = token_values(self.head, hidden[rows.unique])[rows.inverse]
        return _ChunkPass(hidden, logprobs, linear if isinstance(linear, ChunkLinearMixing) else None)


def tree_backward(
    model,
    tree: PrefixTree,
    loss_fn,
    *,
    max_chunk_tokens: int | None = None,
    memory_budget_bytes: int | None = None,
    memory_margin_bytes: int | None = None,
    recompute: bool | None = None,
    checkpoint_layers: bool | None = None,
    attention_impl: str = "auto",
    temperature: float = 1.0,
    grad_scaler: torch.amp.GradScaler | None = None,
    value_head=None,
    images=None,
):
    """Forward and backward over the whole forest, depth-first in chunks; gradients added to ``.grad``.

    ``loss_fn(i, logprobs_i)`` returns sequence i's scalar loss term; the total
    loss is their sum. Pass ``dta_ref.PolicyGradientLoss`` / ``dta_ref.SFTLoss``
    for the losses of dta_ref (one pass), or any callable (two passes; a term
    that also depends on parameters directly gets that gradient too, as
    ``loss.backward()`` would give it).

    How the forest is chunked:

    - ``max_chunk_tokens``: chunks of at most this many packed tokens.
    - ``memory_budget_bytes``: the chunk size and ``recompute`` whose
      :func:`estimated_step_bytes` fits this activation budget, cheapest first.
    - neither, on CUDA: the budget is the device's free memory (with what the
      caching allocator holds free, less the parameter gradients still to be
      created), less ``memory_margin_bytes`` (default 5% of the device; leave
      room for what comes after the backward: optimizer state on its first
      step, other models), of which 80% goes to the estimate.
    - neither, on CPU: one chunk (the packed forest in one forward).

    ``recompute``: redo each chunk's forward at its backward, so memory is
    the open chunks' K/V plus one chunk's activations; without it the open
    chunks keep their graphs. Default: on when chunked by ``max_chunk_tokens``;
    chosen with the chunk size under a budget.
    ``checkpoint_layers``: run every decoder layer under activation
    checkpointing (non-reentrant, this call only): a chunk keeps each layer's
    input and its backward recomputes the layer, so much larger chunks fit a
    budget for a second forward. Default: off with ``max_chunk_tokens`` and
    on CPU, chosen with the chunk size under a budget. Layers the model
    checkpoints itself (Hugging Face's ``gradient_checkpointing_enable()``, in
    training mode) stay checkpointed, and the estimate counts them so.
    ``attention_impl``: "kernel" (Triton), "reference" (explicit mask, any
    dtype, for CPU tests) or "auto" (kernel on CUDA, reference elsewhere).
    ``temperature``: the logprobs are those of ``logits / temperature``, as
    an RL trainer scores its samples at the sampling temperature.
    ``value_head``: train a critic. A value model (a token classifier with
    one label) or a causal LM with ``value_head`` beside it gives one value
    per token instead of logprobs: ``loss_fn(i, values_i)`` over all of
    sequence i's tokens (``dta_ref.ValueLoss``, one pass), and the returned
    values are [N, Lmax] (the layout of ``tree_values``).
    ``images``: a vision-language model's images (``dta_ref.pack_images``):
    the vision tower runs once, each chunk reads its placeholders' rows, and
    the tower's backward runs once after the last chunk (several chunks need
    transformers >= 5.18). The estimate does not count the tower's
    activations.
    ``grad_scaler``: float16 mixed precision's ``torch.amp.GradScaler``. The
    backward runs on its scaled loss, as ``scaler.scale(loss).backward()``
    would, so ``scaler.step(optimizer)`` unscales the gradients as usual
    (without it they would arrive unscaled and be divided by the scale).

    Exact under gradient checkpointing of the model's layers (reentrant or
    not). Needs gradients enabled, as ``loss.backward()`` does: under
    ``torch.no_grad()`` or ``torch.inference_mode()`` it raises. Returns ``(logprobs, loss)``: detached
    per-sequence logprobs
    [N, Lmax-1] (the layout of ``tree_logprobs``) and the detached total loss.
    Parameters the forward runs get a gradient (zero where no term reaches
    them); others (a value head beside the model) keep ``.grad`` None, as
    ``loss.backward()`` leaves them. A call that raises partway (a loss that
    raises, running out of memory) leaves in ``.grad`` what the chunks before
    it added, as a failed ``loss.backward()`` does: zero the gradients before
    trying again (``distributed_tree_backward`` restores them itself).
    """
    check_tree(tree)
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        # the chunks' forwards would enable gradients, but not the loss terms: every .grad would stay 0
        raise RuntimeError(
            "tree_backward computes gradients, but gradients are disabled here (torch.no_grad() or "
            "torch.inference_mode()): call it outside them, as loss.backward() would need"
        )
    options = checked_options(
        max_chunk_tokens=max_chunk_tokens,
        memory_budget_bytes=memory_budget_bytes,
        memory_margin_bytes=memory_margin_bytes,
        recompute=recompute,
        checkpoint_layers=checkpoint_layers,
        attention_impl=attention_impl,
        temperature=temperature,
        grad_scaler=grad_scaler,
    )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(i, logprobs_i), got {type(loss_fn).__name__}")
    if isinstance(loss_fn, type):
        raise TypeError(f"loss_fn is the class {loss_fn.__name__}: pass an instance (e.g. SFTLoss(tree.logprob_mask))")
    tree.validate(loss_fn)
    adapter = adapt(model)  # rejects unsupported models with a clear error
    if adapter.data_parallel is not None:
        raise TypeError(
            "tree_backward runs one forward per chunk, which DistributedDataParallel does not allow before its "
            "backward: use dta_fast.distributed_tree_backward, or pass model.module and reduce the gradients"
        )
    adapter.check_token_ids(tree.tokens)
    critic = value_head is not None or adapter.value_head is not None
    value_head = value_head_of(model, value_head) if critic else None
    _check_loss_outputs(loss_fn, critic, options.temperature)

    device = adapter.device
    kernel = uses_kernel(device, options.attention_impl)
    plan = choose_plan(model, tree, device, options, head=value_head)
    tree = tree.to(device)
    dtype = logprob_dtype(adapter.dtype)
    width = tree.max_length if critic else tree.max_length - 1
    logprobs = torch.zeros(tree.num_sequences, width, dtype=dtype, device=device)
    images = check_images(images, tree, device)
    engine = ChunkEngine(model, tree, plan, kernel, logprobs, options.temperature, value_head, images)
    scaled = _unscaled if options.grad_scaler is None else options.grad_scaler.scale  # what the backward runs on
    if isinstance(loss_fn, TokenLoss):
        total = _run_token_loss(engine, loss_fn, scaled)
    else:
        total = _run_linearised_loss(engine, loss_fn, scaled)
    if engine.images is not None:  # the vision tower's backward, once
        engine.images.backward()
    for p in adapter.forward_parameters():  # as loss.backward() leaves them: a zero gradient, not None, for a
        if p.requires_grad and p.grad is None:  # parameter the forward runs that no term reached
            p.grad = torch.zeros_like(p)
    return logprobs, total.to(dtype)


def _check_loss_outputs(loss_fn, critic: bool, temperature: float) -> None:
    """A critic trains on values, a policy on logprobs: a loss built for the other is refused by name."""
    wanted = "values" if critic else "logprobs"
    given = getattr(loss_fn, "outputs", wanted) if isinstance(loss_fn, TokenLoss) else wanted
    if given != wanted:
        raise ValueError(
            f"loss_fn is a loss of {given} ({type(loss_fn).__name__}), but the model gives {wanted}: "
            + ("pass a ValueLoss for a critic" if critic else "a value loss trains a critic (value model, value_head=)")
        )
    if critic and temperature != 1.0:
        raise ValueError(f"temperature scales logits; a critic's values have none (got temperature={temperature})")


def _unscaled(loss: torch.Tensor) -> torch.Tensor:
    """What the backward runs on without a GradScaler: the loss itself."""
    return loss


def _run_token_loss(engine: ChunkEngine, loss_fn: TokenLoss, scaled) -> torch.Tensor:
    """One pass: each chunk backpropagates its own tokens' terms (``scaled``). Returns the total (float64)."""
    out, pairs = engine.out, engine.pairs
    if loss_fn.shape != tuple(out.shape):
        raise ValueError(
            f"loss_fn was built for {loss_fn.outputs} of shape {loss_fn.shape}, the tree has {tuple(out.shape)}"
        )
    token_loss = loss_fn.to(out.device)  # once, not at every chunk
    totals = []

    def seed(span, chunk_logprobs):
        terms = token_loss.terms(pairs.seq[span], pairs.step[span], chunk_logprobs).sum()
        totals.append(terms.detach().double())
        return scaled(terms)

    engine.run(seed)
    return torch.stack(totals).sum() if totals else torch.zeros((), dtype=torch.float64, device=out.device)


def _run_linearised_loss(engine: ChunkEngine, loss_fn, scaled) -> torch.Tensor:
    """Two passes for any other loss: every logprob, then ``sum(g * logprobs)`` with g the gradient of
    ``scaled(total)``."""
    pairs = engine.pairs
    start = engine.rng_state()
    engine.run_forward_only()
    total, g = _linearised_loss(loss_fn, engine.tree, engine.out, scaled)
    after = engine.rng_state()  # past the forward's draws and loss_fn's own, as per-sequence training leaves it
    start.restore()  # the second pass draws the first's dropout masks: g is the gradient at its forward

    def seed(span, chunk_logprobs):
        return (g[pairs.seq[span], pairs.step[span]].to(chunk_logprobs.dtype) * chunk_logprobs).sum()

    engine.run(seed)
    after.restore()
    return total


def _linearised_loss(loss_fn, tree: PrefixTree, logprobs: torch.Tensor, scaled):
    """The total of a generic ``loss_fn`` and g = d scaled(total) / d logprobs [N, Lmax-1].

    Every term is evaluated on a leaf copy of its logprobs and the total gets
    one ``backward``: it gives g, and any part of a term that depends on
    parameters (or other tensors) directly lands in their ``.grad`` as it
    would in per-sequence training; the chunked pass then adds
    ``sum(g * logprobs)``'s gradient.
    """
    leaves, terms = [], []
    lost = tree.max_length - logprobs.shape[1]  # one logprob per token but the last, or one value per token
    for i, n in enumerate((tree.lengths - lost).tolist()):
        lp_i = logprobs[i, :n].detach().clone().requires_grad_(True)
        term = loss_fn(i, lp_i.clone())  # not the leaf itself: a loss may change its argument in place
        if not isinstance(term, torch.Tensor) or term.numel() != 1 or term.is_complex():
            what = (
                f"a {term.dtype} tensor of shape {tuple(term.shape)}"
                if isinstance(term, torch.Tensor)
                else type(term).__name__
            )
            raise ValueError(f"loss_fn must return a real scalar tensor; for sequence {i} it returned {what}")
        leaves.append(lp_i)
        terms.append(term.reshape(()))
    differentiable = [t for t in terms if t.requires_grad]
    if differentiable:
        with torch.autocast(logprobs.device.type, enabled=False):  # as above: not under a caller's autocast
            torch.autograd.backward([scaled(t) for t in differentiable])
    g = torch.zeros_like(logprobs)
    for i, lp_i in enumerate(leaves):
        if lp_i.grad is not None:
            g[i, : lp_i.numel()] = lp_i.grad
    total = torch.stack([t.detach().double().to(logprobs.device) for t in terms]).sum()
    return total, g
