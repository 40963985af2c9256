"""``tree_attention``: the autograd Function over the kernels, their launchers and the block shapes.

Variants: a sliding window over the keys' depths, logit softcapping, attention sinks, a value head dim
of its own (MLA); the Hopper twins run plain calls only. Limits: head dims up to 256 (64, 80, 96, 128,
192, 256 tested); float16, bfloat16, float32 (dot products in ieee float32); no dropout. Building a
schedule needs no host sync; checking a ``subtree_end`` (what ``tree_attention`` does when given one)
syncs once per tensor: build the schedule once with ``build_schedule`` and pass it to every layer. A
query that sees a non-finite value row gets NaN where plain attention might give inf. A row's running
maximum starts at -1e30, not -inf (a row may see no key of a block): a query whose every scaled score
(scale * q.k, in float32) is below about -1e29 gets 0 and a wrong LSE.

Isolation (docs/prefix_tree.md): the forward runs on V with its non-finite rows zeroed and sets the
output of the queries that see such a row to NaN; the backward passes Q, K and dO with their non-finite
rows zeroed and lets the LSE carry their NaN. Its cost is one fused read and write of V and of K, and
of Q in the backward's preprocess pass.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from dta_ref.attention import autocast_inputs, check_sinks, check_softcap, refuse_create_graph
from dta_ref.checks import check_int, check_scale

from . import graphed, hopper
from .interpreter import INTERPRET
from .kernels import (
    LOG2E,
    dkdv_shares_sum_kernel,
    finite_rows_kernel,
    queries_seeing_kernel,
    size_class,
    tree_attention_bwd_dkdv_kernel,
    tree_attention_bwd_dq_kernel,
    tree_attention_bwd_preprocess_kernel,
    tree_attention_fwd_kernel,
)
from .schedule import DkdvShares, TreeSchedule, build_schedule, cdiv

# (BLOCK_M, BLOCK_N) per kernel: queries x keys per program step, the fastest tiles on H100 and H200
# (docs/design_notes.md, "The schedule")
BLOCKS = {"fwd": (128, 128), "dkdv": (64, 128), "dq": (64, 64)}  # head dim 65..128
BLOCKS_FLOAT32 = {"fwd": (128, 64), "dkdv": (32, 64), "dq": (64, 64)}  # the same in float32 (shared memory)
BLOCKS_SMALL_HEAD = {"fwd": (128, 128), "dkdv": (64, 64), "dq": (64, 128)}  # head dim <= 64
BLOCKS_LARGE_HEAD = {"fwd": (64, 32), "dkdv": (32, 64), "dq": (64, 32)}  # head dim > 128
BLOCKS_INTERPRET = {"fwd": (16, 16), "dkdv": (16, 16), "dq": (16, 16)}


def block_table(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The (BLOCK_M, BLOCK_N) table the kernels use at this head dim and dtype."""
    if INTERPRET:
        return BLOCKS_INTERPRET
    if head_dim <= 64:
        return BLOCKS_SMALL_HEAD
    if head_dim <= 128:
        return BLOCKS if dtype.itemsize <= 2 else BLOCKS_FLOAT32
    return BLOCKS_LARGE_HEAD


def _blocks(kernel: str, x: torch.Tensor):
    return block_table(x.shape[-1], x.dtype)[kernel]


def _block_d(head_dim: int) -> int:
    """Head-dim tile: a power of two, and at least 16 (the smallest tl.dot reduction)."""
    return max(16, 1 << (head_dim - 1).bit_length())


_CHOSEN_CONFIGS: dict = {}  # (kernel, head dim, blocks, size class, dtype) -> the autotuner's choice


