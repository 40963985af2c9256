"""Linear-attention layers (Gated DeltaNet) in depth-first chunks.

A chunk's tokens read, beside their own chunk, the path above its first token (docs/chunked_execution.md):
for attention the K/V of that path, for a linear-attention layer

- the convolution's inputs on the path (each token mixes its ``kernel - 1`` nearest ancestors), which
  every chunk keeps for its tokens as it keeps their K/V;
- the recurrent state after each token a later chunk continues from (a token whose child starts in
  another chunk: a branch point, or the last token before a chunk boundary), which its chunk exports.

A chunk reads both as leaves from the open chunks that own them; after its backward their gradients go
to the owners' accumulators, and a chunk's own backward seeds its exported tensors with what its
descendants accumulated on them (the chunk closes after all of them). The convolution then runs on the
path and the chunk as one forest, and the delta rule on the chunk's segments, those that enter from the
path starting from the exported states (``dta_fast.linear_attention``).
"""

from __future__ import annotations

import numpy as np
import torch

from dta_ref.linear_attention import _check_one_row

from ..linear_attention import TreeLinearMixing, segments

REENTRANT_REFUSED = (
    "linear-attention layers in several chunks export recurrent states from their forward, which reentrant "
    "activation checkpointing runs without a graph (its backward redoes it): checkpoint the model's layers "
    "non-reentrantly (gradient_checkpointing_kwargs={'use_reentrant': False}), or train in one chunk"
)


class LinearStore:
    """One layer's exports of an open chunk: its tokens' convolution inputs [n, C] and the recurrent states
    after its exported tokens, detached, with the gradients its descendants leave on them."""

    def __init__(self, conv_inputs: torch.Tensor):
        self.conv_inputs, self.conv_grad = conv_inputs, None
        self.states: dict[int, torch.Tensor] = {}
        self.state_grads: dict[int, torch.Tensor] = {}

    def add_conv_grad(self, lo: int, hi: int, grad: torch.Tensor) -> None:
        if self.conv_grad is None:
            dtype = torch.promote_types(self.conv_inputs.dtype, torch.float32)
            self.conv_grad = torch.zeros(self.conv_inputs.shape, dtype=dtype, device=self.conv_inputs.device)
        self.conv_grad[lo:hi] += grad

    def add_state_grad(self, token: int, grad: torch.Tensor) -> None:
        if token in self.state_grads:
            self.state_grads[token] = self.state_grads[token] + grad
        else:
            self.state_grads[token] = grad.clone()


class ChunkLinks:
    """Which recurrent states cross chunk boundaries: per chunk, its tokens whose parent lies in an earlier
    chunk (``entries``: local index, the parent's owner chunk and its local index) and its tokens whose
    state a later chunk reads (``exports``: local indices)."""

    def __init__(self, parent: np.ndarray, start: np.ndarray, stop: np.ndarray):
        chunk_of = np.searchsorted(stop, np.arange(parent.size), side="right")
        crossing = (parent >= 0) & (chunk_of[np.maximum(parent, 0)] != chunk_of)
        self.entries = [[] for _ in range(len(start))]
        self.exports = [set() for _ in range(len(start))]
        for x in np.nonzero(crossing)[0].tolist():
            p = int(parent[x])
            owner = int(chunk_of[p])
            self.entries[int(chunk_of[x])].append((x - int(start[chunk_of[x]]), owner, p - int(start[owner])))
            self.exports[owner].add(p - int(start[owner]))


