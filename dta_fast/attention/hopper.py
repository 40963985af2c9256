"""Tree attention's three kernels on Hopper (sm_90), warp-specialised, in Gluon.

Twins of the Triton kernels in ``kernels.py`` (the same blocks, taken in the same order, with the
same arithmetic: bitwise the same outputs, LSE and gradients; at head dim 64 dK/dV takes key blocks of
128 where the Triton kernel takes 64, and each key still meets its query blocks in the same order, so
its sums are the same), written with Hopper's own tools, which
Triton's automatic pipelining does not reach for a tree's mix of full and partly visible blocks
(docs/design_notes.md). Each kernel's program is split
into partitions that meet at mbarriers in shared memory:

- a loader warp that issues every TMA load: the program's fixed tiles first, then its ring of
  ``STAGES`` buffers, refilled as the compute warps release them;
- compute warpgroups that run the wgmma products and the softmax arithmetic between them; while one
  warpgroup does arithmetic another's products can hold the tensor cores.

Forward (``tree_attention_fwd_hopper_kernel``): a query block of 128 rows, one compute warpgroup per
64; the loader brings Q, then K and V of the row's key blocks (the block lists of the Triton
forward). S = Q K_j^T is issued with the previous block's O += P V, so the softmax of S_j runs while
that product does.

dK/dV (``tree_attention_bwd_dkdv_hopper_kernel``): a key block of 128, one compute warpgroup per 64
keys holding its dK and dV; the loader brings K and V once, then per step the Q and dO tiles of 64
queries with their rows' LSE and delta, over the query heads of the GQA group (or the program's
share of them, schedule.DkdvShares) and the key block's contiguous query range (masked head, full
middle, masked tail).

dQ (``tree_attention_bwd_dq_hopper_kernel``): the Triton dQ's blocks (64 queries; key blocks of 64 at
head dim 128, of 128 at head dim 64), one compute warpgroup; small enough in registers and shared memory
for two programs per SM.

The Triton kernels stay the path elsewhere (other GPUs, head dims other than 64 and 128, float32, the
interpreter, calls of under 64 queries). Triton 3.6 and later (Gluon) compile these.
"""

from __future__ import annotations

import os

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Triton 3.6 names the TMA load async_copy_global_to_shared, later releases async_load (same arguments)
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    from .kernels import LOG2E

    HAVE_GLUON = True
except ImportError:  # a Triton without Gluon: the Triton kernels everywhere
    HAVE_GLUON = False

BLOCK_M, BLOCK_N = 128, 128  # the query block (two warpgroups of 64 rows) and the key block
STAGES = 3  # K/V buffers in flight: 3 x 64 KB at head dim 128, under the H100's 227 KB with Q
# DTA_HOPPER_KERNELS=0 keeps the Triton kernels on Hopper too (A/B timings; racecheck, .ci/README.md)
ENABLED = HAVE_GLUON and os.environ.get("DTA_HOPPER_KERNELS", "1") != "0"