def _launch_tuned(kernel, grid, args, HEAD_DIM, BLOCK_M, BLOCK_N, SIZE_CLASS, dtype, **constexprs):
    """``kernel[grid](*args, SIZE_CLASS, ...)`` for an autotuned kernel, with the config its autotuner
    chose for this key but without the autotuner's per-call Python, which rebuilds a dict of every
    argument and the dtype name of every tensor on each call (about 75 us on an H100 host, a third of a
    small call's host cost). The key is the autotuner's: its key arguments and the inputs' dtype (the
    other tensors' dtypes are fixed). A key's first call goes through the autotuner, which benchmarks."""
    key = (kernel, HEAD_DIM, BLOCK_M, BLOCK_N, SIZE_CLASS, dtype, constexprs.get("USE_TMA"))
    config = _CHOSEN_CONFIGS.get(key)
    constexprs.update(HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    if config is None:
        kernel[grid](*args, SIZE_CLASS, **constexprs)
        _CHOSEN_CONFIGS[key] = kernel.best_config
    else:
        kernel.fn.run(*args, SIZE_CLASS, grid=grid, warmup=False, **constexprs, **config.all_kwargs())


def _batch_strides(end, num_m_blocks):
    """Batch strides of subtree_end and of the block-list rows: 0 when one tree serves the whole batch."""
    return (end.stride(0), num_m_blocks) if end.shape[0] > 1 else (0, 0)


def _strides(x):
    return x.stride()[:3]


@dataclass(frozen=True)
class Variant:
    """What a call computes beyond plain tree attention, as the kernels take it: a sliding ``window`` over
    the schedule's depths, a ``softcap`` on the scores, per-head ``sinks`` in every softmax denominator."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [Hq] float32

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None and self.sinks is None

    def args(self, sm_scale: float, end: torch.Tensor, schedule: TreeSchedule):
        """The kernels' variant arguments: the depths (or a stand-in), the softcap's scales, the window;
        and their constexpr flags."""
        cap = self.softcap
        pos = schedule.position_ids if self.window is not None else end
        values = (pos, sm_scale / cap if cap else 0.0, cap * LOG2E.value if cap else 0.0, self.window or 0)
        return values, dict(SOFTCAP=cap is not None, WINDOW=self.window is not None)


PLAIN = Variant()


def _hopper_applies(variant: Variant, q, k, v, *others) -> bool:
    """The Gluon twins run plain calls whose values have the queries' head dim."""
    return variant.plain and v.shape[-1] == q.shape[-1] and hopper.applies(q, k, v, *others)


def _forward(q, k, v, schedule, sm_scale, variant=PLAIN):
    B, Hq, Tq, D = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[3]
    BM, BN = _blocks("fwd", q)
    lists = schedule.block_lists(BM, BN, variant.window)
    end = schedule.subtree_end
    o = q.new_empty(B, Hq, Tq, Dv)
    lse = torch.empty(B, Hq, Tq, device=q.device, dtype=torch.float32)
    num_m_blocks = cdiv(Tq, BM)
    # p = 0 times a non-finite value row is NaN: the kernel sees such rows zeroed, and the queries that
    # see them get their NaN in its epilogue (the loop itself stays as fast as without isolation)
    v_finite, v_bad = _finite_rows(v)
    sees_bad = queries_seeing(v_bad, end, Tq)  # [B, Hkv, Tq]
    if (BM, BN) == (hopper.BLOCK_M, hopper.BLOCK_N) and _hopper_applies(variant, q, k, v_finite):
        hopper.forward(q, k, v_finite, o, lse, end, lists, sees_bad, sm_scale * LOG2E.value,
                       _batch_strides(end, num_m_blocks))  # fmt: skip
        return o, lse, v_finite
    k_desc, v_desc = _tma_descriptors(k, v_finite, BN, Tq)
    values, flags = variant.args(sm_scale, end, schedule)
    sinks = variant.sinks if variant.sinks is not None else lse
    args = (
        q, k, v_finite, o, lse, end, values[0], sinks, lists.count, lists.full, lists.idx, lists.run, sees_bad,
        k if k_desc is None else k_desc, v_finite if v_desc is None else v_desc,
        sm_scale * LOG2E.value, *values[1:],
        *_strides(q), *_strides(k), *_strides(v_finite), *_strides(o),
        *_batch_strides(end, num_m_blocks), lists.num_key_blocks,
        Hq, Hq // Hkv, Tq, Tk,
    )  # fmt: skip
    _launch_tuned(tree_attention_fwd_kernel, (num_m_blocks, B * Hq), args, D, BM, BN, size_class(Tq), q.dtype,
                  HEAD_DIM_V=Dv, BLOCK_D=_block_d(D), BLOCK_DV=_block_d(Dv), DOT_PRECISION=_dot_precision(q.dtype),
                  USE_TMA=k_desc is not None, HAS_SINKS=variant.sinks is not None, **flags)  # fmt: skip
    return o, lse, v_finite


def _tma_descriptors(k, v, BLOCK_N, Tq):
    """TMA descriptors of K and V [B, Hkv, Tk, D] for the forward's full key blocks, or (None, None) where
    they do not apply: before Hopper, under the interpreter, a head dim that is not its own tile, rows or
    strides not 16-byte aligned, or a call of under 64 queries (a decode step, whose cost is its host
    time, to which each descriptor adds about 3 us of Python)."""
    D, Dv = k.shape[-1], v.shape[-1]
    if INTERPRET or Tq < 64 or D != _block_d(D) or Dv != _block_d(Dv) or not _has_tma(k.device):
        return None, None
    for x in (k, v):
        if x.data_ptr() % 16 or any(s * x.element_size() % 16 for s in x.stride()[:3]):
            return None, None
    return tuple(TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, BLOCK_N, x.shape[-1]]) for x in (k, v))


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _finite_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, T, D] with its non-finite rows zeroed (a contiguous copy), and [B, H, T] int8 flags of those rows."""
    B, H, T, D = x.shape
    x_finite = torch.empty(B, H, T, D, device=x.device, dtype=x.dtype)
    bad = torch.empty(B, H, T, device=x.device, dtype=torch.int8)
    BLOCK_T = 16 if INTERPRET else 64
    finite_rows_kernel[(cdiv(T, BLOCK_T), B * H)](
        x, x_finite, bad, *_strides(x), H, T, HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_T=BLOCK_T,
    )  # fmt: skip
    return x_finite, bad


def queries_seeing(keys: torch.Tensor, subtree_end: torch.Tensor, Tq: int) -> torch.Tensor:
    """[B, H, Tq] int8: 1 for the queries that see at least one key flagged in ``keys`` [B, H, Tk] int8."""
    B, H, Tk = keys.shape
    sees = torch.empty(B, H, Tq, dtype=torch.int8, device=keys.device)
    queries_seeing_kernel[(B * H,)](
        keys, subtree_end, sees, _batch_strides(subtree_end, 0)[0], H, Tq, Tk, BLOCK_T=16 if INTERPRET else 1024,
    )  # fmt: skip
    return sees


def _forward_call(q, k, v, schedule, sm_scale, variant):
    """``_forward``, replayed from a CUDA graph where the call is small (graphed.py)."""

    def body(q, k, v, *sinks):
        return _forward(q, k, v, schedule, sm_scale, replace(variant, sinks=sinks[0] if sinks else None))

    inputs = (q, k, v) if variant.sinks is None else (q, k, v, variant.sinks)
    return graphed.run(body, inputs, schedule.graphs, ("forward", sm_scale, variant.window, variant.softcap))


def _backward_call(do, q, k, v, o, lse, schedule, sm_scale, variant):
    """``_backward``, replayed from a CUDA graph where the call is small (graphed.py)."""

    def body(do, q, k, v, o, lse, *sinks):
        return _backward(do, q, k, v, o, lse, schedule, sm_scale, replace(variant, sinks=sinks[0] if sinks else None))

    inputs = (do, q, k, v, o, lse) + (() if variant.sinks is None else (variant.sinks,))
    return graphed.run(body, inputs, schedule.graphs, ("backward", sm_scale, variant.window, variant.softcap))


def _backward(do, q, k, v, o, lse, schedule, sm_scale, variant=PLAIN):
    """v is the forward's V with its non-finite rows zeroed. Returns dq, dk, dv and the sinks' gradient.

    Isolation without touching the kernels' loops: every operand row that a tile product multiplies
    by a masked (zero) probability is finite, zeroed first where it was not, and the rows it belongs
    to carry their NaN through the LSE instead (the forward's for Q and K, the preprocess's for dO).
    The LSE holds the sinks, so dS = P (dP - delta) as without them; a sink's own gradient is
    -sum(P_sink delta) over its head's rows, P_sink = exp(sink - LSE).
    """
    delta, lse_bwd, do_finite, q_finite = _backward_preprocess(o, do, q, lse)
    dk, dv = _backward_dkdv(do_finite, q_finite, k, v, lse_bwd, delta, schedule, sm_scale, variant)
    del q_finite, do_finite
    k_finite = _finite_rows(k)[0]
    dq = _backward_dq(do, q, k_finite, v, lse_bwd, delta, schedule, sm_scale, variant)
    dsinks = None
    if variant.sinks is not None:
        dsinks = -((variant.sinks[None, :, None] - lse_bwd).exp() * delta).sum((0, 2))
    return dq, dk, dv, dsinks


def _backward_preprocess(o, do, q, lse):
    B, Hq, Tq, D = q.shape
    Dv = o.shape[-1]
    # delta and the LSE in rows of a multiple of 4 floats, 16 bytes, so TMA can read them (Hopper dK/dV)
    delta, lse_bwd = torch.empty(2, B, Hq, -(-Tq // 4) * 4, device=o.device, dtype=torch.float32)[..., :Tq]
    do_finite = torch.empty_like(do)
    q_finite = torch.empty(B, Hq, Tq, D, device=q.device, dtype=q.dtype)
    BLOCK_T = 16 if INTERPRET else 128
    tree_attention_bwd_preprocess_kernel[(cdiv(Tq, BLOCK_T), B * Hq)](
        o, do, q, lse, delta, lse_bwd, do_finite, q_finite,
        *_strides(o), *_strides(do), *_strides(q), *_strides(do_finite), Hq, Tq, delta.stride(1),
        HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=_block_d(D), BLOCK_DV=_block_d(Dv), BLOCK_T=BLOCK_T,
    )  # fmt: skip
    return delta, lse_bwd, do_finite, q_finite


def _stride_rows(lse, delta):
    """The one stride of the backward's LSE and delta rows, [B, Hq, Tq] (``_backward_preprocess``)."""
    assert lse.stride() == delta.stride() and lse.stride(0) == lse.shape[1] * lse.stride(1), "lse and delta rows"
    return delta.stride(1)


