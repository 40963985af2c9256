"""Linear-attention layers (Gated DeltaNet) on the prefix tree, written out.

A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) is not a mask over keys. Each token's output reads a
recurrent state built along its own path, after a short causal convolution over its path's last few
tokens. On the preorder forest:

- the convolution at token t mixes t and its ``kernel - 1`` nearest ancestors (parent pointers, not the
  packed neighbours; zeros above a root, as the model pads a sequence's start);
- the state after token t is the state after its parent, decayed and updated by t (zero above a root):
  a branch forks its parent's state, so every rollout sees exactly the state it would see alone;
- in the backward, autograd sums the gradient of a forked state over the branches that read it.

The layer's own forward computes everything else (projections, gates, the gated norm, the output
projection): it calls its modeling file's ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``,
which :mod:`dta_ref.hf` routes here during a tree forward. :class:`TreeLinearMixing` is the readable
twin (one token at a time, in preorder, in the inputs' precision); ``dta_fast.linear_attention``
runs each unbranched segment of the tree through the model's own chunked kernel instead.
"""

from __future__ import annotations

import torch


def path_ancestors(parent: torch.Tensor, width: int) -> torch.Tensor:
    """[T, width]: column d holds the d-th ancestor of each token (column 0 the token itself), -1 above a
    root."""
    columns = [torch.arange(parent.numel(), device=parent.device)]
    for _ in range(width - 1):
        up = columns[-1]
        columns.append(torch.where(up >= 0, parent[up.clamp(min=0)], up))
    return torch.stack(columns, dim=1)


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


def levels(segs: list[tuple[int, int, int]]) -> list[list[int]]:
    """Segment indices by level: roots first, then every segment whose parent is in the level above."""
    depth, out = [], []
    for _, _, parent in segs:
        depth.append(0 if parent < 0 else depth[parent] + 1)
        if depth[-1] == len(out):
            out.append([])
        out[depth[-1]].append(len(depth) - 1)
    return out


class CausalLinearMixing:
    """Each batch row is one whole sequence from its first token: the model's own functions, unchanged."""

    def conv(self, original, x, weight, bias=None, activation=None, **kwargs):
        return original(x, weight, bias, activation=activation)

    def delta_rule(self, original, *args, **kwargs):
        return original(*args, **kwargs)


CAUSAL = CausalLinearMixing()


class TreeLinearMixing:
    """The convolution and the gated delta rule of a linear-attention layer over a packed forest of
    ``parent`` pointers ([T], -1 at a root), one token at a time."""

    def __init__(self, parent: torch.Tensor):
        self.parent = parent
        self._ancestors = {}  # by kernel width, on the first layer that asks

    def conv(self, original, x, weight, bias=None, activation=None, **kwargs):
        """The model's depthwise causal convolution along each path: x [1, C, T], weight [C, K]."""
        from transformers.activations import ACT2FN

        _check_one_row("the convolution's input", x)
        kernel = weight.shape[-1]
        if kernel not in self._ancestors:
            self._ancestors[kernel] = path_ancestors(self.parent.to(x.device), kernel)
        ancestors = self._ancestors[kernel]  # [T, K]
        rows = x[0].t().to(weight.dtype)  # [T, C]
        taps = torch.where((ancestors >= 0)[..., None], rows[ancestors.clamp(min=0)], 0)  # [T, K, C]
        # weight[:, K-1] multiplies the token itself, weight[:, K-1-d] its d-th ancestor
        out = (taps * weight.flip(-1).t()[None]).sum(1)
        if bias is not None:
            out = out + bias
        if activation is not None:
            out = ACT2FN[activation](out)
        return out.t()[None].to(x.dtype)

    def delta_rule(
        self, original, query, key, value, g, beta, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs,
    ):  # fmt: skip
        """The gated delta rule along each path: q, k [1, T, Hk, Dk], v [1, T, Hv, Dv], g and beta [1, T, Hv].

        For each token t in preorder, from the state S after its parent (zero at a root):
        S = exp(g_t) S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t / sqrt(Dk),
        with q and k L2-normalised first where the layer asks for it.
        """
        _check_whole_forest(initial_state, cu_seqlens)
        _check_one_row("the delta rule's query", query)
        dtype = torch.float64 if value.dtype == torch.float64 else torch.float32  # the model's: float32 at least
        q, k, v, g, beta = (x[0].to(dtype) for x in (query, key, value, g, beta))
        groups = v.shape[1] // k.shape[1]  # each query/key head serves this many value heads
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm(q), _l2norm(k)
        q = q / q.shape[-1] ** 0.5
        zero = v.new_zeros(v.shape[1], k.shape[-1], v.shape[-1])  # [H, Dk, Dv]
        states, out = [], []
        for t, p in enumerate(self.parent.tolist()):
            state = (states[p] if p >= 0 else zero) * g[t].exp()[:, None, None]
            delta = (v[t] - (state * k[t][..., None]).sum(-2)) * beta[t][:, None]  # [H, Dv]
            state = state + k[t][..., None] * delta[:, None, :]
            states.append(state)
            out.append((state * q[t][..., None]).sum(-2))
        return torch.stack(out)[None].to(query.dtype), None


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # as flash-linear-attention and the model's fallback normalise: x / sqrt(sum x^2 + 1e-6)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _check_one_row(what: str, x: torch.Tensor) -> None:
    if x.shape[0] != 1:
        raise ValueError(f"{what} must hold one packed forest (batch 1), got batch {x.shape[0]}")


def _check_whole_forest(initial_state, cu_seqlens) -> None:
    """The tree starts every root from a zero state and packs its own sequences: a cached state or the
    trainer's packed-sequence offsets would be a different computation."""
    if initial_state is not None:
        raise ValueError("a linear-attention layer passed a cached state: the tree path runs whole rollouts")
    if cu_seqlens is not None:
        raise ValueError("a linear-attention layer passed packed-sequence offsets: the tree packs its own")