def applies(q: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the kernels here run this call: Hopper, 16-bit, head dim 64 or 128, at least 64 queries
    (below that a call's cost is its host time), and every tensor as TMA reads it (16-byte aligned rows
    and strides, unit stride along the head dim)."""
    if not ENABLED or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if q.shape[-1] not in (64, 128) or q.shape[2] < 64 or _capability(q.device)[0] != 9:
        return False
    return all(
        x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:3])
        for x in (q, *others)
    )


_CAPABILITY: dict = {}


def _capability(device: torch.device) -> tuple[int, int]:
    if device not in _CAPABILITY:
        _CAPABILITY[device] = torch.cuda.get_device_capability(device)
    return _CAPABILITY[device]


def forward(q, k, v, o, lse, end, lists, sees_bad, qk_scale, batch_strides):
    """Write o [B, Hq, Tq, D] and lse [B, Hq, Tq] as ``tree_attention_fwd_kernel`` does; v is V with its
    non-finite rows zeroed, sees_bad the queries that see one of them (function._forward)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_block, kv_block = [1, 1, BLOCK_M // 2, D], [1, 1, BLOCK_N, D]
    q_desc = descriptor(q, q_block, dtype)
    k_desc, v_desc = descriptor(k, kv_block, dtype), descriptor(v, kv_block, dtype)
    num_m_blocks = -(-Tq // BLOCK_M)
    # 4 warps here and 4 + 1 in the workers, rounded to 12; 168 registers each is the 64K of an SM,
    # which the partitions then split 240 / 240 / 24
    tree_attention_fwd_hopper_kernel[(num_m_blocks, B * Hq)](
        q_desc, k_desc, v_desc, o, lse, end, lists.count, lists.full, lists.idx, lists.run, sees_bad,
        qk_scale, *o.stride()[:3], *batch_strides, lists.num_key_blocks, Hq, Hq // Hkv, Tq, Tk,
        STAGES=STAGES, num_warps=4, maxnreg=168,
    )  # fmt: skip


_LAYOUTS: dict = {}  # (block, dtype) -> its shared-memory layout: 7 of a descriptor's 10 us, computed once


def descriptor(x, block, dtype):
    key = (tuple(block), dtype)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = (
            gl.NVMMASharedLayout.get_default_for(block, dtype)
            if len(block) == 4
            # tiles
            else gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=len(block))
        )  # rows
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, _LAYOUTS[key])


if HAVE_GLUON:

    @gluon.constexpr_function
    def _wgmma_layout(n):
        """Registers of a warpgroup's [64, n] wgmma accumulator."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.jit
    def _query_block_row(KV_FULL, KV_COUNT, stride_kv_b, NK, Hq, GROUP):
        """A (query block, batch row x query head) program's heads and its span of the block lists (the
        schedule is shared by the batch when subtree_end is)."""
        pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // Hq
        h = pid_bh % Hq
        row = (b * stride_kv_b + pid_m).to(gl.int64)
        start = row * NK
        return pid_m, pid_bh, b, h, h // GROUP, start, start + gl.load(KV_FULL + row), start + gl.load(KV_COUNT + row)

    @gluon.jit
    def _ring(a_desc, b_desc, STAGES: gl.constexpr, READERS: gl.constexpr):
        """STAGES buffers of an (a, b) pair of tiles, each with a barrier the loader fills (ready) and one
        its READERS compute partitions release (empty)."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=READERS)
        return a_bufs, b_bufs, ready, empty

    @gluon.jit
    def _load_key_block(i, n, b, hk, k_desc, v_desc, k_bufs, v_bufs, ready, empty):
        """Key block n into buffer i % STAGES, once its previous tiles are consumed."""
        STAGES_: gl.constexpr = k_bufs.shape[0]
        BLOCK_N_: gl.constexpr = k_bufs.shape[3]
        s = i % STAGES_
        mbarrier.wait(empty.index(s), ((i // STAGES_) & 1) ^ 1)  # a fresh barrier passes phase 1
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [b, hk, n * BLOCK_N_, 0], ready.index(s), k_bufs.index(s))
        tma_load(v_desc, [b, hk, n * BLOCK_N_, 0], ready.index(s), v_bufs.index(s))
        return i + 1

    @gluon.jit
    def _load_key_blocks(start, mid, stop, KV_IDX, KV_RUN, b, hk, k_desc, v_desc, k_bufs, v_bufs, ready, empty):
        """A row's key blocks (schedule.BlockLists) in the order the compute warps take them: the full
        ones run by run, then the partly visible ones."""
        i = 0
        e = start
        while e < mid:
            length = gl.load(KV_RUN + e)
            first = gl.load(KV_IDX + e)
            for n in range(first, first + length):
                i = _load_key_block(i, n, b, hk, k_desc, v_desc, k_bufs, v_bufs, ready, empty)
            e += length
        for e in range(mid, stop):
            i = _load_key_block(i, gl.load(KV_IDX + e), b, hk, k_desc, v_desc, k_bufs, v_bufs, ready, empty)

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, ready, empty, KV_IDX, KV_RUN,
                start, mid, stop, b, h, hk, m0):  # fmt: skip
        """The loader warp: Q, then the key blocks in the compute warpgroups' order."""
        HALF_M: gl.constexpr = q_desc.block_type.shape[2]
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma_load(q_desc, [b, h, m0, 0], q_bar, q_bufs.index(0))
        tma_load(q_desc, [b, h, m0 + HALF_M, 0], q_bar, q_bufs.index(1))
        _load_key_blocks(start, mid, stop, KV_IDX, KV_RUN, b, hk, k_desc, v_desc, k_bufs, v_bufs, ready, empty)

    @gluon.jit
    def _softmax_block(i, acc, l_i, m_i, p_prev, q, k_bufs, v_bufs, ready, empty, n, pos_m, END, Tk, qk_scale,
                       MASKED: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
        """Key block n, the i-th of the row: S_i = Q K_i^T issued with O += P_{i-1} V_{i-1} (for i = 0, P is
        zero and V_0 stands in), the softmax of S_i while the second runs, then O rescaled and P_i made.
        The arithmetic is kernels._softmax_step's (the scale through the row max on full blocks)."""
        STAGES_: gl.constexpr = k_bufs.shape[0]
        HALF_M: gl.constexpr = q.shape[0]
        BLOCK_N_: gl.constexpr = k_bufs.shape[3]
        HEAD_DIM: gl.constexpr = k_bufs.shape[4]
        s_idx = i % STAGES_
        prev = gl.where(i > 0, (i + STAGES_ - 1) % STAGES_, s_idx)
        mbarrier.wait(ready.index(s_idx), (i // STAGES_) & 1)
        k = k_bufs.index(s_idx).reshape([BLOCK_N_, HEAD_DIM])
        v_prev = v_bufs.index(prev).reshape([BLOCK_N_, HEAD_DIM])
        s_token = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([HALF_M, BLOCK_N_], gl.float32, layout=s_layout),
                                use_acc=False, is_async=True)  # fmt: skip
        o_token = warpgroup_mma(p_prev, v_prev, acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_token])  # in order: S is done, P V may still run
        if MASKED:
            offs_n = n * BLOCK_N_ + gl.arange(0, BLOCK_N_, layout=gl.SliceLayout(0, s_layout))
            end_n = gl.load(END + offs_n, mask=offs_n < Tk, other=0)
            visible = (offs_n[None, :] <= pos_m[:, None]) & (pos_m[:, None] < end_n[None, :])
            s = gl.where(visible, s * qk_scale, float("-inf"))  # scaled before masking: -inf * 0 is NaN
            m_new = gl.maximum(m_i, gl.max(s, 1))
            p = gl.exp2(s - m_new[:, None])
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc, p_prev = warpgroup_mma_wait(0, deps=[o_token, p_prev])
        mbarrier.arrive(empty.index(prev), count=1, pred=i > 0)  # V_{i-1}'s buffer is free
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_prev = gl.convert_layout(p.to(q.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
        return i + 1, acc, l_i, m_new, p_prev

    @gluon.jit
    def _compute(q_bufs, k_bufs, v_bufs, q_bar, ready, empty, O, LSE, END, KV_IDX, KV_RUN, SEES_BAD, qk_scale,
                 start, mid, stop, m0, Tq, Tk, stride_ot, o_base, sees_base, lse_base, HALF):  # fmt: skip
        """A compute warpgroup: rows HALF * 64 .. + 63 of the query block, through every key block, then
        the epilogue of tree_attention_fwd_kernel (normalise, isolation's NaN, O and LSE stored)."""
        STAGES_: gl.constexpr = k_bufs.shape[0]
        HALF_M: gl.constexpr = q_bufs.shape[3]
        HEAD_DIM: gl.constexpr = q_bufs.shape[4]
        BLOCK_N_: gl.constexpr = k_bufs.shape[3]
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_N_)
        o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        offs_m = m0 + HALF * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
        pos_m = Tk - Tq + offs_m
        m_i = gl.full([HALF_M], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_layout))  # see the Triton twin
        l_i = gl.zeros([HALF_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, layout=o_layout)
        p_prev = gl.zeros([HALF_M, BLOCK_N_], q_bufs.dtype, layout=p_layout)
        mbarrier.wait(q_bar, 0)
        q = q_bufs.index(HALF).reshape([HALF_M, HEAD_DIM])
        i = 0
        e = start
        while e < mid:  # full blocks, run by run
            length = gl.load(KV_RUN + e)
            first = gl.load(KV_IDX + e)
            for n in range(first, first + length):
                i, acc, l_i, m_i, p_prev = _softmax_block(i, acc, l_i, m_i, p_prev, q, k_bufs, v_bufs, ready, empty,
                                                          n, pos_m, END, Tk, qk_scale, False, s_layout,
                                                          o_layout)  # fmt: skip
            e += length
        for e in range(mid, stop):  # partly visible blocks
            i, acc, l_i, m_i, p_prev = _softmax_block(i, acc, l_i, m_i, p_prev, q, k_bufs, v_bufs, ready, empty,
                                                      gl.load(KV_IDX + e), pos_m, END, Tk, qk_scale, True, s_layout,
                                                      o_layout)  # fmt: skip
        if i > 0:  # the last block's P V
            last = (i + STAGES_ - 1) % STAGES_
            acc = warpgroup_mma(p_prev, v_bufs.index(last).reshape([BLOCK_N_, HEAD_DIM]), acc)
            mbarrier.arrive(empty.index(last), count=1)

        l_i = gl.where(l_i > 0, l_i, 1.0)  # rows past Tq saw nothing; they are not stored
        mask_m = offs_m < Tq
        gl.store(LSE + lse_base + offs_m, (m_i + gl.log2(l_i)) / LOG2E, mask=mask_m)
        offs_mo = gl.convert_layout(offs_m, gl.SliceLayout(1, o_layout))
        sees_bad = gl.load(SEES_BAD + sees_base + offs_mo, mask=offs_mo < Tq, other=0)
        out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        out = gl.where(sees_bad[:, None] != 0, float("nan"), out)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        gl.store(O + o_base + offs_mo[:, None] * stride_ot + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=(offs_mo < Tq)[:, None])  # fmt: skip

    @gluon.jit
    def tree_attention_fwd_hopper_kernel(
        q_desc, k_desc, v_desc, O, LSE, END, KV_COUNT, KV_FULL, KV_IDX, KV_RUN, SEES_BAD,
        qk_scale,  # softmax scale * log2(e), at least 0
        stride_ob, stride_oh, stride_ot, stride_eb, stride_kv_b, NK,
        Hq, GROUP, Tq, Tk,
        STAGES: gl.constexpr,
    ):  # fmt: skip
        HALF_M: gl.constexpr = q_desc.block_type.shape[2]
        pid_m, pid_bh, b, h, hk, start, mid, stop = _query_block_row(KV_FULL, KV_COUNT, stride_kv_b, NK, Hq, GROUP)
        m0 = pid_m * (2 * HALF_M)
        o_base = b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
        sees_base = (b * (Hq // GROUP) + hk).to(gl.int64) * Tq
        lse_base = pid_bh.to(gl.int64) * Tq
        END += b.to(gl.int64) * stride_eb

        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_bufs, v_bufs, ready, empty = _ring(k_desc, v_desc, STAGES, 2)  # both compute warpgroups read every tile
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)

        compute_args = (q_bufs, k_bufs, v_bufs, q_bar, ready, empty, O, LSE, END, KV_IDX, KV_RUN, SEES_BAD, qk_scale,
                        start, mid, stop, m0, Tq, Tk, stride_ot, o_base, sees_base, lse_base)  # fmt: skip
        loader_args = (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, ready, empty, KV_IDX, KV_RUN,
                       start, mid, stop, b, h, hk, m0)  # fmt: skip
        # the half is an argument, a value (a partition's arguments are not constexprs)
        first, second = compute_args + (gl.to_tensor(0),), compute_args + (gl.to_tensor(1),)
        gl.warp_specialize([(_compute, first), (_compute, second), (_loader, loader_args)], [4, 1], [240, 24])


# ------------------------------------------------------------------- dK/dV

DKDV_BLOCK_M, DKDV_BLOCK_N = 64, 128  # queries per step; keys per program (two warpgroups of 64)
DKDV_STAGES = 3


def backward_dkdv(q, k, v, do, lse, delta, dk, dv, end, order, qk_scale, sm_scale, stride_eb, heads_per_row, shares,
                  workspace):  # fmt: skip
    """Write dk, dv as ``tree_attention_bwd_dkdv_kernel`` does (q, do with their non-finite rows zeroed,
    v the forward's; lse and delta the preprocess pass's; ``shares`` the schedule's schedule.DkdvShares,
    whose split units' float32 partials go to ``workspace`` [slots, 2, DKDV_BLOCK_N, D]); ``order`` is
    the schedule's key-block order for (DKDV_BLOCK_M, DKDV_BLOCK_N)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    assert workspace.shape[2] == DKDV_BLOCK_N, "a share unit is one key block of this kernel"
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    block = [1, 1, DKDV_BLOCK_M, D]
    descs = [descriptor(x, block, dtype) for x in (q, k, v, do)]
    # the rows' LSE and delta come through TMA too ([B, Hq, Tq] rows of 16-byte multiples), plain layout
    rows = [descriptor(x, [1, 1, DKDV_BLOCK_M], gl.float32) for x in (lse, delta)]
    tree_attention_bwd_dkdv_hopper_kernel[(order.numel() * heads_per_row * shares.max_shares,)](
        *descs, *rows, dk, dv, end, order, shares.shares, shares.first, workspace, qk_scale, sm_scale,
        *dk.stride()[:3], *dv.stride()[:3], stride_eb, heads_per_row, shares.max_shares, Hkv, Hq // Hkv, Tq, Tk,
        STAGES=DKDV_STAGES, num_warps=4, maxnreg=168,
    )  # fmt: skip


if HAVE_GLUON:

    @gluon.jit
    def _dkdv_loader(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_bufs, v_bufs, q_bufs, do_bufs,
                     lse_bufs, delta_bufs, kv_bar, ready, empty, b, n0, hk, h_lo, h_hi, m_lo, m_hi):  # fmt: skip
        """The loader warp: K and V of the key block (two halves each), then Q, dO, LSE and delta of every
        query block the compute warpgroups walk, in their order."""
        STAGES_: gl.constexpr = q_bufs.shape[0]
        ROWS: gl.constexpr = q_desc.block_type.shape[2]
        tile_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse_desc.block_type.nbytes
                                    + delta_desc.block_type.nbytes)  # fmt: skip
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
        for half in gl.static_range(2):
            tma_load(k_desc, [b, hk, n0 + half * ROWS, 0], kv_bar, k_bufs.index(half))
            tma_load(v_desc, [b, hk, n0 + half * ROWS, 0], kv_bar, v_bufs.index(half))
        i = 0
        for h in range(h_lo, h_hi):  # the program's share of the GQA group's query heads
            for m in range(m_lo, m_hi):  # the three ranges of the compute partitions, back to back
                s = i % STAGES_
                mbarrier.wait(empty.index(s), ((i // STAGES_) & 1) ^ 1)
                mbarrier.expect(ready.index(s), tile_bytes)
                tma_load(q_desc, [b, h, m * ROWS, 0], ready.index(s), q_bufs.index(s))
                tma_load(do_desc, [b, h, m * ROWS, 0], ready.index(s), do_bufs.index(s))
                tma_load(lse_desc, [b, h, m * ROWS], ready.index(s), lse_bufs.index(s))  # past Tq: zeros
                tma_load(delta_desc, [b, h, m * ROWS], ready.index(s), delta_bufs.index(s))
                i += 1

    @gluon.jit
    def _dkdv_step(i, dk, dv, k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, m, offs_n, end_n, q_offset,
                   qk_scale, MASKED: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
        """Query block m of one head against this warpgroup's 64 keys: kernels._dkdv_query_blocks' step."""
        STAGES_: gl.constexpr = q_bufs.shape[0]
        ROWS: gl.constexpr = q_bufs.shape[3]
        HEAD_DIM: gl.constexpr = q_bufs.shape[4]
        offs_m = m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
        s_idx = i % STAGES_
        mbarrier.wait(ready.index(s_idx), (i // STAGES_) & 1)
        lse = lse_bufs.index(s_idx).reshape([ROWS]).load(gl.SliceLayout(0, s_layout)) * LOG2E
        delta = delta_bufs.index(s_idx).reshape([ROWS]).load(gl.SliceLayout(0, s_layout))
        q = q_bufs.index(s_idx).reshape([ROWS, HEAD_DIM])
        do = do_bufs.index(s_idx).reshape([ROWS, HEAD_DIM])
        s_t = warpgroup_mma(k, q.permute((1, 0)), gl.zeros([ROWS, ROWS], gl.float32, layout=s_layout),
                            use_acc=False)  # [keys, queries]: 64 of each  # fmt: skip
        p_t = gl.exp2(s_t * qk_scale - lse[None, :])
        if MASKED:
            pos_m = q_offset + offs_m
            visible = (offs_n[:, None] <= pos_m[None, :]) & (pos_m[None, :] < end_n[:, None])
            p_t = gl.where(visible, p_t, 0.0)
        p_op = gl.convert_layout(p_t.to(q.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
        dv_token = warpgroup_mma(p_op, do, dv, is_async=True)
        dp_token = warpgroup_mma(v, do.permute((1, 0)), gl.zeros([ROWS, ROWS], gl.float32, layout=s_layout),
                                 use_acc=False, is_async=True)  # fmt: skip
        dv, dp_t, p_op = warpgroup_mma_wait(0, deps=[dv_token, dp_token, p_op])
        ds_t = p_t * (dp_t - delta[None, :])
        ds_op = gl.convert_layout(ds_t.to(q.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
        dk = warpgroup_mma(ds_op, q, dk)
        mbarrier.arrive(empty.index(s_idx), count=1)
        return i + 1, dk, dv

    @gluon.jit
    def _dkdv_compute(k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, ready, empty, DK, DV, WS, END,
                      sm_scale, qk_scale, b, hk, n0, h_lo, h_hi, slot, Tq, Tk, m_lo, m_full_lo, m_full_hi,
                      m_hi, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
                      HALF):  # fmt: skip
        """A compute warpgroup: dK and dV of keys n0 + HALF * 64 .. + 63, summed over the program's query
        heads h_lo .. h_hi - 1 and their live query blocks (masked head, full middle, masked tail), then
        stored: in DK and DV, or (``slot`` >= 0) as float32 partials in that workspace slot, where the key
        block's heads are shared out (schedule.DkdvShares)."""
        ROWS: gl.constexpr = q_bufs.shape[3]
        HEAD_DIM: gl.constexpr = q_bufs.shape[4]
        KEYS: gl.constexpr = k_bufs.shape[3]
        s_layout: gl.constexpr = _wgmma_layout(ROWS)
        o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
        offs_n = n0 + HALF * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
        end_n = gl.load(END + offs_n, mask=offs_n < Tk, other=0)
        q_offset = Tk - Tq
        dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=o_layout)
        dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=o_layout)
        mbarrier.wait(kv_bar, 0)
        k = k_bufs.index(HALF).reshape([KEYS, HEAD_DIM])
        v = v_bufs.index(HALF).reshape([KEYS, HEAD_DIM])
        i = 0
        for _ in range(h_lo, h_hi):  # the program's query heads
            for m in range(m_lo, m_full_lo):
                i, dk, dv = _dkdv_step(i, dk, dv, k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, m, offs_n,
                                       end_n, q_offset, qk_scale, True, s_layout, o_layout)  # fmt: skip
            for m in range(m_full_lo, m_full_hi):
                i, dk, dv = _dkdv_step(i, dk, dv, k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, m, offs_n,
                                       end_n, q_offset, qk_scale, False, s_layout, o_layout)  # fmt: skip
            for m in range(m_full_hi, m_hi):
                i, dk, dv = _dkdv_step(i, dk, dv, k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, m, offs_n,
                                       end_n, q_offset, qk_scale, True, s_layout, o_layout)  # fmt: skip

        offs_no = gl.convert_layout(offs_n, gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        live = h_hi > h_lo  # a share has a head at least; the grid's surplus programs have none
        direct = (offs_no < Tk)[:, None] & live & (slot < 0)
        partial = (offs_no < Tk)[:, None] & live & (slot >= 0)
        b64 = b.to(gl.int64)
        hk64 = hk.to(gl.int64)
        gl.store(DK + b64 * stride_dkb + hk64 * stride_dkh + offs_no[:, None] * stride_dkt + offs_d[None, :],
                 (dk * sm_scale).to(DK.dtype.element_ty), mask=direct)  # fmt: skip
        gl.store(DV + b64 * stride_dvb + hk64 * stride_dvh + offs_no[:, None] * stride_dvt + offs_d[None, :],
                 dv.to(DV.dtype.element_ty), mask=direct)  # fmt: skip
        # the slot's [dK, dV] tiles of the key block's 128 keys
        tile = WS + slot.to(gl.int64) * (4 * KEYS * HEAD_DIM) + (offs_no - n0)[:, None] * HEAD_DIM + offs_d[None, :]
        gl.store(tile, dk * sm_scale, mask=partial)
        gl.store(tile + 2 * KEYS * HEAD_DIM, dv, mask=partial)

    @gluon.jit
    def _key_block_query_blocks(END, n0, Tq, Tk, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
        """The query blocks of ROWS that keys n0 .. n0 + BLOCK_N - 1 walk in dK/dV: (m_lo, m_full_lo,
        m_full_hi, m_hi), the middle ones full, every (query, key) pair visible (the Triton dK/dV kernel)."""
        q_offset = Tk - Tq
        key_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=key_layout)
        end_n = gl.load(END + offs_n, mask=offs_n < Tk, other=0)
        k_last = gl.minimum(n0 + BLOCK_N, Tk) - 1
        min_end = gl.min(gl.where(offs_n < Tk, end_n, Tk), 0)
        m_lo = gl.maximum(n0 - q_offset, 0) // ROWS
        m_hi = gl.cdiv(gl.max(end_n, 0) - q_offset, ROWS)
        m_full_lo = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(k_last - q_offset, 0), ROWS), m_lo), m_hi)
        m_full_hi = gl.maximum(gl.minimum(gl.maximum(min_end - q_offset, 0) // ROWS, m_hi), m_full_lo)
        return m_lo, m_full_lo, m_full_hi, m_hi

    @gluon.jit
    def tree_attention_bwd_dkdv_hopper_kernel(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV, END, ORDER, SHARES, FIRST, WS,
        qk_scale, sm_scale,
        stride_dkb, stride_dkh, stride_dkt,
        stride_dvb, stride_dvh, stride_dvt,
        stride_eb, heads_per_row, SPLITS,
        Hkv, GROUP, Tq, Tk,
        STAGES: gl.constexpr,
    ):  # fmt: skip
        ROWS: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N_: gl.constexpr = 2 * ROWS
        # the program's (batch, K/V head, key block, share of the query heads), longest first (as
        # tree_attention_bwd_dkdv_kernel); a key block is a share unit (schedule.DkdvShares), so the
        # ORDER row is the unit
        pid = gl.program_id(0)
        split = pid % SPLITS
        pid = pid // SPLITS
        row = gl.load(ORDER + pid // heads_per_row)
        rest = pid % heads_per_row
        num_n_blocks = gl.cdiv(Tk, BLOCK_N_)
        pid_n = row % num_n_blocks
        b = (row // num_n_blocks) * (heads_per_row // Hkv) + rest // Hkv
        hk = rest % Hkv
        n0 = pid_n * BLOCK_N_
        shares = gl.load(SHARES + row)
        live = split < shares  # the first `shares` programs of the key block take a share each
        h_lo = hk * GROUP + gl.where(live, split * GROUP // shares, 0)
        h_hi = hk * GROUP + gl.where(live, (split + 1) * GROUP // shares, 0)
        slot = gl.where(shares > 1, (gl.load(FIRST + row) + split) * heads_per_row + rest, -1)  # < 2**31 (its bound)
        END += b.to(gl.int64) * stride_eb
        m_lo, m_full_lo, m_full_hi, m_hi = _key_block_query_blocks(END, n0, Tq, Tk, ROWS, BLOCK_N_)

        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        q_bufs, do_bufs, ready, empty = _ring(q_desc, do_desc, STAGES, 2)  # both compute warpgroups read every tile
        lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
        delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)

        compute_args = (k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, ready, empty, DK, DV, WS, END,
                        sm_scale, qk_scale, b, hk, n0, h_lo, h_hi, slot, Tq, Tk, m_lo, m_full_lo, m_full_hi,
                        m_hi, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt)  # fmt: skip
        loader_args = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_bufs, v_bufs, q_bufs, do_bufs,
                       lse_bufs, delta_bufs, kv_bar, ready, empty, b, n0, hk, h_lo, h_hi, m_lo, m_hi)  # fmt: skip
        first, second = compute_args + (gl.to_tensor(0),), compute_args + (gl.to_tensor(1),)
        gl.warp_specialize([(_dkdv_compute, first), (_dkdv_compute, second), (_dkdv_loader, loader_args)], [4, 1],
                           [240, 24])  # fmt: skip


# ---------------------------------------------------------------------- dQ

DQ_BLOCK_M = 64  # the Triton dQ kernel's query block; its key block is the Triton dQ's too (dq_takes)
DQ_STAGES = 2  # 96 KB of shared memory at head dim 128, 80 KB at 64 with 128 keys: two programs per SM


def dq_takes(block_m: int, block_n: int, head_dim: int) -> bool:
    """Whether the dQ kernel here twins the Triton dQ at these blocks: 64 queries, and K/V tiles of at most
    16 KB (64 keys at head dim 128, 128 at 64), so that two programs share an SM."""
    return block_m == DQ_BLOCK_M and block_n in (64, 128) and block_n * head_dim <= 128 * 64


def backward_dq(q, k, v, do, lse, delta, dq, end, lists, qk_scale, sm_scale, batch_strides, block_n):
    """Write dq as ``tree_attention_bwd_dq_kernel`` does (k with its non-finite rows zeroed, v the
    forward's; lse and delta the preprocess pass's; lists for (DQ_BLOCK_M, block_n), which dq_takes)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_block, kv_block = [1, 1, DQ_BLOCK_M, D], [1, 1, block_n, D]
    descs = [descriptor(q, q_block, dtype), descriptor(do, q_block, dtype),
             descriptor(k, kv_block, dtype), descriptor(v, kv_block, dtype)]  # fmt: skip
    num_m_blocks = -(-Tq // DQ_BLOCK_M)
    # 4 warps here and a loader warp rounded to 4: 128 registers each lets two programs share an SM,
    # split 232 / 24
    tree_attention_bwd_dq_hopper_kernel[(num_m_blocks, B * Hq)](
        *descs, lse, delta, dq, end, lists.count, lists.full, lists.idx, lists.run, qk_scale, sm_scale,
        *dq.stride()[:3], *batch_strides, lists.num_key_blocks, delta.stride(1), Hq, Hq // Hkv, Tq, Tk,
        STAGES=DQ_STAGES, num_warps=4, maxnreg=128,
    )  # fmt: skip


if HAVE_GLUON:

    @gluon.jit
    def _dq_loader(q_desc, do_desc, k_desc, v_desc, q_buf, do_buf, k_bufs, v_bufs, q_bar, ready, empty, KV_IDX,
                   KV_RUN, start, mid, stop, b, h, hk, m0):  # fmt: skip
        """The loader warp: Q and dO of the query block, then K and V of its key blocks in order."""
        mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [b, h, m0, 0], q_bar, q_buf)
        tma_load(do_desc, [b, h, m0, 0], q_bar, do_buf)
        _load_key_blocks(start, mid, stop, KV_IDX, KV_RUN, b, hk, k_desc, v_desc, k_bufs, v_bufs, ready, empty)

    @gluon.jit
    def _dq_block(i, dq, q, do, lse, delta, k_bufs, v_bufs, ready, empty, n, pos_m, END, Tk, qk_scale,
                  MASKED: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
        """Key block n, the i-th of the row: kernels._dq_step with its scores."""
        STAGES_: gl.constexpr = k_bufs.shape[0]
        BLOCK_N_: gl.constexpr = k_bufs.shape[3]
        HEAD_DIM: gl.constexpr = k_bufs.shape[4]
        ROWS: gl.constexpr = q.shape[0]
        s_idx = i % STAGES_
        mbarrier.wait(ready.index(s_idx), (i // STAGES_) & 1)
        k = k_bufs.index(s_idx).reshape([BLOCK_N_, HEAD_DIM])
        v = v_bufs.index(s_idx).reshape([BLOCK_N_, HEAD_DIM])
        s_token = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([ROWS, BLOCK_N_], gl.float32, layout=s_layout),
                                use_acc=False, is_async=True)  # fmt: skip
        dp_token = warpgroup_mma(do, v.permute((1, 0)), gl.zeros([ROWS, BLOCK_N_], gl.float32, layout=s_layout),
                                 use_acc=False, is_async=True)  # fmt: skip
        s = warpgroup_mma_wait(1, deps=[s_token])
        p = gl.exp2(s * qk_scale - lse[:, None])
        if MASKED:
            offs_n = n * BLOCK_N_ + gl.arange(0, BLOCK_N_, layout=gl.SliceLayout(0, s_layout))
            end_n = gl.load(END + offs_n, mask=offs_n < Tk, other=0)
            visible = (offs_n[None, :] <= pos_m[:, None]) & (pos_m[:, None] < end_n[None, :])
            p = gl.where(visible, p, 0.0)
        dp = warpgroup_mma_wait(0, deps=[dp_token])
        ds = p * (dp - delta[:, None])
        ds_op = gl.convert_layout(ds.to(q.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
        dq = warpgroup_mma(ds_op, k, dq)
        mbarrier.arrive(empty.index(s_idx), count=1)
        return i + 1, dq

    @gluon.jit
    def _dq_compute(q_buf, do_buf, k_bufs, v_bufs, q_bar, ready, empty, LSE, DELTA, DQ, END, KV_IDX, KV_RUN,
                    qk_scale, sm_scale, start, mid, stop, m0, Tq, Tk, stride_dqt, dq_base, lse_base):  # fmt: skip
        """The compute warpgroup: dQ of the query block over its key blocks, then stored."""
        ROWS: gl.constexpr = q_buf.shape[2]
        HEAD_DIM: gl.constexpr = q_buf.shape[3]
        BLOCK_N_: gl.constexpr = k_bufs.shape[3]
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_N_)
        o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
        offs_m = m0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        pos_m = Tk - Tq + offs_m
        lse = gl.load(LSE + lse_base + offs_m, mask=offs_m < Tq, other=0.0) * LOG2E
        delta = gl.load(DELTA + lse_base + offs_m, mask=offs_m < Tq, other=0.0)
        dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        mbarrier.wait(q_bar, 0)
        q = q_buf.reshape([ROWS, HEAD_DIM])
        do = do_buf.reshape([ROWS, HEAD_DIM])
        i = 0
        e = start
        while e < mid:  # full blocks, run by run
            length = gl.load(KV_RUN + e)
            first = gl.load(KV_IDX + e)
            for n in range(first, first + length):
                i, dq = _dq_block(i, dq, q, do, lse, delta, k_bufs, v_bufs, ready, empty, n, pos_m, END, Tk, qk_scale,
                                  False, s_layout, o_layout)  # fmt: skip
            e += length
        for e in range(mid, stop):  # partly visible blocks
            i, dq = _dq_block(i, dq, q, do, lse, delta, k_bufs, v_bufs, ready, empty, gl.load(KV_IDX + e), pos_m, END,
                              Tk, qk_scale, True, s_layout, o_layout)  # fmt: skip
        offs_mo = gl.convert_layout(offs_m, gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        gl.store(DQ + dq_base + offs_mo[:, None] * stride_dqt + offs_d[None, :],
                 (dq * sm_scale).to(DQ.dtype.element_ty), mask=(offs_mo < Tq)[:, None])  # fmt: skip

    @gluon.jit
    def tree_attention_bwd_dq_hopper_kernel(
        q_desc, do_desc, k_desc, v_desc, LSE, DELTA, DQ, END, KV_COUNT, KV_FULL, KV_IDX, KV_RUN,
        qk_scale, sm_scale,
        stride_dqb, stride_dqh, stride_dqt, stride_eb, stride_kv_b, NK, stride_rows,
        Hq, GROUP, Tq, Tk,
        STAGES: gl.constexpr,
    ):  # fmt: skip
        ROWS: gl.constexpr = q_desc.block_type.shape[2]
        pid_m, pid_bh, b, h, hk, start, mid, stop = _query_block_row(KV_FULL, KV_COUNT, stride_kv_b, NK, Hq, GROUP)
        m0 = pid_m * ROWS
        dq_base = b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh
        lse_base = pid_bh.to(gl.int64) * stride_rows
        END += b.to(gl.int64) * stride_eb

        q_buf = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
        do_buf = gl.allocate_shared_memory(do_desc.dtype, do_desc.block_type.shape, do_desc.layout)
        k_bufs, v_bufs, ready, empty = _ring(k_desc, v_desc, STAGES, 1)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)

        compute_args = (q_buf, do_buf, k_bufs, v_bufs, q_bar, ready, empty, LSE, DELTA, DQ, END, KV_IDX, KV_RUN,
                        qk_scale, sm_scale, start, mid, stop, m0, Tq, Tk, stride_dqt, dq_base, lse_base)  # fmt: skip
        loader_args = (q_desc, do_desc, k_desc, v_desc, q_buf, do_buf, k_bufs, v_bufs, q_bar, ready, empty, KV_IDX,
                       KV_RUN, start, mid, stop, b, h, hk, m0)  # fmt: skip
        gl.warp_specialize([(_dq_compute, compute_args), (_dq_loader, loader_args)], [1], [24])
