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
from dta_ref.linear_attention import _check_one_row, _check_whole_forest, levels, segments

__all__ = ["TreeLinearMixing", "levels", "run_segments", "segments"]


@cache
def _fla_installed() -> bool:
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
        varlen = query.is_cuda and _fla_installed()
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
