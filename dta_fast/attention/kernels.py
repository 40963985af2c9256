"""Tree attention's Triton kernels, in the order of Triton's fused-attention tutorial.

Query at key position i attends key j iff ``j <= i < subtree_end[j]`` (dta_ref.tree_mask,
docs/prefix_tree.md). The queries are the last Tq of the Tk key positions, so a chunk can attend a
cached prefix of ancestors (Tq < Tk). Top to bottom:

- the schedule (``block_lists_kernel`` and friends): per query block, its live key blocks, full ones
  first, split into runs of consecutive blocks; per key block, the query blocks its dK/dV walks and how
  its GQA group's heads are shared out. Built on the GPU, no host sync (``schedule.py`` drives them);
- isolation: non-finite rows zeroed (``finite_rows_kernel``) and the queries that see one of them
  (``queries_seeing_kernel``), so a masked pair never multiplies a NaN (docs/prefix_tree.md,
  "Isolation");
- forward (``tree_attention_fwd_kernel``): a query block walks its full key blocks run by run without
  mask code, then its partly visible ones;
- backward preprocess: delta = rowsum(dO * O), and the rows' NaN carried by the LSE;
- dK/dV (``tree_attention_bwd_dkdv_kernel``): the queries that see a key block are one contiguous
  range; the program walks it, summing over its GQA group's query heads in registers: no atomics,
  deterministic. Where a key block holds more than its share of the GPU, its heads are shared out and
  ``dkdv_shares_sum_kernel`` adds the float32 partials in share order;
- dQ (``tree_attention_bwd_dq_kernel``): a query block walks its key blocks as the forward does.

``function.py`` launches them; ``hopper.py`` holds the warp-specialised Gluon twins of the forward,
dK/dV and dQ kernels (bitwise the same results). Why the kernels are shaped so: docs/design_notes.md.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .interpreter import INTERPRET

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # the kernels run the softmax in base 2


def _configs(kind):
    """Autotune candidates; DTA_AUTOTUNE=0 keeps only the first (tests set it: correctness does not
    depend on warps or stages, and tuning every head dim a test uses costs minutes)."""
    if INTERPRET:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    if os.environ.get("DTA_AUTOTUNE", "1") == "0":
        return _tuned_configs(kind)[:1]
    return _tuned_configs(kind)


def size_class(num_queries: int) -> int:
    """Autotune bucket (the kernels' ``SIZE_CLASS``, a key and nothing else): the warps and stages that
    win on a decode step are not those of a training chunk, and a process tunes once per bucket, on
    the first call that falls in it."""
    return sum(num_queries >= bound for bound in (64, 1024, 16384))


def _tuned_configs(kind):
    # from benchmarks/tune_attention.py and compare_attention.py on H100/H200; the first of each list is
    # what DTA_AUTOTUNE=0 runs, so it fits every block table (128-row tiles want 8 warps)
    warps_stages = {
        "fwd": ((8, 3), (4, 3), (4, 4), (8, 2)),
        "dkdv": ((8, 3), (4, 4), (4, 2), (4, 3), (8, 2)),
        "dq": ((4, 2), (4, 3), (8, 2)),
    }[kind]
    return [triton.Config({}, num_warps=w, num_stages=s) for w, s in warps_stages]


# The schedule.


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _run_starts(ROW_IDX, offs_e, count, num_full):
    """[CHUNK] bool: the entries offs_e of a block-list row that start a run of consecutive key blocks
    (the first entry, the first partly visible one, or one not following its predecessor's block)."""
    valid = (offs_e >= 0) & (offs_e < count)
    block = tl.load(ROW_IDX + offs_e, mask=valid, other=0)
    before = tl.load(ROW_IDX + offs_e - 1, mask=valid & (offs_e > 0), other=-2)
    return valid & ((offs_e == num_full) | (block != before + 1))


@triton.jit
def block_lists_kernel(
    END, POS, COUNT, FULL, IDX, RUN, stride_eb, Tq, Tk, NK, window,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """One (query block, batch row): its live key blocks, those before its last query whose largest
    subtree end passes its first query, written in order (a prefix sum over chunks of key blocks): the
    full ones (every key before its first query, every subtree end past its last query) in a first
    pass, the rest in a second. Then, right to left, each run's length at its first entry (a running
    minimum of the next run's start). With a sliding window over the depths POS, a key block is live
    only if its deepest key is within the window of the block's shallowest query, and full only if its
    shallowest key is within the window of the deepest query."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    row = (b * tl.num_programs(0) + pid_m).to(tl.int64)
    q_first = Tk - Tq + pid_m * BLOCK_M
    q_last = tl.minimum(q_first + BLOCK_M, Tk) - 1
    n_stop = tl.cdiv(q_last + 1, BLOCK_N)  # key blocks starting before its last query
    END += b.to(tl.int64) * stride_eb
    POS += b.to(tl.int64) * stride_eb
    if WINDOW:
        offs_q = q_first + tl.arange(0, BLOCK_M)
        q_depth_min = tl.min(tl.load(POS + offs_q, mask=offs_q <= q_last, other=2**30), 0)
        q_depth_max = tl.max(tl.load(POS + offs_q, mask=offs_q <= q_last, other=0), 0)
    count = 0
    for second in tl.static_range(2):
        for n0 in range(0, n_stop, CHUNK):
            offs_c = n0 + tl.arange(0, CHUNK)
            offs_t = offs_c[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            ends = tl.load(END + offs_t, mask=(offs_t < Tk) & (offs_c[:, None] < n_stop), other=0)
            live = (tl.max(ends, 1) > q_first) & (offs_c < n_stop)
            full = (offs_c * BLOCK_N + BLOCK_N - 1 <= q_first) & (tl.min(ends, 1) > q_last)
            if WINDOW:
                in_range = (offs_t < Tk) & (offs_c[:, None] < n_stop)
                k_depth_max = tl.max(tl.load(POS + offs_t, mask=in_range, other=0), 1)
                k_depth_min = tl.min(tl.load(POS + offs_t, mask=in_range, other=2**30), 1)
                live = live & (q_depth_min - k_depth_max < window)
                full = full & (q_depth_max - k_depth_min < window)
            take = live & (full != second)
            slot = count + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(IDX + row * NK + slot, offs_c, mask=take)
            count += tl.sum(take.to(tl.int32), 0)
        if not second:
            tl.store(FULL + row, count)
            num_full = count
    tl.store(COUNT + row, count)

    tl.debug_barrier()  # the row's entries, written above by other threads of this program
    next_start = count  # the first run start right of the chunk (count: past the last run)
    num_chunks = tl.cdiv(count, CHUNK)
    for i in range(0, num_chunks):
        offs_e = (num_chunks - 1 - i) * CHUNK + tl.arange(0, CHUNK)
        starts = _run_starts(IDX + row * NK, offs_e, count, num_full)
        starts_after = _run_starts(IDX + row * NK, offs_e + 1, count, num_full)
        after = tl.associative_scan(tl.where(starts_after, offs_e + 1, count), 0, _min_combine, reverse=True)
        after = tl.minimum(after, next_start)  # the first run start past each entry
        tl.store(RUN + row * NK + offs_e, tl.where(starts, after - offs_e, 0), mask=offs_e < count)
        next_start = tl.min(tl.where(starts, offs_e, next_start), 0)


@triton.jit
def key_block_work_kernel(
    END, WORK, stride_eb, Tq, Tk, NK,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Query blocks each key block's dK/dV program walks: from the block of its first key's query
    position to the block of its largest subtree end (the kernel's m_lo..m_hi)."""
    b = tl.program_id(1)
    offs_c = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    offs_t = offs_c[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    ends = tl.load(END + b.to(tl.int64) * stride_eb + offs_t, mask=offs_t < Tk, other=0)
    q_offset = Tk - Tq
    m_lo = tl.maximum(offs_c * BLOCK_N - q_offset, 0) // BLOCK_M
    m_hi = (tl.maximum(tl.max(ends, 1) - q_offset, 0) + BLOCK_M - 1) // BLOCK_M
    tl.store(WORK + b * NK + offs_c, tl.maximum(m_hi - m_lo, 0), mask=offs_c < NK)


@triton.jit
def _unit_shares(work, total, F, heads_per_row, GROUP, SMS):
    """Programs sharing each unit's query heads when each should hold at most 1 / (F x SMS) of the
    dK/dV work: ceil(work x F x SMS / (total x heads_per_row)), between 1 and GROUP."""
    den = tl.maximum(total * heads_per_row, 1)
    shares = (work.to(tl.int64) * F * SMS + den - 1) // den
    return tl.minimum(tl.maximum(shares, 1), GROUP).to(tl.int32)


@triton.jit
def dkdv_shares_kernel(
    WORK, SHARES, FIRST, N, heads_per_row, GROUP, SMS, F_MAX, CAPACITY,
    NUM_F: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """One program: SHARES [N] and FIRST [N] of _dkdv_shares from the units' WORK [N], for the
    largest F in F_MAX, F_MAX / 2, ..., 1, 0 whose workspace slots fit CAPACITY (F = 0 splits nothing)."""
    total = tl.zeros([], dtype=tl.int64)
    for start in range(0, N, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        total += tl.sum(tl.load(WORK + offs, mask=offs < N, other=0).to(tl.int64), 0)
    chosen = tl.zeros([], dtype=tl.int64)
    found = tl.zeros([], dtype=tl.int1)
    for i in tl.static_range(NUM_F):
        F = F_MAX >> i
        slots = tl.zeros([], dtype=tl.int64)
        for start in range(0, N, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            shares = _unit_shares(tl.load(WORK + offs, mask=offs < N, other=0), total, F, heads_per_row, GROUP, SMS)
            slots += tl.sum(tl.where((shares > 1) & (offs < N), shares, 0).to(tl.int64), 0)
        take = (found == 0) & (slots * heads_per_row <= CAPACITY)
        chosen = tl.where(take, F, chosen)
        found = found | take
    first = tl.zeros([], dtype=tl.int32)  # a running exclusive sum of the split units' shares
    for start in range(0, N, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        shares = _unit_shares(tl.load(WORK + offs, mask=offs < N, other=0), total, chosen, heads_per_row, GROUP, SMS)
        taken = tl.where(shares > 1, shares, 0)
        tl.store(SHARES + offs, shares, mask=offs < N)
        tl.store(FIRST + offs, first + tl.cumsum(taken, 0) - taken, mask=offs < N)
        first += tl.sum(tl.where(offs < N, taken, 0), 0)


# Isolation.


@triton.jit
def _row_nan(x):
    """[R] float32: 0 for each row of x [R, C] whose entries are all finite, NaN otherwise (x * 0)."""
    return tl.sum(x.to(tl.float32) * 0.0, 1)


@triton.jit
def finite_rows_kernel(
    X, X_FINITE, BAD,
    stride_xb, stride_xh, stride_xt,
    H, T,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """X [B, H, T, D] with every row that holds a non-finite entry zeroed (contiguous), and BAD [B, H, T]
    set to 1 on those rows: one read and one write, the isolation's whole cost outside the loops."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b, h = pid_bh // H, pid_bh % H
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(X + b * stride_xb + h * stride_xh + offs_t[:, None] * stride_xt + offs_d[None, :], mask=mask, other=0.0)
    bad = _row_nan(x) != 0.0  # NaN != 0
    tl.store(
        X_FINITE + pid_bh * T * HEAD_DIM + offs_t[:, None] * HEAD_DIM + offs_d[None, :],
        tl.where(bad[:, None], 0.0, x),
        mask=mask,
    )
    tl.store(BAD + pid_bh * T + offs_t, bad.to(tl.int8), mask=mask_t)


@triton.jit
def queries_seeing_kernel(
    FLAG, END, SEES, stride_eb, H, Tq, Tk, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """One (batch row, head): SEES[i] = 1 where query i sees a flagged key. Key j is seen by the
    positions [j, subtree_end[j]), so position i sees one iff the running max over j <= i of
    ``subtree_end[j]`` on flagged keys passes i: one scan, no T x T mask."""
    pid = tl.program_id(0).to(tl.int64)  # b * H + h
    END += (pid // H) * stride_eb
    q_offset = Tk - Tq
    reach_so_far = 0
    for t0 in range(0, Tk, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        in_range = offs < Tk
        flag = tl.load(FLAG + pid * Tk + offs, mask=in_range, other=0)
        end = tl.load(END + offs, mask=in_range, other=0)
        reach = tl.associative_scan(tl.where(flag != 0, end, 0), 0, _max_combine)
        reach = tl.maximum(reach, reach_so_far)
        reach_so_far = tl.max(reach, 0)
        tl.store(SEES + pid * Tq + offs - q_offset, (reach > offs).to(tl.int8), mask=in_range & (offs >= q_offset))


# Forward.


@triton.jit
def _visible(pos_m, offs_n, end_n):
    """[M, N] bool: query position pos_m may attend key offs_n with subtree end end_n."""
    return (offs_n[None, :] <= pos_m[:, None]) & (pos_m[:, None] < end_n[None, :])


@triton.jit
def _in_window(depth_m, depth_n, window):
    """[M, N] bool: key depth depth_n lies within the sliding window of query depth depth_m."""
    return (depth_m[:, None] - depth_n[None, :]) < window


@triton.jit
def _tanh(x):
    """tanh from exp2 (the interpreter has no libdevice): sign(x) (1 - e) / (1 + e), e = exp(-2 |x|)."""
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _load_tile(ptrs, mask_rows, mask_d, ROWS_IN_RANGE: tl.constexpr, EVEN_D: tl.constexpr):
    """A [rows, BLOCK_D] tile; the loads of a full block (every row in range) at a head dim that fills
    BLOCK_D carry no mask."""
    if ROWS_IN_RANGE and EVEN_D:
        return tl.load(ptrs)
    elif ROWS_IN_RANGE:
        return tl.load(ptrs, mask=mask_d[None, :], other=0.0)
    else:
        return tl.load(ptrs, mask=mask_rows[:, None] & mask_d[None, :], other=0.0)


@triton.jit
def _partial_key_block(K, V, KV_IDX, e, offs_d, mask_d, offs_dv, mask_dv, stride_kt, stride_vt, Tk,
                       BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr):  # fmt: skip
    """Entry e of a block list (forward, dQ), a partly visible block: its key positions, which of them are
    keys, its K and V tiles."""
    offs_n = tl.load(KV_IDX + e) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < Tk
    k = _load_tile(K + offs_n[:, None] * stride_kt + offs_d[None, :], mask_n, mask_d, False, EVEN_D)
    v = _load_tile(V + offs_n[:, None] * stride_vt + offs_dv[None, :], mask_n, mask_dv, False, EVEN_DV)
    return offs_n, mask_n, k, v


@triton.jit
def _full_key_block(K, V, K_DESC, V_DESC, n, b, hk, offs_d, mask_d, offs_dv, mask_dv, stride_kt, stride_vt,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr,
                    EVEN_DV: tl.constexpr, USE_TMA: tl.constexpr):  # fmt: skip
    """The K and V tiles of key block n, every key in range: through TMA descriptors of [B, Hkv, Tk, D]
    where the launch made them (``_tma_descriptors``), else pointer loads (K, V at this head)."""
    if USE_TMA:
        at = [b.to(tl.int32), hk.to(tl.int32), n * BLOCK_N, 0]
        return K_DESC.load(at).reshape(BLOCK_N, BLOCK_D), V_DESC.load(at).reshape(BLOCK_N, BLOCK_DV)
    else:
        offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
        k = _load_tile(K + offs_n[:, None] * stride_kt + offs_d[None, :], None, mask_d, True, EVEN_D)
        v = _load_tile(V + offs_n[:, None] * stride_vt + offs_dv[None, :], None, mask_dv, True, EVEN_DV)
        return k, v


@triton.jit
def _softmax_step(acc, l_i, m_i, s, v, qk_scale, DOT_PRECISION: tl.constexpr):
    """One key block of the online softmax: s its scores, v its value tile, qk_scale what s still needs
    to be multiplied by (at least 0: ``tree_attention`` folds a negative scale's sign into q). The scale
    enters through the row max, max(c s) = c max(s), so scaling and subtracting the max are one FMA per
    score; the loop is bound by such per-score operations more than by its exp2."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _fwd_full_runs(
    acc, l_i, m_i, q, K, V, K_DESC, V_DESC, KV_IDX, RUN, lo, hi, b, hk, offs_d, mask_d, offs_dv, mask_dv,
    qk_scale, softcap_in, softcap_out, stride_kt, stride_vt,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Online softmax over the full key blocks KV_IDX[lo:hi], run by run (no mask code, no list load
    inside a run). A softcap makes the scores softcap_out * tanh(softcap_in * q.k), in log2 units."""
    e = lo
    while e < hi:
        length = tl.load(RUN + e)
        first = tl.load(KV_IDX + e)
        for n in range(first, first + length):
            k, v = _full_key_block(K, V, K_DESC, V_DESC, n, b, hk, offs_d, mask_d, offs_dv, mask_dv, stride_kt,
                                   stride_vt, BLOCK_N, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, USE_TMA)  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
            if SOFTCAP:
                s = softcap_out * _tanh(s * softcap_in)
                acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v, 1.0, DOT_PRECISION)
            else:
                acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v, qk_scale, DOT_PRECISION)
        e += length
    return acc, l_i, m_i


@triton.jit
def _fwd_partial_blocks(
    acc, l_i, m_i, q, K, V, END, POS, KV_IDX, lo, hi, pos_m, depth_m, offs_d, mask_d, offs_dv, mask_dv,
    qk_scale, softcap_in, softcap_out, window, stride_kt, stride_vt, Tk,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """Online softmax over the partly visible key blocks KV_IDX[lo:hi]."""
    for e in range(lo, hi):
        offs_n, mask_n, k, v = _partial_key_block(K, V, KV_IDX, e, offs_d, mask_d, offs_dv, mask_dv, stride_kt,
                                                  stride_vt, Tk, BLOCK_N, EVEN_D, EVEN_DV)  # fmt: skip
        if SOFTCAP:
            s = softcap_out * _tanh(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * softcap_in)
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        end_n = tl.load(END + offs_n, mask=mask_n, other=0)  # [BLOCK_N]
        visible = _visible(pos_m, offs_n, end_n)
        if WINDOW:
            visible = visible & _in_window(depth_m, tl.load(POS + offs_n, mask=mask_n, other=0), window)
        # scaled before masking: -inf times a zero scale would be NaN
        s = tl.where(visible, s, float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v, 1.0, DOT_PRECISION)
    return acc, l_i, m_i


@triton.autotune(configs=_configs("fwd"), key=["HEAD_DIM", "BLOCK_M", "BLOCK_N", "SIZE_CLASS"])
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def tree_attention_fwd_kernel(
    Q, K, V, O, LSE, END, POS, SINKS, KV_COUNT, KV_FULL, KV_IDX, KV_RUN, SEES_BAD, K_DESC, V_DESC,
    qk_scale,  # softmax scale * log2(e)
    softcap_in, softcap_out, window,  # scale / softcap and softcap * log2(e); the sliding window
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    stride_eb, stride_kv_b, NK,
    Hq, GROUP, Tq, Tk, SIZE_CLASS,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b, h = pid_bh // Hq, pid_bh % Hq
    hk = h // GROUP
    q_offset = Tk - Tq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows
    pos_m = q_offset + offs_m  # their key positions
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DIM_V
    mask_m = offs_m < Tq

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    END += b * stride_eb
    POS += b * stride_eb
    depth_m = tl.load(POS + pos_m, mask=mask_m, other=0) if WINDOW else pos_m

    if HAS_SINKS:  # the sink as the first "key": a logit of its own, no value
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINKS + h) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a row may see nothing in a block
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    row = b * stride_kv_b + pid_m  # the schedule is shared by the batch when subtree_end is
    start = row * NK
    mid = start + tl.load(KV_FULL + row)
    stop = start + tl.load(KV_COUNT + row)
    acc, l_i, m_i = _fwd_full_runs(acc, l_i, m_i, q, K, V, K_DESC, V_DESC, KV_IDX, KV_RUN, start, mid, b, hk, offs_d,
                                   mask_d, offs_dv, mask_dv, qk_scale, softcap_in, softcap_out, stride_kt, stride_vt,
                                   BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM == BLOCK_D, HEAD_DIM_V == BLOCK_DV,
                                   DOT_PRECISION, USE_TMA, SOFTCAP)  # fmt: skip
    acc, l_i, m_i = _fwd_partial_blocks(acc, l_i, m_i, q, K, V, END, POS, KV_IDX, mid, stop, pos_m, depth_m, offs_d,
                                        mask_d, offs_dv, mask_dv, qk_scale, softcap_in, softcap_out, window, stride_kt,
                                        stride_vt, Tk, BLOCK_N, HEAD_DIM == BLOCK_D, HEAD_DIM_V == BLOCK_DV,
                                        DOT_PRECISION, SOFTCAP, WINDOW)  # fmt: skip

    l_i = tl.where(l_i > 0, l_i, 1.0)  # rows past Tq saw nothing; they are not stored
    acc = acc / l_i[:, None]
    # isolation: the queries that see a value row zeroed before the launch (a non-finite one) get NaN
    sees_bad = tl.load(SEES_BAD + (b * (Hq // GROUP) + hk) * Tq + offs_m, mask=mask_m, other=0)
    acc = tl.where(sees_bad[:, None] != 0, float("nan"), acc)
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_dv[None, :],
             acc.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])  # fmt: skip
    # natural-log LSE of the scaled scores (and the sink)
    tl.store(LSE + pid_bh * Tq + offs_m, (m_i + tl.log2(l_i)) / LOG2E, mask=mask_m)


# Backward: preprocess.


@triton.jit
def tree_attention_bwd_preprocess_kernel(
    O, DO, Q, LSE, DELTA, LSE_BWD, DO_FINITE, Q_FINITE,
    stride_ob, stride_oh, stride_ot,
    stride_dob, stride_doh, stride_dot,
    stride_qb, stride_qh, stride_qt,
    stride_fb, stride_fh, stride_ft,
    Hq, Tq, stride_rows,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_T: tl.constexpr,
):  # fmt: skip
    """delta[i] = rowsum(dO[i] * O[i]) in float32, the softmax-backward correction. Isolation: dO with
    its non-finite rows zeroed, delta with its non-finite entries zeroed, and an LSE that carries their
    NaN instead, so a masked pair (p = 0) multiplies only finite numbers; and Q with its non-finite rows
    zeroed (contiguous; the forward's LSE already carries their NaN), here rather than in a launch of
    its own: a backward's launches are most of its host cost."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b, h = pid_bh // Hq, pid_bh % Hq
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_t = offs_t < Tq
    mask = mask_t[:, None] & (offs_d < HEAD_DIM)[None, :]
    mask_v = mask_t[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_t[:, None] * stride_ot + offs_dv[None, :], mask=mask_v,
                other=0.0)  # fmt: skip
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_t[:, None] * stride_dot + offs_dv[None, :],
                 mask=mask_v, other=0.0)  # [BLOCK_T, BLOCK_DV]  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row_nan = _row_nan(do) + delta * 0.0  # NaN on the rows whose dO or delta is not finite
    tl.store(DELTA + pid_bh * stride_rows + offs_t, tl.where(row_nan == 0.0, delta, 0.0), mask=mask_t)
    lse = tl.load(LSE + pid_bh * Tq + offs_t, mask=mask_t, other=0.0)
    tl.store(LSE_BWD + pid_bh * stride_rows + offs_t, lse + row_nan, mask=mask_t)
    tl.store(DO_FINITE + b * stride_fb + h * stride_fh + offs_t[:, None] * stride_ft + offs_dv[None, :],
             tl.where((row_nan == 0.0)[:, None], do, 0.0), mask=mask_v)  # fmt: skip
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_t[:, None] * stride_qt + offs_d[None, :], mask=mask, other=0.0)
    tl.store(Q_FINITE + pid_bh * Tq * HEAD_DIM + offs_t[:, None] * HEAD_DIM + offs_d[None, :],
             tl.where((_row_nan(q) == 0.0)[:, None], q, 0.0), mask=mask)  # fmt: skip


# Backward: dK and dV.


@triton.jit
def _dkdv_query_blocks(
    dk, dv, k, v, Qh, DOh, LSE, DELTA, POS, row_base, lo, hi, offs_n, end_n, depth_n, q_offset, offs_d, mask_d,
    offs_dv, mask_dv, qk_scale, softcap_in, softcap_out, window, stride_qt, stride_dot, Tq,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key block summed over the query blocks lo..hi-1 of one query head: all full
    (MASKED false) or all partly visible. With a window, query blocks wholly past it are skipped."""
    for m in range(lo, hi):
        offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < Tq
        if WINDOW:
            depth_m = tl.load(POS + q_offset + offs_m, mask=mask_m, other=2**30)
            reached = tl.min(depth_m, 0) - tl.max(depth_n, 0) < window
        else:
            reached = True
        if reached:
            q = _load_tile(Qh + offs_m[:, None] * stride_qt + offs_d[None, :], mask_m, mask_d, not MASKED, EVEN_D)
            do = _load_tile(DOh + offs_m[:, None] * stride_dot + offs_dv[None, :], mask_m, mask_dv, not MASKED,
                            EVEN_DV)  # fmt: skip
            if MASKED:
                lse = tl.load(LSE + row_base + offs_m, mask=mask_m, other=0.0) * LOG2E
                delta = tl.load(DELTA + row_base + offs_m, mask=mask_m, other=0.0)
            else:
                lse = tl.load(LSE + row_base + offs_m) * LOG2E
                delta = tl.load(DELTA + row_base + offs_m)
            if SOFTCAP:
                t_t = _tanh(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * softcap_in)
                s_t = softcap_out * t_t
            else:
                s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
            p_t = tl.exp2(s_t - lse[None, :])
            if MASKED:
                visible = _visible(q_offset + offs_m, offs_n, end_n)
                if WINDOW:
                    visible = visible & _in_window(depth_m, depth_n, window)
                p_t = tl.where(tl.trans(visible), p_t, 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
            ds_t = p_t * (dp_t - delta[None, :])
            if SOFTCAP:
                ds_t = ds_t * (1.0 - t_t * t_t)
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.autotune(configs=_configs("dkdv"), key=["HEAD_DIM", "BLOCK_M", "BLOCK_N", "SIZE_CLASS"])
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def tree_attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, END, POS, ORDER, SHARES, FIRST, WS,
    qk_scale, sm_scale, softcap_in, softcap_out, window,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dkb, stride_dkh, stride_dkt,
    stride_dvb, stride_dvh, stride_dvt,
    stride_eb, heads_per_row, stride_rows, SPLITS,
    Hq, Hkv, GROUP, Tq, Tk, SIZE_CLASS,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UNIT: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    # Programs run longest key block first: ORDER lists (schedule batch, key block) rows, and a
    # row's heads_per_row (batch, K/V head) pairs run side by side (a shared schedule has one batch row),
    # each as SPLITS programs, of which the first SHARES[unit] take a share of the GQA group's query
    # heads (DkdvShares) and the others have nothing to do.
    pid = tl.program_id(0)
    split = pid % SPLITS
    pid = pid // SPLITS
    row = tl.load(ORDER + pid // heads_per_row)
    rest = pid % heads_per_row
    num_n_blocks = tl.cdiv(Tk, BLOCK_N)
    pid_n = row % num_n_blocks
    unit = (row // num_n_blocks) * tl.cdiv(Tk, UNIT) + pid_n * BLOCK_N // UNIT
    shares = tl.load(SHARES + unit)
    live = split < shares
    b = ((row // num_n_blocks) * (heads_per_row // Hkv) + rest // Hkv).to(tl.int64)
    hk = (rest % Hkv).to(tl.int64)
    q_offset = Tk - Tq
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # key positions
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_n = offs_n < Tk
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    mask_nd = mask_n[:, None] & mask_d[None, :]
    mask_ndv = mask_n[:, None] & mask_dv[None, :]

    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :], mask=mask_nd,
                other=0.0)  # [BLOCK_N, BLOCK_D]  # fmt: skip
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vt + offs_dv[None, :], mask=mask_ndv,
                other=0.0)  # [BLOCK_N, BLOCK_DV]  # fmt: skip
    end_n = tl.load(END + b * stride_eb + offs_n, mask=mask_n, other=0)  # [BLOCK_N]
    POS += b * stride_eb
    depth_n = tl.load(POS + offs_n, mask=mask_n, other=0) if WINDOW else end_n
    k_first = pid_n * BLOCK_N
    k_last = tl.minimum(k_first + BLOCK_N, Tk) - 1
    min_end = tl.min(tl.where(mask_n, end_n, Tk), 0)
    # live queries of this key block: key positions [k_first, max end), in query rows:
    row_lo = tl.maximum(k_first - q_offset, 0)
    row_hi = tl.max(end_n, 0) - q_offset
    m_lo = row_lo // BLOCK_M
    m_hi = tl.cdiv(row_hi, BLOCK_M)

    # query blocks whose every query sees every key of this block: at or after its last key, before
    # its smallest subtree end (a contiguous run of the range; clamped at 0 before dividing). Under a
    # sliding window no block is taken as full: its pairs are masked by depth too.
    if WINDOW:
        m_full_lo = m_hi
        m_full_hi = m_hi
    else:
        m_full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(k_last - q_offset, 0), BLOCK_M), m_lo), m_hi)
        m_full_hi = tl.maximum(tl.minimum(tl.maximum(min_end - q_offset, 0) // BLOCK_M, m_hi), m_full_lo)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    EVEN_DV: tl.constexpr = HEAD_DIM_V == BLOCK_DV
    for g in range(tl.where(live, split * GROUP // shares, 0), tl.where(live, (split + 1) * GROUP // shares, 0)):
        h = hk * GROUP + g
        Qh = Q + b * stride_qb + h * stride_qh
        DOh = DO + b * stride_dob + h * stride_doh
        row_base = (b * Hq + h) * stride_rows
        dk, dv = _dkdv_query_blocks(dk, dv, k, v, Qh, DOh, LSE, DELTA, POS, row_base, m_lo, m_full_lo, offs_n, end_n,
                                    depth_n, q_offset, offs_d, mask_d, offs_dv, mask_dv, qk_scale, softcap_in,
                                    softcap_out, window, stride_qt, stride_dot, Tq, BLOCK_M, True, EVEN_D, EVEN_DV,
                                    DOT_PRECISION, SOFTCAP, WINDOW)  # fmt: skip
        dk, dv = _dkdv_query_blocks(dk, dv, k, v, Qh, DOh, LSE, DELTA, POS, row_base, m_full_lo, m_full_hi, offs_n,
                                    end_n, depth_n, q_offset, offs_d, mask_d, offs_dv, mask_dv, qk_scale, softcap_in,
                                    softcap_out, window, stride_qt, stride_dot, Tq, BLOCK_M, False, EVEN_D, EVEN_DV,
                                    DOT_PRECISION, SOFTCAP, WINDOW)  # fmt: skip
        dk, dv = _dkdv_query_blocks(dk, dv, k, v, Qh, DOh, LSE, DELTA, POS, row_base, m_full_hi, m_hi, offs_n, end_n,
                                    depth_n, q_offset, offs_d, mask_d, offs_dv, mask_dv, qk_scale, softcap_in,
                                    softcap_out, window, stride_qt, stride_dot, Tq, BLOCK_M, True, EVEN_D, EVEN_DV,
                                    DOT_PRECISION, SOFTCAP, WINDOW)  # fmt: skip

    if live:  # the grid's surplus programs write nothing
        if shares == 1:
            tl.store(DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :],
                     (dk * sm_scale).to(DK.dtype.element_ty), mask=mask_nd)  # fmt: skip
            tl.store(DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvt + offs_dv[None, :],
                     dv.to(DV.dtype.element_ty), mask=mask_ndv)  # fmt: skip
        else:  # the share's float32 partials, in its workspace slot: the dK tile, then the dV tile of the unit's keys
            slot = (tl.load(FIRST + unit) + split).to(tl.int64) * heads_per_row + rest
            tile = WS + slot * (UNIT * (HEAD_DIM + HEAD_DIM_V))
            keys = (offs_n % UNIT)[:, None]
            tl.store(tile + keys * HEAD_DIM + offs_d[None, :], dk * sm_scale, mask=mask_nd)
            tl.store(tile + UNIT * HEAD_DIM + keys * HEAD_DIM_V + offs_dv[None, :], dv, mask=mask_ndv)


@triton.jit
def dkdv_shares_sum_kernel(
    WS, SHARES, FIRST, DK, DV,
    stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
    heads_per_row, Hkv, NU, Tk,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    UNIT: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """dK and dV of the split units (DkdvShares): the sums of their shares' float32 partials, added in
    share order (deterministic), in DK's dtype. One program per (schedule row x unit x BLOCK_T of its keys,
    batch x K/V head): a split unit's shares are a few, its keys many, so its rows go to programs of their own."""
    unit = tl.program_id(0) // (UNIT // BLOCK_T)
    rest = tl.program_id(1)
    shares = tl.load(SHARES + unit)
    if shares > 1:
        b = ((unit // NU) * (heads_per_row // Hkv) + rest // Hkv).to(tl.int64)
        hk = (rest % Hkv).to(tl.int64)
        slot = tl.load(FIRST + unit).to(tl.int64) * heads_per_row + rest
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        t0 = tl.program_id(0) % (UNIT // BLOCK_T) * BLOCK_T
        offs_t = t0 + tl.arange(0, BLOCK_T)
        keys = (unit % NU) * UNIT + offs_t
        mask = (keys < Tk)[:, None] & (offs_d < HEAD_DIM)[None, :]
        mask_v = (keys < Tk)[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
        tile = offs_t[:, None] * HEAD_DIM + offs_d[None, :]
        tile_v = UNIT * HEAD_DIM + offs_t[:, None] * HEAD_DIM_V + offs_dv[None, :]
        dk = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_T, BLOCK_DV], dtype=tl.float32)
        for s in range(0, shares):
            partial = WS + (slot + s * heads_per_row) * (UNIT * (HEAD_DIM + HEAD_DIM_V))
            dk += tl.load(partial + tile, mask=mask, other=0.0)
            dv += tl.load(partial + tile_v, mask=mask_v, other=0.0)
        tl.store(DK + b * stride_dkb + hk * stride_dkh + keys[:, None] * stride_dkt + offs_d[None, :],
                 dk.to(DK.dtype.element_ty), mask=mask)  # fmt: skip
        tl.store(DV + b * stride_dvb + hk * stride_dvh + keys[:, None] * stride_dvt + offs_dv[None, :],
                 dv.to(DV.dtype.element_ty), mask=mask_v)  # fmt: skip


# Backward: dQ.


@triton.jit
def _dq_step(dq, p, do, delta, k, v, t, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """dQ of one key block: p its softmax weights (zero where masked), k and v its tiles, t the tanh of a
    softcap's scores."""
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)


@triton.jit
def _dq_full_runs(
    dq, q, do, lse, delta, K, V, KV_IDX, RUN, lo, hi, offs_d, mask_d, offs_dv, mask_dv, qk_scale, softcap_in,
    softcap_out, stride_kt, stride_vt,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """dQ summed over the full key blocks KV_IDX[lo:hi], run by run."""
    e = lo
    while e < hi:
        length = tl.load(RUN + e)
        first = tl.load(KV_IDX + e)
        for n in range(first, first + length):
            k, v = _full_key_block(K, V, K, V, n, 0, 0, offs_d, mask_d, offs_dv, mask_dv, stride_kt, stride_vt,
                                   BLOCK_N, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, False)  # fmt: skip
            if SOFTCAP:
                t = _tanh(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * softcap_in)
                p = tl.exp2(softcap_out * t - lse[:, None])
            else:
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
                p, t = tl.exp2(s - lse[:, None]), s
            dq = _dq_step(dq, p, do, delta, k, v, t, DOT_PRECISION, SOFTCAP)
        e += length
    return dq


@triton.jit
def _dq_partial_blocks(
    dq, q, do, lse, delta, K, V, END, POS, KV_IDX, lo, hi, pos_m, depth_m, offs_d, mask_d, offs_dv, mask_dv,
    qk_scale, softcap_in, softcap_out, window, stride_kt, stride_vt, Tk,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """dQ summed over the partly visible key blocks KV_IDX[lo:hi]."""
    for e in range(lo, hi):
        offs_n, mask_n, k, v = _partial_key_block(K, V, KV_IDX, e, offs_d, mask_d, offs_dv, mask_dv, stride_kt,
                                                  stride_vt, Tk, BLOCK_N, EVEN_D, EVEN_DV)  # fmt: skip
        if SOFTCAP:
            t = _tanh(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * softcap_in)
            s = softcap_out * t
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            t = s
        end_n = tl.load(END + offs_n, mask=mask_n, other=0)
        visible = _visible(pos_m, offs_n, end_n)
        if WINDOW:
            visible = visible & _in_window(depth_m, tl.load(POS + offs_n, mask=mask_n, other=0), window)
        p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
        dq = _dq_step(dq, p, do, delta, k, v, t, DOT_PRECISION, SOFTCAP)
    return dq


@triton.autotune(configs=_configs("dq"), key=["HEAD_DIM", "BLOCK_M", "BLOCK_N", "SIZE_CLASS"])
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def tree_attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, END, POS, KV_COUNT, KV_FULL, KV_IDX, KV_RUN,
    qk_scale, sm_scale, softcap_in, softcap_out, window,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dqb, stride_dqh, stride_dqt,
    stride_eb, stride_kv_b, NK, stride_rows,
    Hq, GROUP, Tq, Tk, SIZE_CLASS,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b, h = pid_bh // Hq, pid_bh % Hq
    hk = h // GROUP
    q_offset = Tk - Tq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pos_m = q_offset + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < Tq
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    mask_md = mask_m[:, None] & mask_d[None, :]

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :], mask=mask_md,
                other=0.0)  # [BLOCK_M, BLOCK_D]  # fmt: skip
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_dv[None, :],
                 mask=mask_m[:, None] & mask_dv[None, :], other=0.0)  # [BLOCK_M, BLOCK_DV]  # fmt: skip
    lse = tl.load(LSE + pid_bh * stride_rows + offs_m, mask=mask_m, other=0.0) * LOG2E
    delta = tl.load(DELTA + pid_bh * stride_rows + offs_m, mask=mask_m, other=0.0)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    END += b * stride_eb
    POS += b * stride_eb
    depth_m = tl.load(POS + pos_m, mask=mask_m, other=0) if WINDOW else pos_m

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row = b * stride_kv_b + pid_m  # the schedule is shared by the batch when subtree_end is
    start = row * NK
    mid = start + tl.load(KV_FULL + row)
    stop = start + tl.load(KV_COUNT + row)
    dq = _dq_full_runs(dq, q, do, lse, delta, K, V, KV_IDX, KV_RUN, start, mid, offs_d, mask_d, offs_dv, mask_dv,
                       qk_scale, softcap_in, softcap_out, stride_kt, stride_vt, BLOCK_N, BLOCK_D, BLOCK_DV,
                       HEAD_DIM == BLOCK_D, HEAD_DIM_V == BLOCK_DV, DOT_PRECISION, SOFTCAP)  # fmt: skip
    dq = _dq_partial_blocks(dq, q, do, lse, delta, K, V, END, POS, KV_IDX, mid, stop, pos_m, depth_m, offs_d, mask_d,
                            offs_dv, mask_dv, qk_scale, softcap_in, softcap_out, window, stride_kt, stride_vt, Tk,
                            BLOCK_N, HEAD_DIM == BLOCK_D, HEAD_DIM_V == BLOCK_DV, DOT_PRECISION, SOFTCAP,
                            WINDOW)  # fmt: skip

    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=mask_md)  # fmt: skip
