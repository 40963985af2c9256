"""The backward with dS stored by the dK/dV pass and dQ = dS K read back from it (Hopper, H=32, D=128).

    python benchmarks/bench_stored_ds.py [--rounds 3] [--sustain 3] [--out DIR]

The dQ pass recomputes S = Q K^T and dP = dO V^T, which the dK/dV pass already has: 7 products per
visible pair where 5 are needed. Instead of adding dQ inside the dK/dV pass (float32 additions,
"dQ inside the dK/dV pass" in docs/benchmarks.md), the dK/dV pass here writes each step's dS^T (64
keys x 64 queries, bfloat16, the same rounding the dQ pass gives dS before its product) to a buffer,
and a dQ pass multiplies it by K: one product instead of three, no additions across programs, and
the same blocks in the same order as the dQ pass, so dQ is bitwise the same.

The dK/dV kernel is ``attention_hopper``'s (for one tree and no split of the query heads) with one
change. Each step stages its dS^T half in a
buffer of the step's stage, and the loader warp, before refilling that stage, stores the staged
halves by TMA and waits until they are read. So the compute warpgroups never wait on a store.
``staged`` stages without storing, and ``stores`` stores without staging (dQ is wrong in both: the
two timings split the cost). The stored tiles are indexed per (batch row, key block of 128) from
the dK/dV pass's own query-block range: ``ds_tiles``.

Timed against the library's two passes on the same inputs (the preprocess and the forward are run
once, outside). Gated bitwise on dK, dV and dQ. ``do_bench`` medians over rounds, the variants
interleaved. With ``--sustain`` also the two backwards at the GPU's power cap, as bench_power.py
times them (calls back to back for that many seconds after 3 s idle, then their median and the
energy of one). Prints a table and writes stored_ds.json.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.testing import do_bench

from bench_attention import build_tree, write_results
from bench_power import Sampler, sustained
from dta_fast import attention, attention_hopper, build_schedule
from dta_fast.attention_hopper import (TensorDescriptor, _descriptor, _key_block_query_blocks, _ring, _tma_load,
                                      _wgmma_layout)

_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global  # 3.6: the older name

SHAPES = [
    dict(name="GRPO P=2K N=8 R=1K", kind="grpo", P=2048, N=8, R=1024),
    dict(name="GRPO P=1K N=64 R=512", kind="grpo", P=1024, N=64, R=512),
    dict(name="GRPO P=8K N=16 R=1K", kind="grpo", P=8192, N=16, R=1024),
]
H, D = 32, 128
ROWS = gl.constexpr(64)  # queries per dK/dV step, keys per warpgroup: a stored tile is ROWS x ROWS
MODES = {"stored": 0, "staged": 1, "stores": 2}


def ds_tiles(end: torch.Tensor, Tq: int) -> tuple[torch.Tensor, int]:
    """(base [Be * Nk] int32, tiles): the stored dS of (batch row b, key block nb of 128, query block m
    of 64) is tile base[b * Nk + nb] + m, its two key halves at rows (2 * tile + half) * 64. Counts
    each key block's query range as the dK/dV kernel walks it. One host sync, for the total."""
    Be, Tk = end.shape
    Nk = -(-Tk // 128)
    work = attention._key_block_work(end, Tq, ROWS.value, 128).long()
    m_lo = (torch.arange(Nk, device=end.device) * 128 - (Tk - Tq)).clamp(min=0) // ROWS.value
    base = (torch.cumsum(work, 0) - work).view(Be, Nk) - m_lo
    return base.flatten().to(torch.int32), int(work.sum())


@gluon.jit
def _store_step(j, ds_desc, ds_bufs, empty, b, h_lo, m_lo, nm, Hq, tile0, MODE: gl.constexpr):
    """Step j's two staged dS^T halves to global, once both warpgroups have released its stage."""
    STAGES: gl.constexpr = ds_bufs.shape[0] // 2
    s = j % STAGES
    mbarrier.wait(empty.index(s), (j // STAGES) & 1)
    if MODE != 1:
        tile = tile0 + m_lo + j % nm
        for half in gl.static_range(2):
            _tma_store(ds_desc, [b * Hq + h_lo + j // nm, (tile * 2 + half) * ROWS, 0], ds_bufs.index(s * 2 + half))


@gluon.jit
def _loader(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs,
            delta_bufs, kv_bar, ready, empty, b, n0, hk, h_lo, h_hi, m_lo, m_hi, ds_desc, ds_bufs, Hq, tile0,
            mode_buf):  # fmt: skip
    """attention_hopper's dK/dV loader; before refilling a stage it stores the dS its last step staged
    and waits until the store has read it, so the step that next stages there finds it free."""
    STAGES: gl.constexpr = q_bufs.shape[0]
    MODE: gl.constexpr = mode_buf.shape[0] - 1
    tile_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse_desc.block_type.nbytes
                                + delta_desc.block_type.nbytes)  # fmt: skip
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for half in gl.static_range(2):
        _tma_load(k_desc, [b, hk, n0 + half * ROWS, 0], kv_bar, k_bufs.index(half))
        _tma_load(v_desc, [b, hk, n0 + half * ROWS, 0], kv_bar, v_bufs.index(half))
    nm = gl.maximum(m_hi - m_lo, 1)
    i = 0
    for h in range(h_lo, h_hi):
        for m in range(m_lo, m_hi):
            s = i % STAGES
            if i >= STAGES:
                _store_step(i - STAGES, ds_desc, ds_bufs, empty, b, h_lo, m_lo, nm, Hq, tile0, MODE)
                tma.store_wait(0)
            else:
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), tile_bytes)
            _tma_load(q_desc, [b, h, m * ROWS, 0], ready.index(s), q_bufs.index(s))
            _tma_load(do_desc, [b, h, m * ROWS, 0], ready.index(s), do_bufs.index(s))
            _tma_load(lse_desc, [b, h, m * ROWS], ready.index(s), lse_bufs.index(s))
            _tma_load(delta_desc, [b, h, m * ROWS], ready.index(s), delta_bufs.index(s))
            i += 1
    for j in range(gl.maximum(i - STAGES, 0), i):  # the last steps' dS
        _store_step(j, ds_desc, ds_bufs, empty, b, h_lo, m_lo, nm, Hq, tile0, MODE)
    tma.store_wait(0)


@gluon.jit
def _step(i, dk, dv, k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, ds_bufs, m, offs_n, end_n,
          q_offset, qk_scale, HALF, MASKED: gl.constexpr, MODE: gl.constexpr, s_layout: gl.constexpr,
          o_layout: gl.constexpr):  # fmt: skip
    """attention_hopper's dK/dV step, staging its dS^T in the stage's buffer (MODE 0 and 1)."""
    STAGES: gl.constexpr = q_bufs.shape[0]
    HEAD_DIM: gl.constexpr = q_bufs.shape[4]
    offs_m = m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
    s_idx = i % STAGES
    mbarrier.wait(ready.index(s_idx), (i // STAGES) & 1)
    lse = lse_bufs.index(s_idx).reshape([ROWS]).load(gl.SliceLayout(0, s_layout)) * 1.4426950408889634
    delta = delta_bufs.index(s_idx).reshape([ROWS]).load(gl.SliceLayout(0, s_layout))
    q = q_bufs.index(s_idx).reshape([ROWS, HEAD_DIM])
    do = do_bufs.index(s_idx).reshape([ROWS, HEAD_DIM])
    s_t = warpgroup_mma(k, q.permute((1, 0)), gl.zeros([ROWS, ROWS], gl.float32, layout=s_layout), use_acc=False)
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
    ds = (p_t * (dp_t - delta[None, :])).to(q.dtype)
    if MODE != 2:
        ds_bufs.index(s_idx * 2 + HALF).reshape([ROWS, ROWS]).store(ds)
        fence_async_shared()  # before the loader's TMA store reads it
    ds_op = gl.convert_layout(ds, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    dk = warpgroup_mma(ds_op, q, dk)
    mbarrier.arrive(empty.index(s_idx), count=1)
    return i + 1, dk, dv


@gluon.jit
def _compute(k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, ready, empty, ds_bufs, mode_buf, DK,
             DV, END, sm_scale, qk_scale, b, hk, n0, GROUP, Tq, Tk, m_lo, m_full_lo, m_full_hi, m_hi, stride_dkb,
             stride_dkh, stride_dkt, HALF):  # fmt: skip
    """attention_hopper's dK/dV compute warpgroup (one split, dk and dv of the same strides)."""
    MODE: gl.constexpr = mode_buf.shape[0] - 1
    HEAD_DIM: gl.constexpr = q_bufs.shape[4]
    s_layout: gl.constexpr = _wgmma_layout(ROWS)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    offs_n = n0 + HALF * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    end_n = gl.load(END + offs_n, mask=offs_n < Tk, other=0)
    q_offset = Tk - Tq
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    mbarrier.wait(kv_bar, 0)
    k = k_bufs.index(HALF).reshape([ROWS, HEAD_DIM])
    v = v_bufs.index(HALF).reshape([ROWS, HEAD_DIM])
    i = 0
    for _ in range(0, GROUP):
        for m in range(m_lo, m_full_lo):
            i, dk, dv = _step(i, dk, dv, k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, ds_bufs, m,
                              offs_n, end_n, q_offset, qk_scale, HALF, True, MODE, s_layout, o_layout)  # fmt: skip
        for m in range(m_full_lo, m_full_hi):
            i, dk, dv = _step(i, dk, dv, k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, ds_bufs, m,
                              offs_n, end_n, q_offset, qk_scale, HALF, False, MODE, s_layout, o_layout)  # fmt: skip
        for m in range(m_full_hi, m_hi):
            i, dk, dv = _step(i, dk, dv, k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, ds_bufs, m,
                              offs_n, end_n, q_offset, qk_scale, HALF, True, MODE, s_layout, o_layout)  # fmt: skip
    offs_no = gl.convert_layout(offs_n, gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    rows = b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh + offs_no[:, None] * stride_dkt + offs_d[None, :]
    mask = (offs_no < Tk)[:, None]
    gl.store(DK + rows, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask)
    gl.store(DV + rows, dv.to(DV.dtype.element_ty), mask=mask)


@gluon.jit
def dkdv_storing_ds_kernel(
    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, ds_desc, DK, DV, END, ORDER, BASE,
    qk_scale, sm_scale, stride_dkb, stride_dkh, stride_dkt, stride_eb, Hkv, GROUP, Tq, Tk,
    STAGES: gl.constexpr, MODE: gl.constexpr,
):  # fmt: skip
    BLOCK_N: gl.constexpr = 2 * ROWS
    pid = gl.program_id(0)
    row = gl.load(ORDER + pid // Hkv)  # one split; a batch of one tree (the shapes here)
    tile0 = gl.load(BASE + row)
    num_n_blocks = gl.cdiv(Tk, BLOCK_N)
    b = row // num_n_blocks
    hk = pid % Hkv
    n0 = (row % num_n_blocks) * BLOCK_N
    END += b.to(gl.int64) * stride_eb
    m_lo, m_full_lo, m_full_hi, m_hi = _key_block_query_blocks(END, n0, Tq, Tk, ROWS, BLOCK_N)

    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_bufs, do_bufs, ready, empty = _ring(q_desc, do_desc, STAGES, 2)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    ds_bufs = gl.allocate_shared_memory(ds_desc.dtype, [2 * STAGES] + ds_desc.block_type.shape, ds_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    # Triton 3.6 hands warp_specialize's partitions their constexpr arguments as values: MODE rides on a shape
    mode_buf = gl.allocate_shared_memory(gl.int64, [MODE + 1], mbarrier.MBarrierLayout())
    h_lo = hk * GROUP
    compute_args = (k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, ready, empty, ds_bufs, mode_buf,
                    DK, DV, END, sm_scale, qk_scale, b, hk, n0, GROUP, Tq, Tk, m_lo, m_full_lo, m_full_hi, m_hi,
                    stride_dkb, stride_dkh, stride_dkt)  # fmt: skip
    loader_args = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_bufs, v_bufs, q_bufs, do_bufs,
                   lse_bufs, delta_bufs, kv_bar, ready, empty, b, n0, hk, h_lo, h_lo + GROUP, m_lo, m_hi, ds_desc,
                   ds_bufs, Hkv * GROUP, tile0, mode_buf)  # fmt: skip
    gl.warp_specialize([(_compute, compute_args + (gl.to_tensor(0),)), (_compute, compute_args + (gl.to_tensor(1),)),
                        (_loader, loader_args)], [4, 1], [240, 24])  # fmt: skip


@gluon.jit
def _dq_loader(k_desc, ds_desc, k_bufs, ds_bufs, ready, empty, KV_IDX, BASE, start, stop, b, bh, hk, m, base_row):
    """K of the row's key blocks of 64 (the dQ pass's block lists, in their order) and their stored dS^T."""
    STAGES: gl.constexpr = k_bufs.shape[0]
    i = 0
    for e in range(start, stop):
        n = gl.load(KV_IDX + e)
        tile = gl.load(BASE + base_row + n // 2) + m
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + ds_desc.block_type.nbytes)
        _tma_load(k_desc, [b, hk, n * ROWS, 0], ready.index(s), k_bufs.index(s))
        _tma_load(ds_desc, [bh, (tile * 2 + n % 2) * ROWS, 0], ready.index(s), ds_bufs.index(s))
        i += 1


@gluon.jit
def _dq_compute(k_bufs, ds_bufs, ready, empty, DQ, start, stop, m0, Tq, stride_dqt, dq_base, sm_scale):
    """dQ of the query block: the stored dS (dS^T read transposed) times K, block by block."""
    STAGES: gl.constexpr = k_bufs.shape[0]
    HEAD_DIM: gl.constexpr = k_bufs.shape[4]
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    i = 0
    for e in range(start, stop):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        ds_t = ds_bufs.index(s).reshape([ROWS, ROWS])  # [keys, queries]
        dq = warpgroup_mma(ds_t.permute((1, 0)), k_bufs.index(s).reshape([ROWS, HEAD_DIM]), dq)
        mbarrier.arrive(empty.index(s), count=1)
        i += 1
    offs_m = m0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(DQ + dq_base + offs_m[:, None] * stride_dqt + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=(offs_m < Tq)[:, None])  # fmt: skip


@gluon.jit
def dq_from_ds_kernel(k_desc, ds_desc, DQ, KV_COUNT, KV_IDX, BASE, sm_scale, stride_dqb, stride_dqh, stride_dqt, NK,
                      Hq, GROUP, Tq, STAGES: gl.constexpr):  # fmt: skip
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    start = pid_m.to(gl.int64) * NK  # one tree for the batch
    stop = start + gl.load(KV_COUNT + pid_m)
    dq_base = b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh
    k_bufs, ds_bufs, ready, empty = _ring(k_desc, ds_desc, STAGES, 1)
    compute_args = (k_bufs, ds_bufs, ready, empty, DQ, start, stop, pid_m * ROWS, Tq, stride_dqt, dq_base, sm_scale)
    loader_args = (k_desc, ds_desc, k_bufs, ds_bufs, ready, empty, KV_IDX, BASE, start, stop, b, pid_bh, h // GROUP,
                   pid_m, 0)  # fmt: skip
    gl.warp_specialize([(_dq_compute, compute_args), (_dq_loader, loader_args)], [1], [24])


def _ds_descriptor(ds):
    block = [1, ROWS.value, ROWS.value]
    return TensorDescriptor(ds, list(ds.shape), list(ds.stride()), block,
                            gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))  # fmt: skip


def bench_shape(shape, rounds, sampler=None, sustain=0.0):
    tree = build_tree(shape)
    schedule = build_schedule(tree.subtree_end.cuda())
    end, T = schedule.subtree_end, tree.num_tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, H, T, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = D**-0.5
    qk_scale = scale * attention.LOG2E
    o, lse, v_finite = attention._forward(q, k, v, schedule, scale)
    delta, lse_bwd, do_finite, q_finite = attention._backward_preprocess(o, do, q, lse)
    k_finite = attention._finite_rows(k)[0]
    order = schedule.key_block_order(attention_hopper.DKDV_BLOCK_M, attention_hopper.DKDV_BLOCK_N)
    shares = schedule.dkdv_shares(H, 1, D)  # one query head per K/V head: one program per key block
    workspace = shares.workspace(D, "cuda")
    lists = schedule.block_lists(attention_hopper.DQ_BLOCK_M, attention_hopper.DQ_BLOCK_N)
    base, tiles = ds_tiles(end, T)
    ds = torch.empty(H, tiles * 2 * ROWS.value, ROWS.value, device="cuda", dtype=torch.bfloat16)
    out = {n: torch.empty_like(x) for n, x in (("dk", k), ("dv", v), ("dq", q), ("dk2", k), ("dv2", v), ("dq2", q))}

    def two_passes():  # the library's kernels
        attention_hopper.backward_dkdv(q_finite, k, v_finite, do_finite, lse_bwd, delta, out["dk"], out["dv"], end,
                                       order, qk_scale, scale, 0, H, shares, workspace)  # fmt: skip
        attention_hopper.backward_dq(q, k_finite, v_finite, do, lse_bwd, delta, out["dq"], end, lists, qk_scale,
                                     scale, (0, 0))  # fmt: skip

    def dkdv(mode):
        descs = [_descriptor(x, [1, 1, ROWS.value, D], gl.bfloat16) for x in (q_finite, k, v_finite, do_finite)]
        rows = [_descriptor(x, [1, 1, ROWS.value], gl.float32) for x in (lse_bwd, delta)]
        dkdv_storing_ds_kernel[(order.numel() * H,)](
            *descs, *rows, _ds_descriptor(ds), out["dk2"], out["dv2"], end, order, base, qk_scale, scale,
            *out["dk2"].stride()[:3], 0, H, 1, T, T, STAGES=attention_hopper.DKDV_STAGES, MODE=MODES[mode],
            num_warps=4, maxnreg=168,
        )  # fmt: skip

    def dq_from_ds():
        k_desc = _descriptor(k_finite, [1, 1, ROWS.value, D], gl.bfloat16)
        dq_from_ds_kernel[(-(-T // ROWS.value), H)](
            k_desc, _ds_descriptor(ds), out["dq2"], lists.count, lists.idx, base, scale, *out["dq2"].stride()[:3],
            lists.num_key_blocks, H, 1, T, STAGES=4, num_warps=4, maxnreg=128,
        )  # fmt: skip

    two_passes()
    dkdv("stored")
    dq_from_ds()
    torch.cuda.synchronize()
    gate = {n: torch.equal(out[n], out[n + "2"]) for n in ("dk", "dv", "dq")}
    variants = {
        "two passes (now)": two_passes,
        "dK/dV pass (now)": lambda: attention_hopper.backward_dkdv(
            q_finite, k, v_finite, do_finite, lse_bwd, delta, out["dk"], out["dv"], end, order, qk_scale, scale, 0, H,
            shares, workspace),  # fmt: skip
        "dQ pass (now)": lambda: attention_hopper.backward_dq(
            q, k_finite, v_finite, do, lse_bwd, delta, out["dq"], end, lists, qk_scale, scale, (0, 0)),
        "dK/dV storing dS, dQ from it": lambda: (dkdv("stored"), dq_from_ds()),
        "dK/dV storing dS": lambda: dkdv("stored"),
        "dQ from dS": dq_from_ds,
        "dK/dV, dS staged only": lambda: dkdv("staged"),
        "dK/dV, dS stores only": lambda: dkdv("stores"),
    }
    times = {n: [] for n in variants}
    for _ in range(rounds):
        for n, fn in variants.items():
            times[n].append(do_bench(fn))
    row = dict(name=shape["name"], T=T, ds_gib=ds.numel() * 2 / 2**30, bitwise=gate,
               ms={n: statistics.median(t) for n, t in times.items()}, ms_rounds=times)  # fmt: skip
    if sampler is not None:
        row["sustained"] = {n: sustained(variants[n], [], sampler, 3.0, sustain)
                            for n in ("two passes (now)", "dK/dV storing dS, dQ from it")}  # fmt: skip
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sustain", type=float, default=0.0, help="seconds at the power cap (0: not timed)")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    sampler = Sampler(torch.device("cuda")) if args.sustain else None
    rows = []
    for shape in SHAPES:
        row = bench_shape(shape, args.rounds, sampler, args.sustain)
        rows.append(row)
        print(f"\n{row['name']} (dS {row['ds_gib']:.2f} GiB; bitwise dK, dV, dQ: {row['bitwise']})")
        for n, ms in row["ms"].items():
            print(f"  {n:32s} {ms:8.3f} ms")
        for n, r in row.get("sustained", {}).items():
            energy = f", {r['mhz']:.0f} MHz, {r['watts']:.0f} W, {r['mj_per_call']:.0f} mJ" if "watts" in r else ""
            print(f"  at the power cap: {n:29s} {r['ms']:8.3f} ms{energy}")
        torch.cuda.empty_cache()
    if sampler is not None:
        sampler.close()
    harness = f"do_bench medians of {args.rounds} rounds; sustained: bench_power.sustained, {args.sustain} s"
    path = write_results(args.out, "stored_ds.json", rows, harness=harness, H=H, D=D, dtype="bfloat16")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