def _backward_dkdv(do, q, k, v, lse, delta, schedule, sm_scale, variant=PLAIN):
    B, Hq, Tq, D = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[3]
    BM, BN = _blocks("dkdv", q)
    end = schedule.subtree_end
    heads_per_row = B // max(end.shape[0], 1) * Hkv  # an empty batch may bring an empty [0, Tk] tree
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    shares = schedule.dkdv_shares(heads_per_row, Hq // Hkv, D)
    workspace = shares.workspace(D, Dv, q.device)
    assert shares.unit % BN == 0, "a dK/dV program's keys lie in one share unit"
    if _hopper_applies(variant, q, k, v, do):
        order = schedule.key_block_order(hopper.DKDV_BLOCK_M, hopper.DKDV_BLOCK_N)
        hopper.backward_dkdv(q, k, v, do, lse, delta, dk, dv, end, order, sm_scale * LOG2E.value, sm_scale,
                             _batch_strides(end, 0)[0], heads_per_row, shares,
                             workspace.view(-1, 2, shares.unit, D))  # fmt: skip
    else:
        order = schedule.key_block_order(BM, BN)
        values, flags = variant.args(sm_scale, end, schedule)
        args = (
            q, k, v, do, lse, delta, dk, dv, end, values[0], order, shares.shares, shares.first, workspace,
            sm_scale * LOG2E.value, sm_scale, *values[1:],
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
            _batch_strides(end, 0)[0], heads_per_row, _stride_rows(lse, delta), shares.max_shares,
            Hq, Hkv, Hq // Hkv, Tq, Tk,
        )  # fmt: skip
        _launch_tuned(tree_attention_bwd_dkdv_kernel, (order.numel() * heads_per_row * shares.max_shares,), args, D,
                      BM, BN, size_class(Tq), q.dtype, HEAD_DIM_V=Dv, BLOCK_D=_block_d(D), BLOCK_DV=_block_d(Dv),
                      DOT_PRECISION=_dot_precision(q.dtype), UNIT=shares.unit, **flags)  # fmt: skip
    if shares.max_shares > 1:
        _sum_dkdv_shares(workspace, shares, dk, dv, heads_per_row)
    return dk, dv


def _sum_dkdv_shares(workspace, shares: DkdvShares, dk, dv, heads_per_row):
    """dk [B, Hkv, Tk, D], dv [B, Hkv, Tk, Dv] of the split units, from their shares' partials in ``workspace``."""
    _, Hkv, Tk, D = dk.shape
    Dv = dv.shape[-1]
    BLOCK_T = 16 if INTERPRET else 32
    dkdv_shares_sum_kernel[(shares.shares.numel() * cdiv(shares.unit, BLOCK_T), heads_per_row)](
        workspace, shares.shares, shares.first, dk, dv, *_strides(dk), *_strides(dv), heads_per_row, Hkv,
        cdiv(Tk, shares.unit), Tk, HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=_block_d(D), BLOCK_DV=_block_d(Dv),
        UNIT=shares.unit, BLOCK_T=BLOCK_T,
    )  # fmt: skip


def _backward_dq(do, q, k, v, lse, delta, schedule, sm_scale, variant=PLAIN):
    B, Hq, Tq, D = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[3]
    BM, BN = _blocks("dq", q)
    end = schedule.subtree_end
    lists = schedule.block_lists(BM, BN, variant.window)
    num_m_blocks = cdiv(Tq, BM)
    dq = torch.empty_like(q)
    if hopper.dq_takes(BM, BN, D) and _hopper_applies(variant, q, k, v, do):
        hopper.backward_dq(q, k, v, do, lse, delta, dq, end, lists, sm_scale * LOG2E.value, sm_scale,
                           _batch_strides(end, num_m_blocks), BN)  # fmt: skip
        return dq
    values, flags = variant.args(sm_scale, end, schedule)
    args = (
        q, k, v, do, lse, delta, dq, end, values[0], lists.count, lists.full, lists.idx, lists.run,
        sm_scale * LOG2E.value, sm_scale, *values[1:],
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
        *_batch_strides(end, num_m_blocks), lists.num_key_blocks, _stride_rows(lse, delta), Hq, Hq // Hkv, Tq, Tk,
    )  # fmt: skip
    _launch_tuned(tree_attention_bwd_dq_kernel, (num_m_blocks, B * Hq), args, D, BM, BN, size_class(Tq), q.dtype,
                  HEAD_DIM_V=Dv, BLOCK_D=_block_d(D), BLOCK_DV=_block_d(Dv), DOT_PRECISION=_dot_precision(q.dtype),
                  **flags)  # fmt: skip
    return dq


def _dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


class TreeAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, schedule, sm_scale, window, softcap):
        variant = Variant(window, softcap, None if sinks is None else sinks.float().contiguous())
        o, lse, v_finite = _forward_call(q, k, v, schedule, sm_scale, variant)
        ctx.save_for_backward(q, k, v_finite, o, lse, variant.sinks)
        ctx.schedule, ctx.sm_scale, ctx.window, ctx.softcap = schedule, sm_scale, window, softcap
        ctx.mark_non_differentiable(lse)
        # the LSE has no gradient to give: spare autograd a zero-filled one in every backward (a launch
        # and an allocation, ~10% of a small call's host cost)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        refuse_create_graph("tree_attention")  # a second derivative would need kernels of its own
        if do is None:  # the output reached no loss
            return (None,) * 8
        q, k, v, o, lse, sinks = ctx.saved_tensors
        variant = Variant(ctx.window, ctx.softcap, sinks)
        do = _last_dim_contiguous(do)
        dq, dk, dv, dsinks = _backward_call(do, q, k, v, o, lse, ctx.schedule, ctx.sm_scale, variant)
        return dq, dk, dv, dsinks, None, None, None, None


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, T, D], got shape {tuple(x.shape)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; tree_attention supports float16, bfloat16 and float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"tree_attention needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {q.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in batch, heads and tokens, got {tuple(k.shape)} and {tuple(v.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if 0 in x.shape[1:]:
            raise ValueError(f"{name} has shape {tuple(x.shape)}: heads, tokens and head dim must be at least 1")
    B, Hq, Tq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in batch or head dim")
    if Hq % k.shape[1] != 0:
        raise ValueError(f"number of query heads ({Hq}) must be a multiple of key/value heads ({k.shape[1]})")
    if Tq > k.shape[2]:
        raise ValueError(f"more queries ({Tq}) than keys ({k.shape[2]}): queries are the last Tq key positions")
    for name, size in (("head dim", D), ("value head dim", v.shape[3])):
        if size > 256:
            raise ValueError(f"{name} {size} is not supported (at most 256)")


# CUDA takes at most 65535 programs on a grid's second axis, which the kernels give to batch x heads (and
# the schedule's to batch rows): a batch with more rows than that is run in slices
MAX_GRID_ROWS = 65535
SCALE_LIMIT = 1e38  # the kernels take scale * log2(e) as a float32


def tree_attention(
    q, k, v, subtree_end=None, scale=None, *, position_ids=None, window=None, sinks=None, softcap=None,
    schedule: TreeSchedule | None = None, return_lse=False,
):  # fmt: skip
    """Tree attention: the query at key position i attends key j iff j <= i < subtree_end[j].

    q [B, Hq, Tq, D]; k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv] (GQA when Hq is a multiple of Hkv; Dv may
    differ from D, as in MLA); subtree_end [Tk] or [B, Tk] int. The queries are the last Tq key positions
    (Tq < Tk: the first Tk - Tq keys are a cached prefix). Pass a ``schedule`` from
    :func:`build_schedule` instead of ``subtree_end`` to reuse it across layers.

    Variants, as ``dta_ref.tree_attention`` computes them: ``window``, a sliding window over
    ``position_ids`` (the keys' depths, shaped as ``subtree_end``; with a schedule, give them to
    ``build_schedule``); ``softcap``, scores ``softcap * tanh(scale * q.k / softcap)``; ``sinks`` [Hq], a
    learned logit per head in every softmax denominator (differentiable).

    Returns the output [B, Hq, Tq, Dv] (and the float32 natural-log LSE [B, Hq, Tq] with
    ``return_lse=True``, which carries no gradient). Differentiable in q, k, v and sinks, once
    (``create_graph=True`` raises). Under autocast, q, k and v are first cast to its dtype, as SDPA's are.
    """
    q, k, v = autocast_inputs(q, k, v)
    _check_inputs(q, k, v)
    B, Hq, Tq, D = q.shape
    Tk = k.shape[2]
    if schedule is None:
        if subtree_end is None:
            raise ValueError("tree_attention needs subtree_end (or a schedule)")
        if not isinstance(subtree_end, torch.Tensor):
            raise TypeError(f"subtree_end must be an integer tensor [Tk] or [B, Tk], got {type(subtree_end).__name__}")
        if subtree_end.shape[-1:] != (Tk,):
            raise ValueError(f"subtree_end has shape {tuple(subtree_end.shape)}, but k has {Tk} keys")
        schedule = build_schedule(subtree_end.to(q.device), Tq, position_ids=position_ids)
    elif subtree_end is not None:
        raise ValueError("pass either subtree_end or schedule, not both")
    elif not isinstance(schedule, TreeSchedule):
        raise TypeError(f"schedule must be a TreeSchedule (from build_schedule), got {type(schedule).__name__}")
    elif position_ids is not None:
        raise ValueError("with a schedule, pass position_ids to build_schedule, not to tree_attention")
    if schedule.num_keys != Tk or schedule.num_queries != Tq:
        raise ValueError(
            f"tree metadata covers {schedule.num_keys} keys / {schedule.num_queries} queries, "
            f"but k has {Tk} keys and q has {Tq} queries"
        )
    if schedule.subtree_end.shape[0] not in (1, B):
        raise ValueError(f"subtree_end has batch size {schedule.subtree_end.shape[0]}, expected 1 or {B}")
    if schedule.subtree_end.device != q.device:
        raise ValueError(f"subtree_end is on {schedule.subtree_end.device}, q on {q.device}")
    window = check_int("window", window, 1, allow_none=True)
    if window is not None and schedule.position_ids is None:
        raise ValueError("a sliding window needs position_ids, the keys' depths (build_schedule(..., position_ids=))")
    softcap = None if softcap is None else check_softcap(softcap)
    sinks = check_sinks(sinks, Hq)
    if sinks is not None and sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device}, q on {q.device}")
    step = max(MAX_GRID_ROWS // Hq, 1)
    if B > step:  # a rollout's large batch of short rows: the kernels run on slices of it
        slices = [tree_attention(q[b : b + step], k[b : b + step], v[b : b + step], scale=scale, window=window,
                                 sinks=sinks, softcap=softcap, schedule=schedule.rows(b, b + step),
                                 return_lse=return_lse)
                  for b in range(0, B, step)]  # fmt: skip
        if return_lse:
            return torch.cat([o for o, _ in slices]), torch.cat([lse for _, lse in slices])
        return torch.cat(slices)
    sm_scale = 1.0 / math.sqrt(D) if scale is None else check_scale(scale, SCALE_LIMIT)
    if sm_scale < 0:  # the kernels want a scale of at least 0 (_softmax_step): softmax(c q.k) = softmax(-c (-q).k)
        q, sm_scale = -q, -sm_scale
    if INTERPRET and q.dtype == torch.bfloat16:
        # the Triton interpreter's bfloat16 tl.dot is wrong (by up to ~1e9, Triton 3.6 to 3.9): float32
        # kernels there, bfloat16 out; autograd casts the gradients back
        with torch.autocast(q.device.type, enabled=False):  # else autocast would cast them back
            out = tree_attention(q.float(), k.float(), v.float(), scale=sm_scale, window=window, sinks=sinks,
                                 softcap=softcap, schedule=schedule, return_lse=return_lse)  # fmt: skip
        return (out[0].to(q.dtype), out[1]) if return_lse else out.to(q.dtype)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    needs_grad = q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    if torch.is_grad_enabled() and needs_grad:
        o, lse = TreeAttentionFunction.apply(q, k, v, sinks, schedule, sm_scale, window, softcap)
    else:  # nothing to differentiate (a rollout step): spare the autograd Function's host cost
        variant = Variant(window, softcap, None if sinks is None else sinks.float().contiguous())
        o, lse, _ = _forward_call(q, k, v, schedule, sm_scale, variant)
    return (o, lse) if return_lse else o