class ChunkLinearMixing(TreeLinearMixing):
    """The convolution and the delta rule of a chunk's linear-attention layers, reading the path above it
    from the open chunks' stores; what it reads and what it exports are recorded for the backward."""

    def __init__(self, engine, c: int, layer_of: dict[int, int]):
        a, b = int(engine.plan.start[c]), int(engine.plan.stop[c])
        parent = engine.tree.parent[a:b] - a
        super().__init__(torch.where(parent >= 0, parent, -1))
        self.engine, self.c, self.layer_of, self._layer, self._extended = engine, c, layer_of, None, None
        self.pieces = engine.plan.prefix(c)
        self.prefix = int(engine.plan.prefix_tokens[c])
        self.depth = engine.tree.position_ids
        self.grad = torch.is_grad_enabled()  # a pass that trains: its layers' forwards must build graphs
        self.imports: list[tuple[torch.Tensor, LinearStore, object]] = []  # (leaf, owner store, where)
        self.exports: list[tuple[torch.Tensor, LinearStore, object]] = []  # (graph tensor, own store, where)

    def _store(self, layer: int, conv_inputs: torch.Tensor | None = None) -> LinearStore:
        stores = self.engine.open[self.c].linear
        if layer not in stores:  # idempotent: a forward redone at the close reads and keeps the first's
            stores[layer] = LinearStore(conv_inputs.detach())
        return stores[layer]

    def conv(self, original, x, weight, bias=None, activation=None, **kwargs):
        _check_one_row("the convolution's input", x)
        if self.grad and not torch.is_grad_enabled():
            raise ValueError(REENTRANT_REFUSED)
        base = weight._base if weight._base is not None else weight
        self._layer = self.layer_of[id(base)]
        own = self._store(self._layer, x[0].t())
        self.exports.append((x[0].t(), own, "conv"))
        if not self.prefix:
            return super().conv(original, x, weight, bias, activation)
        # the path above the chunk (a chain, root first) and the chunk, as one forest
        stored = [self.engine.open[p.owner].linear[self._layer] for p in self.pieces]
        path = torch.cat([s.conv_inputs[p.lo : p.hi] for s, p in zip(stored, self.pieces, strict=True)])
        leaf = path.to(x.dtype).requires_grad_(torch.is_grad_enabled())
        offset = 0
        for s, p in zip(stored, self.pieces, strict=True):
            self.imports.append((leaf, s, ("conv", offset, p.lo, p.hi)))
            offset += p.hi - p.lo
        extended = torch.cat([leaf.t()[None], x], dim=-1)
        return TreeLinearMixing(self._path_and_chunk()).conv(original, extended, weight, bias, activation)[
            :, :, self.prefix :
        ]

    def _path_and_chunk(self) -> torch.Tensor:
        """Parent pointers of the path above the chunk (a chain, root first) and the chunk, as one forest
        (once per chunk: every layer's convolution reads the same)."""
        if self._extended is None:
            P = self.prefix
            own = self.parent.cpu()
            parent = torch.cat([torch.arange(-1, P - 1), torch.where(own >= 0, own + P, -1)])
            depth = self.depth.cpu() if torch.is_tensor(self.depth) else self.depth
            for x_local, owner, p_local in self._entries():  # an entry's parent is on the path, at its depth
                parent[P + x_local] = int(depth[int(self.engine.plan.start[owner]) + p_local])
            self._extended = parent.to(self.parent.device)
        return self._extended

    def _entries(self):
        return self.engine.links.entries[self.c]

    def plan_segments(self) -> list[tuple[int, int, int]]:
        """The chunk's segments, each exported token (a later chunk continues from it) ending one."""
        return segments(self.parent, cut_after=self.engine.links.exports[self.c])

    def entering_states(self, segs) -> list:
        """A root segment continuing a token of an earlier chunk starts from that chunk's exported state, read
        as a leaf."""
        entering = [None] * len(segs)
        starts = {start: i for i, (start, _, parent) in enumerate(segs) if parent < 0}
        for x, owner, p in self._entries():
            store = self.engine.open[owner].linear[self._layer]
            entering[starts[x]] = store.states[p].clone().requires_grad_(torch.is_grad_enabled())
            self.imports.append((entering[starts[x]], store, ("state", p)))
        return entering

    def keep_states(self, segs, finals) -> None:
        """The states after the exported tokens, stored for later chunks and recorded for the backward."""
        own, exports = self._store(self._layer), self.engine.links.exports[self.c]
        for (_, end, _), final in zip(segs, finals, strict=True):
            if end - 1 in exports:
                own.states.setdefault(end - 1, final.detach())
                self.exports.append((final, own, ("state", end - 1)))

    # ------------------------------------------------------------------ the backward's plumbing

    def roots(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(exported tensor, the gradient the chunk's descendants left on it): extra roots of its backward."""
        out = []
        for tensor, store, where in self.exports:
            grad = store.conv_grad if where == "conv" else store.state_grads.get(where[1])
            if grad is not None and tensor.requires_grad:
                out.append((tensor, grad.to(tensor.dtype)))
        return out

    def send_gradients(self) -> None:
        """After the chunk's backward: what reached the leaves it read goes to their owners."""
        for leaf, store, where in self.imports:
            if leaf.grad is None:
                continue
            if where[0] == "conv":
                _, offset, lo, hi = where
                store.add_conv_grad(lo, hi, leaf.grad[offset : offset + hi - lo])
            else:
                store.add_state_grad(where[1], leaf.grad)
