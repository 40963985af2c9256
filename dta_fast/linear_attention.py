"""Linear-attention layers (Gated DeltaNet) on the prefix tree, segment by segment.

Same results as ``dta_ref.linear_attention.TreeLinearMixing`` (its twin): the convolution is the same
gather along parent pointers; the delta rule runs each unbranched segment of the forest (a maximal run
of tokens each the only child of the one before) through the layer's own chunked kernel, the
flash-linear-attention kernel where transformers loaded it, else its PyTorch form, starting from the
final state of the segment's parent. A segment's parent ends a segment (a token with one child
continues it), so in preorder every segment finds its initial state already computed; autograd sums a
forked state's gradient over the segments that start from it.
"""

from __future__ import annotations

import torch

from dta_ref.linear_attention import TreeLinearMixing as _Reference
from dta_ref.linear_attention import _check_one_row, _check_whole_forest


def segments(parent: torch.Tensor, cut_after=()) -> list[tuple[int, int, int]]:
    """The forest's unbranched segments in preorder: (start, end, parent segment index or -1). A token in
    ``cut_after`` ends its segment too (its state is wanted on its own)."""
    parent = parent.tolist()
    children = [0] * len(parent)
    for p in parent:
        if p >= 0:
            children[p] += 1
    out, segment_of = [], [0] * len(parent)
    for t, p in enumerate(parent):
        if p >= 0 and p == t - 1 and children[p] == 1 and p not in cut_after:
            out[-1][1] = t + 1  # t continues its parent's segment
        else:
            out.append([t, t + 1, segment_of[p] if p >= 0 else -1])
        segment_of[t] = len(out) - 1
    return [tuple(x) for x in out]


class TreeLinearMixing(_Reference):
    """Twin of ``dta_ref.linear_attention.TreeLinearMixing``, the delta rule one segment per kernel call."""

    _segments = None

    def delta_rule(
        self, original, query, key, value, g, beta, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs,
    ):  # fmt: skip
        _check_whole_forest(initial_state, cu_seqlens)
        _check_one_row("the delta rule's query", query)
        if self._segments is None:  # once per forward, on the first linear-attention layer
            self._segments = segments(self.parent)
        outs, finals = [], []
        for start, end, parent in self._segments:
            out, final = original(
                query[:, start:end], key[:, start:end], value[:, start:end], g=g[:, start:end],
                beta=beta[:, start:end], initial_state=finals[parent] if parent >= 0 else None,
                output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )  # fmt: skip
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1), None
