"""Linear-attention layers (Gated DeltaNet) on the prefix tree, segment by segment.

Same results as ``dta_ref.linear_attention.TreeLinearMixing`` (its twin): the convolution is the same
gather along parent pointers; the delta rule runs each unbranched segment of the forest (a maximal run
of tokens each the only child of the one before) through the layer's own chunked kernel, starting from
the final state of the segment's parent. A segment's parent ends a segment (a token with one child
continues it), so every segment of one level (its depth in the tree of segments) finds its initial
state computed once the levels above it ran: on CUDA with flash-linear-attention (the kernel
transformers loads for these layers where it is installed) each level is one variable-length call,
else each segment is one call of the model's PyTorch form, in preorder. Autograd sums a forked state's
gradient over the segments that start from it.
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch

from dta_ref.linear_attention import TreeLinearMixing as _Reference
from dta_ref.linear_attention import _check_one_row, _check_whole_forest, levels, path_ancestors, segments

__all__ = ["CachedLinearMixing", "TreeLinearMixing", "fla_available", "levels", "run_segments", "segments"]


@cache
def fla_available() -> bool:
    """Whether flash-linear-attention's delta rule imports, as transformers tries it (on failure the model's
    modeling file keeps its PyTorch form, which cannot take variable-length calls)."""
    if importlib.util.find_spec("fla") is None:
        return False
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception:  # a broken install: transformers falls back, and so do we
        return False
    return True


def run_segments(original, query, key, value, g, beta, segs, entering, use_qk_l2norm_in_kernel, varlen=None):
    """The delta rule over ``segs`` (``segments()``' records): each starts from its parent segment's final
    state, or a root from ``entering[i]`` (a state from outside, or None: zeros). Returns the output over
    all tokens and each segment's final state [1, H, K, V]. ``varlen`` (default: on CUDA with
    flash-linear-attention) runs each level in one variable-length call of ``original``."""
    if varlen is None:
        varlen = query.is_cuda and fla_available()
    finals: list[torch.Tensor | None] = [None] * len(segs)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if not varlen:
        outs = []
        for i, (start, end, parent) in enumerate(segs):
            initial = finals[parent] if parent >= 0 else entering[i]
            q, k, v, g_, b = (t[:, start:end] for t in (query, key, value, g, beta))
            out, finals[i] = original(q, k, v, g=g_, beta=b, initial_state=initial, **kw)
            outs.append(out)
        return torch.cat(outs, dim=1), finals
    pieces = []  # (output of a level, its token index)
    for level in levels(segs):
        index = torch.cat([torch.arange(segs[i][0], segs[i][1]) for i in level]).to(query.device)
        lengths = torch.tensor([0] + [segs[i][1] - segs[i][0] for i in level])
        initial = [finals[segs[i][2]] if segs[i][2] >= 0 else entering[i] for i in level]
        known = next((x for x in initial if x is not None), None)
        if known is not None:  # a root without a state starts from zeros, as None does
            initial = torch.cat([torch.zeros_like(known) if x is None else x for x in initial])
        else:
            initial = None
        q, k, v, g_, b = (t[:, index] for t in (query, key, value, g, beta))
        cu_seqlens = lengths.cumsum(0).to(query.device)
        level_out, level_final = original(q, k, v, g=g_, beta=b, initial_state=initial, cu_seqlens=cu_seqlens, **kw)
        pieces.append((level_out, index))
        for j, i in enumerate(level):
            finals[i] = level_final[j : j + 1]
    out = torch.zeros(value.shape[:-1] + pieces[0][0].shape[-1:], dtype=pieces[0][0].dtype, device=value.device)
    for level_out, index in pieces:
        out = out.index_copy(1, index, level_out)
    return out, finals


class TreeLinearMixing(_Reference):
    """Twin of ``dta_ref.linear_attention.TreeLinearMixing``, the delta rule by ``run_segments``."""

    _segments = None

    def delta_rule(
        self, original, query, key, value, g, beta, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs,
    ):  # fmt: skip
        _check_whole_forest(initial_state, cu_seqlens)
        _check_one_row("the delta rule's query", query)
        if self._segments is None:  # once per forward, on the first linear-attention layer
            self._segments = self.plan_segments()
        entering = self.entering_states(self._segments)
        out, finals = run_segments(
            original, query, key, value, g, beta, self._segments, entering, use_qk_l2norm_in_kernel
        )  # fmt: skip
        self.keep_states(self._segments, finals)
        return out, None

    # what a chunk of tree_backward changes (dta_fast.chunked.linear): where segments end, the states that
    # enter from earlier chunks, the states later chunks read
    def plan_segments(self) -> list[tuple[int, int, int]]:
        return segments(self.parent)

    def entering_states(self, segs) -> list:
        return [None] * len(segs)

    def keep_states(self, segs, finals) -> None:
        pass


class CachedLinearMixing(TreeLinearMixing):
    """Linear-attention layers for a KV-cached sampler: each batch row is a window of new tokens (a chain,
    then a draft tree) continuing that row's cached state, the recurrent state and the convolution inputs
    of its last ``kernel - 1`` tokens. The rows run as one forest; every token a row may continue from
    (``keep``: the chain's last token, each draft node) ends a segment, so its state is kept, and
    :meth:`commit` makes a token's state and path the row's cache."""

    def __init__(self, layer_of: dict[int, int]):
        super().__init__(torch.zeros(0, dtype=torch.long))
        self.layer_of = layer_of  # id(conv weight) -> layer
        self.history: dict[int, torch.Tensor] = {}  # layer -> [B, kernel - 1, C], zeros before a row's start
        self.states: dict[int, torch.Tensor] = {}  # layer -> [B, H, Dk, Dv]
        self.window: dict[int, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}  # this step's inputs, states

    def begin(self, parent: torch.Tensor, keep: list[int]) -> None:
        """A step over rows of ``parent.shape[1]`` tokens: ``parent`` [B, Tq] row-local pointers, -1 at each
        row's first token (it continues the row's cache); ``keep``, the flat indices (row * Tq + t) whose
        states may become a row's cache."""
        B, Tq = parent.shape
        offset = (torch.arange(B, device=parent.device) * Tq)[:, None]
        self.rows, self.Tq = B, Tq
        self.parent = torch.where(parent >= 0, parent + offset, -1).flatten()
        self.keep, self.window, self._layer = set(keep), {}, None
        self._segments, self._conv = None, {}  # the step's segments; its convolution forest per kernel width

    def _extended(self, kernel: int) -> torch.Tensor:
        """Parent pointers of each row's ``kernel - 1`` cached tokens (a chain) then its window, flattened."""
        B, Tq, H = self.rows, self.Tq, kernel - 1
        n = H + Tq
        local = self.parent.view(B, Tq) - (torch.arange(B, device=self.parent.device) * Tq)[:, None]
        window = torch.where(local >= 0, local + H, H - 1)  # a row's first token continues its cached tokens
        history = torch.arange(-1, H - 1, device=self.parent.device).expand(B, H)
        parent = torch.cat([history, window], dim=1) + (torch.arange(B, device=self.parent.device) * n)[:, None]
        parent[:, 0] = -1
        return parent.flatten()

    def conv(self, original, x, weight, bias=None, activation=None, **kwargs):
        """x [B, C, Tq]: each row's tokens after its cached ones, along the paths of its window."""
        base = weight._base if weight._base is not None else weight
        self._layer = self.layer_of[id(base)]
        B, C, Tq = x.shape
        kernel = weight.shape[-1]
        history = self.history.get(self._layer)
        if history is None:
            history = x.new_zeros(B, kernel - 1, C)
        inputs = torch.cat([history, x.transpose(1, 2)], dim=1)  # [B, kernel - 1 + Tq, C]
        self.window[self._layer] = (inputs, {})
        if kernel not in self._conv:  # one forest for every layer of the step (its ancestors found once)
            self._conv[kernel] = TreeLinearMixing(self._extended(kernel))
        out = self._conv[kernel].conv(original, inputs.flatten(0, 1).t()[None], weight, bias, activation)
        return out[0].t().view(B, kernel - 1 + Tq, C)[:, kernel - 1 :].transpose(1, 2)

    def delta_rule(
        self, original, query, key, value, g, beta, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs,
    ):  # fmt: skip
        _check_whole_forest(initial_state, cu_seqlens)
        if self._segments is None:
            self._segments = segments(self.parent, cut_after=self.keep)
        segs, cached = self._segments, self.states.get(self._layer)
        entering = [None] * len(segs)
        if cached is not None:  # a row's first segment continues its cached state
            for i, (start, _, parent) in enumerate(segs):
                if parent < 0 and start % self.Tq == 0:
                    entering[i] = cached[start // self.Tq][None]
        flat = (t.flatten(0, 1)[None] for t in (query, key, value, g, beta))
        out, finals = run_segments(original, *flat, segs, entering, use_qk_l2norm_in_kernel)
        kept = self.window[self._layer][1]
        for (_, end, _), final in zip(segs, finals, strict=True):
            if end - 1 in self.keep:
                kept[end - 1] = final[0]
        return out[0].view(*value.shape[:2], *out.shape[2:]), None

    def commit(self, ends: list[int]) -> None:
        """The rows that go on, in order, each continuing from its flat token ``ends[i]``: that token's state
        and its path's last ``kernel - 1`` convolution inputs become the row's cache (the others are dropped)."""
        device = self.parent.device
        window, self.window = self.window, {}
        if not ends:  # every row finished
            self.states, self.history = {}, {}
            return
        taps_of = {}  # kernel - 1 -> each going row's H nearest tokens, oldest first
        for layer, (inputs, kept) in window.items():
            H = inputs.shape[1] - self.Tq  # kernel - 1
            self.states[layer] = torch.stack([kept[t] for t in ends])
            if H not in taps_of:
                ancestors = path_ancestors(self._extended(H + 1), H + 1)  # [B * (H + Tq), kernel]
                at = torch.tensor([(t // self.Tq) * (H + self.Tq) + H + t % self.Tq for t in ends], device=device)
                taps_of[H] = ancestors[at][:, :H].flip(-1)
            self.history[layer] = inputs.flatten(0, 1)[taps_of[H]]  # [rows, H, C]
