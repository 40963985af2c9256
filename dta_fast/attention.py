"""Tree attention in Triton, forward and backward, from O(T) tree metadata.

Query at key position i attends key j iff ``j <= i < subtree_end[j]``
(docs/prefix_tree.md). The queries are the last Tq of the Tk key positions,
so a chunk can attend a cached prefix of ancestors (Tq < Tk).

Layout of this file, top to bottom: the block schedule (built on the GPU from
``subtree_end``), the forward kernel, the dK/dV kernel, the dQ kernel, the
autograd Function and the public ``tree_attention``.

- Forward and dQ: a query block visits only its live key blocks, listed per
  query block (``kv_count``/``kv_idx``) by one small kernel with no host sync.
- dK/dV: the queries that see key j are ``[j, subtree_end[j])``; for
  consecutive keys these ranges chain, so a key block's live queries are one
  contiguous range. The kernel walks it directly, summing over the query
  heads of its GQA group in registers: no atomics, bitwise deterministic.
  Where a key block would hold more than its share of the GPU (a shared
  prompt's keys walk every query; few K/V heads; a short call), its
  group's heads are shared out over several programs whose float32
  partials one more pass adds in share order (``DkdvShares``).
- Blocks whose every (query, key) pair is visible (full blocks) run in a loop
  of their own, without mask code: the lists hold a row's full key blocks
  first, and a key block's full query blocks are a contiguous run.
- Forward and dQ walk their full key blocks run by run (consecutive blocks:
  a prompt, a node's own earlier tokens; ``BlockLists.run``), a run's
  addresses computed from its first block, not loaded entry by entry; on
  Hopper and later the forward loads those K and V tiles through TMA
  descriptors (``_tma_descriptors``).
- On Hopper, for 16-bit inputs at head dims 64 and 128, the three kernels
  run as warp-specialised twins written in Gluon (``attention_hopper``):
  each key or query meets its blocks in the same order, so the results are
  bitwise the same.
- dK/dV programs start longest first (``TreeSchedule.key_block_order``),
  the heads of one key block side by side: the key blocks of a shared prompt
  walk every query, and launched in place they would start last for the
  last heads and run on alone at the end of the kernel.

- A key a query cannot see never reaches that query's output, nor a masked
  pair any gradient, even when its rows hold NaN or inf: the forward runs on
  V with its non-finite rows zeroed and its epilogue sets the output of the
  queries that see such a row to NaN (found in O(T) from subtree_end); the
  backward passes Q, K and dO with their non-finite rows zeroed and lets the
  LSE carry the NaN of their rows (docs/prefix_tree.md, "Isolation"). The
  loops are the ones without isolation: its cost is one fused read and write
  of V and of K (``finite_rows_kernel``), and of Q in the backward's
  preprocess pass.

Limits: head dims up to 256 (64, 80, 96, 128, 256 tested); float16, bfloat16,
float32 (dot products in ieee float32); no dropout, no softcap, no sliding
window. Building a schedule needs no host sync (its block lists and run lengths
take 8 bytes per query-block, key-block pair); checking a ``subtree_end`` (what
``tree_attention`` does when given one) syncs: build the schedule once with
``build_schedule`` and pass it to every layer.
A query that sees a non-finite value row gets NaN where plain attention might
give inf. A row's running maximum starts at -1e30, not -inf (a row may see no
key of a block): a query whose every scaled score (scale * q.k, in float32)
is below about -1e29 gets 0 and a wrong LSE. Under the Triton interpreter,
Triton 3.6 needs the loop-bound fix below to run with NumPy 2.4.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dta_ref.attention import autocast_inputs, check_scale, refuse_create_graph
from dta_ref.tree import nesting_depth

from dta_fast import attention_hopper  # absolute: benchmarks load copies of this file as top-level modules

LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _fix_interpreter_loop_bounds() -> None:
    """Let Triton 3.6's interpreter run these kernels under NumPy >= 2.4.

    The interpreter holds a scalar as a 1-element array and takes ``int()`` of
    it for a loop bound read from memory (``range(start, stop)`` below); NumPy
    2.4 refuses ``int()`` of a 1-D array. Later Triton releases squeeze the
    array first; this does the same where the installed interpreter does not.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "squeezes_scalars", False):
        return
    if list(inspect.signature(original).parameters) != ["tensor", "scope"]:
        return  # an interpreter this was not written for: leave it alone

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRET and tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
    _fix_interpreter_loop_bounds()


# ---------------------------------------------------------------- schedule


def validate_subtree_end(subtree_end: torch.Tensor) -> None:
    """Raise ValueError unless subtree_end ([T], or [B, T]: every row) is a preorder forest
    (dta_ref.tree.nesting_depth); TypeError unless it is an integer tensor."""
    _check_subtree_end_type(subtree_end)
    nesting_depth(subtree_end if subtree_end.dim() == 2 else subtree_end[None])


def _check_subtree_end_type(subtree_end) -> None:
    if not isinstance(subtree_end, torch.Tensor):
        raise TypeError(f"subtree_end must be a tensor, got {type(subtree_end).__name__}")
    if subtree_end.dtype not in (torch.int32, torch.int64, torch.int16):
        raise TypeError(f"subtree_end must be an integer tensor, got {subtree_end.dtype}")
    if subtree_end.dim() not in (1, 2):
        raise ValueError(f"subtree_end must be [Tk] or [B, Tk], got shape {tuple(subtree_end.shape)}")


def _validate_once(subtree_end: torch.Tensor) -> None:
    """Check a subtree_end tensor once until it is written in place (its version counter moves): the
    layers of a model pass one tensor to every call, and each check is a host sync."""
    rows = subtree_end if subtree_end.dim() == 2 else subtree_end[None]
    if not subtree_end.is_inference() and getattr(subtree_end, "_dta_checked_version", None) == subtree_end._version:
        return
    if subtree_end.is_cuda and torch.cuda.is_current_stream_capturing():
        # the check reads the tree on the host, which would end the capture with an unnamed CUDA error
        raise ValueError(
            "subtree_end is checked on the host, which a CUDA graph capture does not allow: check it before "
            "capturing (build_schedule(subtree_end), or one tree_attention call with it) and capture with "
            "that schedule or tensor, or pass build_schedule(..., validate=False) for a tree known valid"
        )
    validate_subtree_end(rows)
    if not subtree_end.is_inference():  # an inference tensor has no version counter: checked every time
        subtree_end._dta_checked_version = subtree_end._version


@dataclass
class TreeSchedule:
    """Per-tree data shared by every attention call over the same tree (e.g. all layers).

    ``block_lists(BLOCK_M, BLOCK_N)`` lists, per query block, its live key
    blocks; ``key_block_order`` ranks the key blocks by the queries they walk
    in dK/dV; ``dkdv_shares`` shares out the query heads of the key blocks
    that walk the most. Each is built on the GPU without waiting for it, once
    per block shape (or head layout), and kept; except inside a CUDA graph capture, where a
    kernel only records its work: what it builds there is filled in when the
    graph replays, so it serves that graph and is not kept for later calls.
    """

    subtree_end: torch.Tensor  # [B, Tk] int32, contiguous; the schedule's own (build_schedule copies it)
    num_queries: int
    _lists: dict = field(default_factory=dict, repr=False)
    _order: dict = field(default_factory=dict, repr=False)
    _work: dict = field(default_factory=dict, repr=False)
    _shares: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        # what the kernels assume of it; build_schedule also checks the tree (a host sync)
        end = self.subtree_end
        if not (isinstance(end, torch.Tensor) and end.dtype == torch.int32 and end.dim() == 2 and end.is_contiguous()):
            got = f"{end.dtype} of shape {tuple(end.shape)}" if isinstance(end, torch.Tensor) else type(end).__name__
            raise ValueError(
                f"TreeSchedule.subtree_end must be a contiguous int32 [B, Tk] tensor (build_schedule makes one), "
                f"got {got}"
            )
        _check_num_queries(self.num_queries, end.shape[1])

    @property
    def num_keys(self) -> int:
        return self.subtree_end.shape[1]

    def rows(self, start: int, stop: int) -> "TreeSchedule":
        """The schedule of batch rows ``start:stop`` (this one where the batch shares one tree)."""
        if self.subtree_end.shape[0] == 1:
            return self
        return TreeSchedule(self.subtree_end[start:stop], self.num_queries)

    @property
    def q_offset(self) -> int:
        return self.num_keys - self.num_queries

    def block_lists(self, BLOCK_M: int, BLOCK_N: int) -> "BlockLists":
        key = (BLOCK_M, BLOCK_N)
        if key in self._lists:
            return self._lists[key]
        BLOCK_M, BLOCK_N = key = _block_shape(BLOCK_M, BLOCK_N)
        lists = _build_block_lists(self.subtree_end, self.num_queries, BLOCK_M, BLOCK_N)
        if not self._capturing():
            self._lists[key] = lists
        return lists

    def key_block_order(self, BLOCK_M: int, BLOCK_N: int) -> torch.Tensor:
        """int32 [B * Nk]: the (batch row, key block) pairs, most query blocks to walk first.

        Launching the long dK/dV programs first keeps the last wave short;
        the order changes nothing in any program's result.
        """
        key = (BLOCK_M, BLOCK_N)
        if key in self._order:
            return self._order[key]
        BLOCK_M, BLOCK_N = key = _block_shape(BLOCK_M, BLOCK_N)
        order = torch.argsort(self._key_block_work(BLOCK_M, BLOCK_N), descending=True, stable=True).to(torch.int32)
        if not self._capturing():
            self._order[key] = order
        return order

    def _key_block_work(self, BLOCK_M: int, BLOCK_N: int) -> torch.Tensor:
        """int32 [B * Nk]: the query blocks each key block's dK/dV program walks (key_block_work_kernel)."""
        key = (BLOCK_M, BLOCK_N)
        if key in self._work:
            return self._work[key]
        work = _key_block_work(self.subtree_end, self.num_queries, BLOCK_M, BLOCK_N)
        if not self._capturing():
            self._work[key] = work
        return work

    def dkdv_shares(self, heads_per_row: int, group: int, head_dim: int) -> DkdvShares:
        """How dK/dV shares out each key unit's query heads among programs so that none holds much more
        than its share of the GPU (a shared prompt's keys walk every query, times the GQA group)."""
        key = (heads_per_row, group, head_dim)
        if key in self._shares:
            return self._shares[key]
        work = self._key_block_work(DKDV_SPLIT_QUERY_BLOCK, DKDV_SPLIT_UNIT)
        shares = _dkdv_shares(work, heads_per_row, group, head_dim)
        if not self._capturing():
            self._shares[key] = shares
        return shares

    def _capturing(self) -> bool:
        return self.subtree_end.is_cuda and torch.cuda.is_current_stream_capturing()


def _block_shape(BLOCK_M, BLOCK_N) -> tuple[int, int]:
    """The tile as ints (NumPy's too), or a clear error: powers of two, as tl.arange needs."""
    for name, size in (("BLOCK_M", BLOCK_M), ("BLOCK_N", BLOCK_N)):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(size).__name__}")
        if size < 1 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two, got {size}")
    return int(BLOCK_M), int(BLOCK_N)


@dataclass(frozen=True)
class BlockLists:
    """The live key blocks of every (batch row, query block) ``r = b * Mq + m``: ``idx[r * Nk : r * Nk +
    count[r]]``, first the ``full[r]`` blocks whose every (query, key) pair is visible, then the others,
    each group in key order (rows sized for every key block, so no count is read back). The kernels walk
    the full blocks in a loop without mask code, which Triton pipelines better than a loop with a branch.

    ``run`` splits each group into runs of consecutive key blocks (a tree's prompt, a node's own tokens):
    at the entry that starts a run, its length. The full blocks are walked run by run, each run's
    addresses computed from its first block rather than loaded entry by entry."""

    count: torch.Tensor  # [B * Mq] int32
    full: torch.Tensor  # [B * Mq] int32: how many of the row's blocks come first as full ones
    idx: torch.Tensor  # [B * Mq * Nk] int32; past each row's count: unused
    run: torch.Tensor  # [B * Mq * Nk] int32: a run's length at its first entry, 0 at the others
    num_key_blocks: int  # Nk, the row stride of idx and run

    def rows(self) -> list[tuple[list[int], list[int]]]:
        """Every row's (full, partly visible) key blocks (reads the GPU: for tests and inspection)."""
        count, full, idx, Nk = self.count.tolist(), self.full.tolist(), self.idx.tolist(), self.num_key_blocks
        return [(idx[r * Nk : r * Nk + f], idx[r * Nk + f : r * Nk + c]) for r, (c, f) in enumerate(zip(count, full))]

    def run_lengths(self) -> list[list[int]]:
        """Every row's ``run`` entries up to its count (reads the GPU: for tests and inspection)."""
        count, run, Nk = self.count.tolist(), self.run.tolist(), self.num_key_blocks
        return [run[r * Nk : r * Nk + c] for r, c in enumerate(count)]


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
    END, COUNT, FULL, IDX, RUN, stride_eb, Tq, Tk, NK,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """One (query block, batch row): its live key blocks, those before its last query whose largest
    subtree end passes its first query, written in order (a prefix sum over chunks of key blocks): the
    full ones (every key before its first query, every subtree end past its last query) in a first
    pass, the rest in a second. Then, right to left, each run's length at its first entry (a running
    minimum of the next run's start)."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    row = (b * tl.num_programs(0) + pid_m).to(tl.int64)
    q_first = Tk - Tq + pid_m * BLOCK_M
    q_last = tl.minimum(q_first + BLOCK_M, Tk) - 1
    n_stop = tl.cdiv(q_last + 1, BLOCK_N)  # key blocks starting before its last query
    END += b.to(tl.int64) * stride_eb
    count = 0
    for second in tl.static_range(2):
        for n0 in range(0, n_stop, CHUNK):
            offs_c = n0 + tl.arange(0, CHUNK)
            offs_t = offs_c[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            ends = tl.load(END + offs_t, mask=(offs_t < Tk) & (offs_c[:, None] < n_stop), other=0)
            live = (tl.max(ends, 1) > q_first) & (offs_c < n_stop)
            full = (offs_c * BLOCK_N + BLOCK_N - 1 <= q_first) & (tl.min(ends, 1) > q_last)
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


SCHEDULE_CHUNK = 16  # key blocks a schedule program looks at per step


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


def _key_block_work(subtree_end, Tq, BLOCK_M, BLOCK_N):
    """[B * Nk] int32: query blocks each key block's dK/dV program walks."""
    B, Tk = subtree_end.shape
    Nk = _cdiv(Tk, BLOCK_N)
    work = torch.empty(B * Nk, dtype=torch.int32, device=subtree_end.device)
    key_block_work_kernel[(_cdiv(Nk, SCHEDULE_CHUNK), B)](
        subtree_end, work, subtree_end.stride(0), Tq, Tk, Nk, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CHUNK=SCHEDULE_CHUNK,
    )  # fmt: skip
    return work


# dK/dV runs a program per (key block, K/V head), which walks every query head of its GQA group. The
# key blocks every query sees (a tree's prompt) then take GROUP times a query head's share, and with few
# K/V heads or a short call the programs are too few for the GPU. Where a unit of DKDV_SPLIT_UNIT keys
# would hold more than 1 / (DKDV_SPLIT_PROGRAMS_PER_SM x SMs) of the pass's work, its query heads are
# shared out over programs whose float32 partials are summed after, in share order: deterministic, and
# the same shares for both kernels (units of 128 keys whatever the kernel's own key block), so the
# Triton and Hopper kernels stay bitwise twins. Decided on the GPU from the schedule: no host sync.
DKDV_SPLIT_PROGRAMS_PER_SM = 4  # aim: no program above 1 / (this x SMs) of the work
DKDV_SPLIT_WORKSPACE_BYTES = 64 << 20  # at most this much float32 partials (the planners' headroom covers it)
DKDV_SPLIT_UNIT = 128  # keys per unit: the Hopper kernel's key block
DKDV_SPLIT_QUERY_BLOCK = 64  # the query block the work is counted in (both kernels' dK/dV step)


@dataclass(frozen=True)
class DkdvShares:
    """How dK/dV shares out each unit's query heads (``TreeSchedule.dkdv_shares``): per (schedule row,
    unit of DKDV_SPLIT_UNIT keys), ``shares[u]`` programs, each with a contiguous share of a GQA
    group's query heads. A unit of one share writes dK and dV itself; the shares of a split unit write
    float32 partials into workspace slots ``(first[u] + share) * heads_per_row + (batch, K/V head)``,
    which one more pass adds in share order (deterministic)."""

    shares: torch.Tensor  # [B * NU] int32, 1 .. group
    first: torch.Tensor  # [B * NU] int32: the unit's first slot group, where shares > 1
    max_shares: int  # the grid's programs per (key block, batch, K/V head): the group, or 1 with nothing to split
    slots: int  # workspace slots the shares may use (a bound, known on the host)

    def workspace(self, head_dim: int, device) -> torch.Tensor:
        """The float32 partials' room: ``slots`` [dK, dV] tiles of a unit's keys."""
        return torch.empty(max(self.slots, 1), 2, DKDV_SPLIT_UNIT, head_dim, device=device, dtype=torch.float32)


def _dkdv_shares(work, heads_per_row: int, group: int, head_dim: int) -> DkdvShares:
    """DkdvShares from ``work`` [B * NU], the query blocks (of DKDV_SPLIT_QUERY_BLOCK) each unit walks."""
    units = work.numel()
    shares, first = torch.ones(2, units, dtype=torch.int32, device=work.device)
    if group == 1 or units == 0:  # one query head per K/V head: nothing to share out
        return DkdvShares(shares, first, 1, 0)
    per_slot = 2 * DKDV_SPLIT_UNIT * head_dim * 4  # a float32 dK and dV tile of one unit
    sms = _sm_count(work.device)
    # the largest F's slots stay under 2 F x SMs (docs/benchmarks.md, "dK/dV shares by each key block's
    # work"), and under every unit split into every head
    slots = min(DKDV_SPLIT_WORKSPACE_BYTES // per_slot, 2 * DKDV_SPLIT_PROGRAMS_PER_SM * sms,
                units * heads_per_row * group)  # fmt: skip
    dkdv_shares_kernel[(1,)](
        work, shares, first, units, heads_per_row, group, sms, DKDV_SPLIT_PROGRAMS_PER_SM, slots,
        NUM_F=DKDV_SPLIT_PROGRAMS_PER_SM.bit_length() + 1, CHUNK=256 if not INTERPRET else 16,
    )  # fmt: skip
    return DkdvShares(shares, first, group if slots > 0 else 1, slots)


def _build_block_lists(subtree_end, Tq, BLOCK_M, BLOCK_N) -> BlockLists:
    B, Tk = subtree_end.shape
    Mq, Nk = _cdiv(Tq, BLOCK_M), _cdiv(Tk, BLOCK_N)
    count, full = torch.empty(2, B * Mq, dtype=torch.int32, device=subtree_end.device)
    idx, run = torch.empty(2, B * Mq * Nk, dtype=torch.int32, device=subtree_end.device)
    block_lists_kernel[(Mq, B)](
        subtree_end, count, full, idx, run, subtree_end.stride(0), Tq, Tk, Nk,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CHUNK=SCHEDULE_CHUNK,
    )  # fmt: skip
    return BlockLists(count, full, idx, run, Nk)


def _check_num_queries(num_queries, Tk: int) -> None:
    if isinstance(num_queries, bool) or not isinstance(num_queries, int):
        raise TypeError(f"num_queries must be an int, got {type(num_queries).__name__}")
    if not 1 <= num_queries <= Tk:
        raise ValueError(f"number of queries ({num_queries}) must be between 1 and the number of keys ({Tk})")


def build_schedule(subtree_end: torch.Tensor, num_queries: int | None = None, validate: bool = True) -> TreeSchedule:
    """Check ``subtree_end`` ([Tk] or [B, Tk] int) and wrap a copy of it for the kernels: writing to
    ``subtree_end`` later leaves the schedule as it was built."""
    _check_subtree_end_type(subtree_end)
    Tk = subtree_end.shape[-1]
    if isinstance(num_queries, numbers.Integral) and not isinstance(num_queries, bool):
        num_queries = int(num_queries)  # a NumPy integer, say
    num_queries = Tk if num_queries is None else num_queries
    _check_num_queries(num_queries, Tk)
    if Tk >= 2**31 - 1:
        raise ValueError(f"too many keys for int32 tree metadata: {Tk}")
    if validate:
        _validate_once(subtree_end)
    rows = subtree_end if subtree_end.dim() == 2 else subtree_end[None]
    return TreeSchedule(rows.to(torch.int32, memory_format=torch.contiguous_format, copy=True), num_queries)


# ----------------------------------------------------------------- kernels


def _configs(kind):
    """Autotune candidates; DTA_AUTOTUNE=0 keeps only the first (tests set it: correctness does not
    depend on warps or stages, and tuning every head dim a test uses costs minutes)."""
    if INTERPRET:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    if os.environ.get("DTA_AUTOTUNE", "1") == "0":
        return _tuned_configs(kind)[:1]
    return _tuned_configs(kind)


def _size_class(num_queries: int) -> int:
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


@triton.jit
def _visible(pos_m, offs_n, end_n):
    """[M, N] bool: query position pos_m may attend key offs_n with subtree end end_n."""
    return (offs_n[None, :] <= pos_m[:, None]) & (pos_m[:, None] < end_n[None, :])


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
    tl.store(X_FINITE + pid_bh * T * HEAD_DIM + offs_t[:, None] * HEAD_DIM + offs_d[None, :],
             tl.where(bad[:, None], 0.0, x), mask=mask)
    tl.store(BAD + pid_bh * T + offs_t, bad.to(tl.int8), mask=mask_t)


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
def _partial_key_block(K, V, KV_IDX, e, offs_d, mask_d, stride_kt, stride_vt, Tk,
                       BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr):  # fmt: skip
    """Entry e of a block list (forward, dQ), a partly visible block: its key positions, which of them are
    keys, its K and V tiles."""
    offs_n = tl.load(KV_IDX + e) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < Tk
    k = _load_tile(K + offs_n[:, None] * stride_kt + offs_d[None, :], mask_n, mask_d, False, EVEN_D)
    v = _load_tile(V + offs_n[:, None] * stride_vt + offs_d[None, :], mask_n, mask_d, False, EVEN_D)
    return offs_n, mask_n, k, v


@triton.jit
def _full_key_block(K, V, K_DESC, V_DESC, n, b, hk, offs_d, mask_d, stride_kt, stride_vt,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                    USE_TMA: tl.constexpr):  # fmt: skip
    """The K and V tiles of key block n, every key in range: through TMA descriptors of [B, Hkv, Tk, D]
    where the launch made them (``_tma_descriptors``), else pointer loads (K, V at this head)."""
    if USE_TMA:
        at = [b.to(tl.int32), hk.to(tl.int32), n * BLOCK_N, 0]
        return K_DESC.load(at).reshape(BLOCK_N, BLOCK_D), V_DESC.load(at).reshape(BLOCK_N, BLOCK_D)
    else:
        offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
        k = _load_tile(K + offs_n[:, None] * stride_kt + offs_d[None, :], None, mask_d, True, EVEN_D)
        v = _load_tile(V + offs_n[:, None] * stride_vt + offs_d[None, :], None, mask_d, True, EVEN_D)
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
    acc, l_i, m_i, q, K, V, K_DESC, V_DESC, KV_IDX, RUN, lo, hi, b, hk, offs_d, mask_d, qk_scale,
    stride_kt, stride_vt,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):  # fmt: skip
    """Online softmax over the full key blocks KV_IDX[lo:hi], run by run (no mask code, no list load
    inside a run)."""
    e = lo
    while e < hi:
        length = tl.load(RUN + e)
        first = tl.load(KV_IDX + e)
        for n in range(first, first + length):
            k, v = _full_key_block(K, V, K_DESC, V_DESC, n, b, hk, offs_d, mask_d, stride_kt, stride_vt,
                                   BLOCK_N, BLOCK_D, EVEN_D, USE_TMA)  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v, qk_scale, DOT_PRECISION)
        e += length
    return acc, l_i, m_i


@triton.jit
def _fwd_partial_blocks(
    acc, l_i, m_i, q, K, V, END, KV_IDX, lo, hi, pos_m, offs_d, mask_d, qk_scale, stride_kt, stride_vt, Tk,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax over the partly visible key blocks KV_IDX[lo:hi]."""
    for e in range(lo, hi):
        offs_n, mask_n, k, v = _partial_key_block(K, V, KV_IDX, e, offs_d, mask_d, stride_kt, stride_vt, Tk,
                                                  BLOCK_N, EVEN_D)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        end_n = tl.load(END + offs_n, mask=mask_n, other=0)  # [BLOCK_N]
        # scaled before masking: -inf times a zero scale would be NaN
        s = tl.where(_visible(pos_m, offs_n, end_n), s, float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v, 1.0, DOT_PRECISION)
    return acc, l_i, m_i


@triton.autotune(configs=_configs("fwd"), key=["HEAD_DIM", "BLOCK_M", "BLOCK_N", "SIZE_CLASS"])
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def tree_attention_fwd_kernel(
    Q, K, V, O, LSE, END, KV_COUNT, KV_FULL, KV_IDX, KV_RUN, SEES_BAD, K_DESC, V_DESC,
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    stride_eb, stride_kv_b, NK,
    Hq, GROUP, Tq, Tk, SIZE_CLASS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
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
    mask_m = offs_m < Tq

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    END += b * stride_eb

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a row may see nothing in a block
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    row = b * stride_kv_b + pid_m  # the schedule is shared by the batch when subtree_end is
    start = row * NK
    mid = start + tl.load(KV_FULL + row)
    stop = start + tl.load(KV_COUNT + row)
    acc, l_i, m_i = _fwd_full_runs(acc, l_i, m_i, q, K, V, K_DESC, V_DESC, KV_IDX, KV_RUN, start, mid, b, hk, offs_d,
                                   mask_d, qk_scale, stride_kt, stride_vt, BLOCK_N, BLOCK_D, HEAD_DIM == BLOCK_D,
                                   DOT_PRECISION, USE_TMA)  # fmt: skip
    acc, l_i, m_i = _fwd_partial_blocks(acc, l_i, m_i, q, K, V, END, KV_IDX, mid, stop, pos_m, offs_d, mask_d,
                                        qk_scale, stride_kt, stride_vt, Tk, BLOCK_N, HEAD_DIM == BLOCK_D,
                                        DOT_PRECISION)  # fmt: skip

    l_i = tl.where(l_i > 0, l_i, 1.0)  # rows past Tq saw nothing; they are not stored
    acc = acc / l_i[:, None]
    # isolation: the queries that see a value row zeroed before the launch (a non-finite one) get NaN
    sees_bad = tl.load(SEES_BAD + (b * (Hq // GROUP) + hk) * Tq + offs_m, mask=mask_m, other=0)
    acc = tl.where(sees_bad[:, None] != 0, float("nan"), acc)
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    # natural-log LSE of the scaled scores
    tl.store(LSE + pid_bh * Tq + offs_m, (m_i + tl.log2(l_i)) / 1.4426950408889634, mask=mask_m)


@triton.jit
def tree_attention_bwd_preprocess_kernel(
    O, DO, Q, LSE, DELTA, LSE_BWD, DO_FINITE, Q_FINITE,
    stride_ob, stride_oh, stride_ot,
    stride_dob, stride_doh, stride_dot,
    stride_qb, stride_qh, stride_qt,
    stride_fb, stride_fh, stride_ft,
    Hq, Tq, stride_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
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
    mask_t = offs_t < Tq
    mask = mask_t[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_t[:, None] * stride_ot + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_t[:, None] * stride_dot + offs_d[None, :],
                 mask=mask, other=0.0)  # [BLOCK_T, BLOCK_D]
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row_nan = _row_nan(do) + delta * 0.0  # NaN on the rows whose dO or delta is not finite
    tl.store(DELTA + pid_bh * stride_rows + offs_t, tl.where(row_nan == 0.0, delta, 0.0), mask=mask_t)
    lse = tl.load(LSE + pid_bh * Tq + offs_t, mask=mask_t, other=0.0)
    tl.store(LSE_BWD + pid_bh * stride_rows + offs_t, lse + row_nan, mask=mask_t)
    tl.store(DO_FINITE + b * stride_fb + h * stride_fh + offs_t[:, None] * stride_ft + offs_d[None, :],
             tl.where((row_nan == 0.0)[:, None], do, 0.0), mask=mask)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_t[:, None] * stride_qt + offs_d[None, :], mask=mask, other=0.0)
    tl.store(Q_FINITE + pid_bh * Tq * HEAD_DIM + offs_t[:, None] * HEAD_DIM + offs_d[None, :],
             tl.where((_row_nan(q) == 0.0)[:, None], q, 0.0), mask=mask)


@triton.jit
def _dkdv_query_blocks(
    dk, dv, k, v, Qh, DOh, LSE, DELTA, row_base, lo, hi, offs_n, end_n, q_offset, offs_d, mask_d, qk_scale,
    stride_qt, stride_dot, Tq,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key block summed over the query blocks lo..hi-1 of one query head: all full
    (MASKED false) or all partly visible."""
    for m in range(lo, hi):
        offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < Tq
        q = _load_tile(Qh + offs_m[:, None] * stride_qt + offs_d[None, :], mask_m, mask_d, not MASKED, EVEN_D)
        do = _load_tile(DOh + offs_m[:, None] * stride_dot + offs_d[None, :], mask_m, mask_d, not MASKED, EVEN_D)
        if MASKED:
            lse = tl.load(LSE + row_base + offs_m, mask=mask_m, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + row_base + offs_m, mask=mask_m, other=0.0)
        else:
            lse = tl.load(LSE + row_base + offs_m) * 1.4426950408889634
            delta = tl.load(DELTA + row_base + offs_m)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
        p_t = tl.exp2(s_t - lse[None, :])
        if MASKED:
            p_t = tl.where(tl.trans(_visible(q_offset + offs_m, offs_n, end_n)), p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.autotune(configs=_configs("dkdv"), key=["HEAD_DIM", "BLOCK_M", "BLOCK_N", "SIZE_CLASS"])
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def tree_attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, END, ORDER, SHARES, FIRST, WS,
    qk_scale, sm_scale,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dkb, stride_dkh, stride_dkt,
    stride_dvb, stride_dvh, stride_dvt,
    stride_eb, heads_per_row, stride_rows, SPLITS,
    Hq, Hkv, GROUP, Tq, Tk, SIZE_CLASS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UNIT: tl.constexpr,
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
    mask_n = offs_n < Tk
    mask_d = offs_d < HEAD_DIM
    mask_nd = mask_n[:, None] & mask_d[None, :]

    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :],
                mask=mask_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :],
                mask=mask_nd, other=0.0)
    end_n = tl.load(END + b * stride_eb + offs_n, mask=mask_n, other=0)  # [BLOCK_N]
    k_first = pid_n * BLOCK_N
    k_last = tl.minimum(k_first + BLOCK_N, Tk) - 1
    min_end = tl.min(tl.where(mask_n, end_n, Tk), 0)
    # live queries of this key block: key positions [k_first, max end), in query rows:
    row_lo = tl.maximum(k_first - q_offset, 0)
    row_hi = tl.max(end_n, 0) - q_offset
    m_lo = row_lo // BLOCK_M
    m_hi = tl.cdiv(row_hi, BLOCK_M)

    # query blocks whose every query sees every key of this block: at or after its last key, before
    # its smallest subtree end (a contiguous run of the range; clamped at 0 before dividing)
    m_full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(k_last - q_offset, 0), BLOCK_M), m_lo), m_hi)
    m_full_hi = tl.maximum(tl.minimum(tl.maximum(min_end - q_offset, 0) // BLOCK_M, m_hi), m_full_lo)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    for g in range(tl.where(live, split * GROUP // shares, 0), tl.where(live, (split + 1) * GROUP // shares, 0)):
        h = hk * GROUP + g
        Qh = Q + b * stride_qb + h * stride_qh
        DOh = DO + b * stride_dob + h * stride_doh
        row_base = (b * Hq + h) * stride_rows
        dk, dv = _dkdv_query_blocks(dk, dv, k, v, Qh, DOh, LSE, DELTA, row_base, m_lo, m_full_lo, offs_n, end_n,
                                    q_offset, offs_d, mask_d, qk_scale, stride_qt, stride_dot, Tq,
                                    BLOCK_M, True, EVEN_D, DOT_PRECISION)  # fmt: skip
        dk, dv = _dkdv_query_blocks(dk, dv, k, v, Qh, DOh, LSE, DELTA, row_base, m_full_lo, m_full_hi, offs_n, end_n,
                                    q_offset, offs_d, mask_d, qk_scale, stride_qt, stride_dot, Tq,
                                    BLOCK_M, False, EVEN_D, DOT_PRECISION)  # fmt: skip
        dk, dv = _dkdv_query_blocks(dk, dv, k, v, Qh, DOh, LSE, DELTA, row_base, m_full_hi, m_hi, offs_n, end_n,
                                    q_offset, offs_d, mask_d, qk_scale, stride_qt, stride_dot, Tq,
                                    BLOCK_M, True, EVEN_D, DOT_PRECISION)  # fmt: skip

    if live:  # the grid's surplus programs write nothing
        if shares == 1:
            tl.store(DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :],
                     (dk * sm_scale).to(DK.dtype.element_ty), mask=mask_nd)
            tl.store(DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvt + offs_d[None, :],
                     dv.to(DV.dtype.element_ty), mask=mask_nd)
        else:  # the share's float32 partials, in its workspace slot: [dK, dV] tiles of the unit's keys
            slot = (tl.load(FIRST + unit) + split).to(tl.int64) * heads_per_row + rest
            tile = WS + slot * (2 * UNIT * HEAD_DIM) + (offs_n % UNIT)[:, None] * HEAD_DIM + offs_d[None, :]
            tl.store(tile, dk * sm_scale, mask=mask_nd)
            tl.store(tile + UNIT * HEAD_DIM, dv, mask=mask_nd)


@triton.jit
def _dq_step(dq, p, do, delta, k, v, DOT_PRECISION: tl.constexpr):
    """dQ of one key block: p its softmax weights (zero where masked), k and v its tiles."""
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)


@triton.jit
def _dq_full_runs(
    dq, q, do, lse, delta, K, V, KV_IDX, RUN, lo, hi, offs_d, mask_d, qk_scale, stride_kt, stride_vt,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ summed over the full key blocks KV_IDX[lo:hi], run by run."""
    e = lo
    while e < hi:
        length = tl.load(RUN + e)
        first = tl.load(KV_IDX + e)
        for n in range(first, first + length):
            k, v = _full_key_block(K, V, K, V, n, 0, 0, offs_d, mask_d, stride_kt, stride_vt,
                                   BLOCK_N, BLOCK_D, EVEN_D, False)  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            dq = _dq_step(dq, tl.exp2(s - lse[:, None]), do, delta, k, v, DOT_PRECISION)
        e += length
    return dq


@triton.jit
def _dq_partial_blocks(
    dq, q, do, lse, delta, K, V, END, KV_IDX, lo, hi, pos_m, offs_d, mask_d, qk_scale, stride_kt, stride_vt, Tk,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ summed over the partly visible key blocks KV_IDX[lo:hi]."""
    for e in range(lo, hi):
        offs_n, mask_n, k, v = _partial_key_block(K, V, KV_IDX, e, offs_d, mask_d, stride_kt, stride_vt, Tk,
                                                  BLOCK_N, EVEN_D)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        end_n = tl.load(END + offs_n, mask=mask_n, other=0)
        p = tl.where(_visible(pos_m, offs_n, end_n), tl.exp2(s - lse[:, None]), 0.0)
        dq = _dq_step(dq, p, do, delta, k, v, DOT_PRECISION)
    return dq


@triton.autotune(configs=_configs("dq"), key=["HEAD_DIM", "BLOCK_M", "BLOCK_N", "SIZE_CLASS"])
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def tree_attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, END, KV_COUNT, KV_FULL, KV_IDX, KV_RUN,
    qk_scale, sm_scale,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dqb, stride_dqh, stride_dqt,
    stride_eb, stride_kv_b, NK, stride_rows,
    Hq, GROUP, Tq, Tk, SIZE_CLASS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b, h = pid_bh // Hq, pid_bh % Hq
    hk = h // GROUP
    q_offset = Tk - Tq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pos_m = q_offset + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < Tq
    mask_d = offs_d < HEAD_DIM
    mask_md = mask_m[:, None] & mask_d[None, :]

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=mask_md, other=0.0)  # [BLOCK_M, BLOCK_D]
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                 mask=mask_md, other=0.0)
    lse = tl.load(LSE + pid_bh * stride_rows + offs_m, mask=mask_m, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + pid_bh * stride_rows + offs_m, mask=mask_m, other=0.0)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    END += b * stride_eb

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row = b * stride_kv_b + pid_m  # the schedule is shared by the batch when subtree_end is
    start = row * NK
    mid = start + tl.load(KV_FULL + row)
    stop = start + tl.load(KV_COUNT + row)
    dq = _dq_full_runs(dq, q, do, lse, delta, K, V, KV_IDX, KV_RUN, start, mid, offs_d, mask_d, qk_scale,
                       stride_kt, stride_vt, BLOCK_N, BLOCK_D, HEAD_DIM == BLOCK_D, DOT_PRECISION)
    dq = _dq_partial_blocks(dq, q, do, lse, delta, K, V, END, KV_IDX, mid, stop, pos_m, offs_d, mask_d, qk_scale,
                            stride_kt, stride_vt, Tk, BLOCK_N, HEAD_DIM == BLOCK_D, DOT_PRECISION)

    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=mask_md)


# ---------------------------------------------------------- autograd glue


# (BLOCK_M, BLOCK_N) per kernel: queries x keys per program step, from benchmarks/tune_attention.py and
# compare_attention.py on H100. Head dims 65..128, since the loops over full blocks carry no mask code:
# forward 128 x 128 is 5-12% faster than 128 x 64; dK/dV 64 x 128 (8 warps) is 1-7% faster than 32 x 64
# on every tree measured but the 64-rollout GRPO one (1-7% slower) (docs/benchmarks.md)
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


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host: ``triton.cdiv`` is a constexpr function whose host call costs ~3 us, and
    a tree attention call makes a dozen of them."""
    return -(-a // b)


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


def _forward(q, k, v, schedule, sm_scale):
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    BM, BN = _blocks("fwd", q)
    lists = schedule.block_lists(BM, BN)
    end = schedule.subtree_end
    o = torch.empty_like(q)
    lse = torch.empty(B, Hq, Tq, device=q.device, dtype=torch.float32)
    num_m_blocks = _cdiv(Tq, BM)
    # p = 0 times a non-finite value row is NaN: the kernel sees such rows zeroed, and the queries that
    # see them get their NaN in its epilogue (the loop itself stays as fast as without isolation)
    v_finite, v_bad = _finite_rows(v)
    sees_bad = _queries_seeing(v_bad, end, Tq)  # [B, Hkv, Tq]
    if (BM, BN) == (attention_hopper.BLOCK_M, attention_hopper.BLOCK_N) and attention_hopper.applies(q, k, v_finite):
        attention_hopper.forward(q, k, v_finite, o, lse, end, lists, sees_bad, sm_scale * LOG2E,
                                 _batch_strides(end, num_m_blocks))  # fmt: skip
        return o, lse, v_finite
    k_desc, v_desc = _tma_descriptors(k, v_finite, BN, Tq)
    args = (
        q, k, v_finite, o, lse, end, lists.count, lists.full, lists.idx, lists.run, sees_bad,
        k if k_desc is None else k_desc, v_finite if v_desc is None else v_desc,
        sm_scale * LOG2E,
        *_strides(q), *_strides(k), *_strides(v_finite), *_strides(o),
        *_batch_strides(end, num_m_blocks), lists.num_key_blocks,
        Hq, Hq // Hkv, Tq, Tk,
    )  # fmt: skip
    _launch_tuned(tree_attention_fwd_kernel, (num_m_blocks, B * Hq), args, D, BM, BN, _size_class(Tq), q.dtype,
                  BLOCK_D=_block_d(D), DOT_PRECISION=_dot_precision(q.dtype), USE_TMA=k_desc is not None)  # fmt: skip
    return o, lse, v_finite


def _tma_descriptors(k, v, BLOCK_N, Tq):
    """TMA descriptors of K and V [B, Hkv, Tk, D] for the forward's full key blocks, or (None, None) where
    they do not apply: before Hopper, under the interpreter, a head dim that is not its own tile, rows or
    strides not 16-byte aligned, or a call of under 64 queries (a decode step, whose cost is its host
    time, to which each descriptor adds about 3 us of Python)."""
    D = k.shape[-1]
    if INTERPRET or Tq < 64 or D != _block_d(D) or not _has_tma(k.device):
        return None, None
    for x in (k, v):
        if x.data_ptr() % 16 or any(s * x.element_size() % 16 for s in x.stride()[:3]):
            return None, None
    return tuple(TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, BLOCK_N, D]) for x in (k, v))


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _finite_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, T, D] with its non-finite rows zeroed (a contiguous copy), and [B, H, T] int8 flags of those rows."""
    B, H, T, D = x.shape
    x_finite = torch.empty(B, H, T, D, device=x.device, dtype=x.dtype)
    bad = torch.empty(B, H, T, device=x.device, dtype=torch.int8)
    BLOCK_T = 16 if INTERPRET else 64
    finite_rows_kernel[(_cdiv(T, BLOCK_T), B * H)](
        x, x_finite, bad, *_strides(x), H, T, HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_T=BLOCK_T,
    )  # fmt: skip
    return x_finite, bad


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


def _queries_seeing(keys: torch.Tensor, subtree_end: torch.Tensor, Tq: int) -> torch.Tensor:
    """[B, H, Tq] int8: 1 for the queries that see at least one key flagged in ``keys`` [B, H, Tk] int8."""
    B, H, Tk = keys.shape
    sees = torch.empty(B, H, Tq, dtype=torch.int8, device=keys.device)
    queries_seeing_kernel[(B * H,)](
        keys, subtree_end, sees, _batch_strides(subtree_end, 0)[0], H, Tq, Tk, BLOCK_T=16 if INTERPRET else 1024,
    )  # fmt: skip
    return sees


def _backward(do, q, k, v, o, lse, schedule, sm_scale):
    """v is the forward's V with its non-finite rows zeroed.

    Isolation without touching the kernels' loops: every operand row that a tile product multiplies
    by a masked (zero) probability is finite, zeroed first where it was not, and the rows it belongs
    to carry their NaN through the LSE instead (the forward's for Q and K, the preprocess's for dO).
    """
    delta, lse_bwd, do_finite, q_finite = _backward_preprocess(o, do, q, lse)
    dk, dv = _backward_dkdv(do_finite, q_finite, k, v, lse_bwd, delta, schedule, sm_scale)
    del q_finite, do_finite
    k_finite = _finite_rows(k)[0]
    dq = _backward_dq(do, q, k_finite, v, lse_bwd, delta, schedule, sm_scale)
    return dq, dk, dv


def _backward_preprocess(o, do, q, lse):
    B, Hq, Tq, D = o.shape
    # delta and the LSE in rows of a multiple of 4 floats, 16 bytes, so TMA can read them (Hopper dK/dV)
    delta, lse_bwd = torch.empty(2, B, Hq, -(-Tq // 4) * 4, device=o.device, dtype=torch.float32)[..., :Tq]
    do_finite = torch.empty_like(do)
    q_finite = torch.empty(B, Hq, Tq, D, device=q.device, dtype=q.dtype)
    BLOCK_T = 16 if INTERPRET else 128
    tree_attention_bwd_preprocess_kernel[(_cdiv(Tq, BLOCK_T), B * Hq)](
        o, do, q, lse, delta, lse_bwd, do_finite, q_finite,
        *_strides(o), *_strides(do), *_strides(q), *_strides(do_finite), Hq, Tq, delta.stride(1),
        HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_T=BLOCK_T,
    )  # fmt: skip
    return delta, lse_bwd, do_finite, q_finite


def _stride_rows(lse, delta):
    """The one stride of the backward's LSE and delta rows, [B, Hq, Tq] (``_backward_preprocess``)."""
    assert lse.stride() == delta.stride() and lse.stride(0) == lse.shape[1] * lse.stride(1), "lse and delta rows"
    return delta.stride(1)


def _backward_dkdv(do, q, k, v, lse, delta, schedule, sm_scale):
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    BM, BN = _blocks("dkdv", q)
    end = schedule.subtree_end
    heads_per_row = B // max(end.shape[0], 1) * Hkv  # an empty batch may bring an empty [0, Tk] tree
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    shares = schedule.dkdv_shares(heads_per_row, Hq // Hkv, D)
    workspace = shares.workspace(D, q.device)
    assert DKDV_SPLIT_UNIT % BN == 0, "a dK/dV program's keys lie in one share unit"
    if attention_hopper.applies(q, k, v, do):
        order = schedule.key_block_order(attention_hopper.DKDV_BLOCK_M, attention_hopper.DKDV_BLOCK_N)
        attention_hopper.backward_dkdv(q, k, v, do, lse, delta, dk, dv, end, order, sm_scale * LOG2E, sm_scale,
                                       _batch_strides(end, 0)[0], heads_per_row, shares, workspace)  # fmt: skip
    else:
        order = schedule.key_block_order(BM, BN)
        args = (
            q, k, v, do, lse, delta, dk, dv, end, order, shares.shares, shares.first, workspace,
            sm_scale * LOG2E, sm_scale,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
            _batch_strides(end, 0)[0], heads_per_row, _stride_rows(lse, delta), shares.max_shares,
            Hq, Hkv, Hq // Hkv, Tq, Tk,
        )  # fmt: skip
        _launch_tuned(tree_attention_bwd_dkdv_kernel, (order.numel() * heads_per_row * shares.max_shares,), args, D,
                      BM, BN, _size_class(Tq), q.dtype, BLOCK_D=_block_d(D), DOT_PRECISION=_dot_precision(q.dtype),
                      UNIT=DKDV_SPLIT_UNIT)  # fmt: skip
    if shares.max_shares > 1:
        _sum_dkdv_shares(workspace, shares, dk, dv, heads_per_row)
    return dk, dv


@triton.jit
def dkdv_shares_sum_kernel(
    WS, SHARES, FIRST, DK, DV,
    stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
    heads_per_row, Hkv, NU, Tk,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UNIT: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """dK and dV of the split units (DkdvShares): the sums of their shares' float32 partials, added in
    share order (deterministic), in DK's dtype. One program per (schedule row x unit, batch x K/V head)."""
    unit = tl.program_id(0)
    rest = tl.program_id(1)
    shares = tl.load(SHARES + unit)
    if shares > 1:
        b = ((unit // NU) * (heads_per_row // Hkv) + rest // Hkv).to(tl.int64)
        hk = (rest % Hkv).to(tl.int64)
        slot = tl.load(FIRST + unit).to(tl.int64) * heads_per_row + rest
        offs_d = tl.arange(0, BLOCK_D)
        for t0 in range(0, UNIT, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            keys = (unit % NU) * UNIT + offs_t
            mask = (keys < Tk)[:, None] & (offs_d < HEAD_DIM)[None, :]
            tile = offs_t[:, None] * HEAD_DIM + offs_d[None, :]
            dk = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            dv = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for s in range(0, shares):
                partial = WS + (slot + s * heads_per_row) * (2 * UNIT * HEAD_DIM)
                dk += tl.load(partial + tile, mask=mask, other=0.0)
                dv += tl.load(partial + UNIT * HEAD_DIM + tile, mask=mask, other=0.0)
            tl.store(DK + b * stride_dkb + hk * stride_dkh + keys[:, None] * stride_dkt + offs_d[None, :],
                     dk.to(DK.dtype.element_ty), mask=mask)  # fmt: skip
            tl.store(DV + b * stride_dvb + hk * stride_dvh + keys[:, None] * stride_dvt + offs_d[None, :],
                     dv.to(DV.dtype.element_ty), mask=mask)  # fmt: skip


def _sum_dkdv_shares(workspace, shares: DkdvShares, dk, dv, heads_per_row):
    """dk, dv [B, Hkv, Tk, D] of the split units, from their shares' partials in ``workspace``."""
    _, Hkv, Tk, D = dk.shape
    dkdv_shares_sum_kernel[(shares.shares.numel(), heads_per_row)](
        workspace, shares.shares, shares.first, dk, dv, *_strides(dk), *_strides(dv), heads_per_row, Hkv,
        _cdiv(Tk, DKDV_SPLIT_UNIT), Tk, HEAD_DIM=D, BLOCK_D=_block_d(D), UNIT=DKDV_SPLIT_UNIT,
        BLOCK_T=16 if INTERPRET else 32,
    )  # fmt: skip


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    """The device's SMs; 4 under the interpreter, so that the CPU suite's small trees split too."""
    if device.type != "cuda":
        return 4
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def _backward_dq(do, q, k, v, lse, delta, schedule, sm_scale):
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    BM, BN = _blocks("dq", q)
    end = schedule.subtree_end
    lists = schedule.block_lists(BM, BN)
    num_m_blocks = _cdiv(Tq, BM)
    dq = torch.empty_like(q)
    if (BM, BN) == (attention_hopper.DQ_BLOCK_M, attention_hopper.DQ_BLOCK_N) and attention_hopper.applies(q, k, v, do):
        attention_hopper.backward_dq(q, k, v, do, lse, delta, dq, end, lists, sm_scale * LOG2E, sm_scale,
                                     _batch_strides(end, num_m_blocks))  # fmt: skip
        return dq
    args = (
        q, k, v, do, lse, delta, dq, end, lists.count, lists.full, lists.idx, lists.run,
        sm_scale * LOG2E, sm_scale,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
        *_batch_strides(end, num_m_blocks), lists.num_key_blocks, _stride_rows(lse, delta), Hq, Hq // Hkv, Tq, Tk,
    )  # fmt: skip
    _launch_tuned(tree_attention_bwd_dq_kernel, (num_m_blocks, B * Hq), args, D, BM, BN, _size_class(Tq), q.dtype,
                  BLOCK_D=_block_d(D), DOT_PRECISION=_dot_precision(q.dtype))  # fmt: skip
    return dq


def _dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


class TreeAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, schedule, sm_scale):
        o, lse, v_finite = _forward(q, k, v, schedule, sm_scale)
        ctx.save_for_backward(q, k, v_finite, o, lse)
        ctx.schedule, ctx.sm_scale = schedule, sm_scale
        ctx.mark_non_differentiable(lse)
        # the LSE has no gradient to give: spare autograd a zero-filled one in every backward (a launch
        # and an allocation, ~10% of a small call's host cost)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        refuse_create_graph("tree_attention")  # a second derivative would need kernels of its own
        if do is None:  # the output reached no loss
            return None, None, None, None, None
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(_last_dim_contiguous(do), q, k, v, o, lse, ctx.schedule, ctx.sm_scale)
        return dq, dk, dv, None, None


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
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    for name, x in (("q", q), ("k", k)):
        if 0 in x.shape[1:]:
            raise ValueError(f"{name} has shape {tuple(x.shape)}: heads, tokens and head dim must be at least 1")
    B, Hq, Tq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in batch or head dim")
    if Hq % k.shape[1] != 0:
        raise ValueError(f"number of query heads ({Hq}) must be a multiple of key/value heads ({k.shape[1]})")
    if Tq > k.shape[2]:
        raise ValueError(f"more queries ({Tq}) than keys ({k.shape[2]}): queries are the last Tq key positions")
    if Tq == 0:
        raise ValueError("no queries: Tq must be at least 1")
    if D > 256:
        raise ValueError(f"head dim {D} is not supported (at most 256)")


# CUDA takes at most 65535 programs on a grid's second axis, which the kernels give to batch x heads (and
# the schedule's to batch rows): a batch with more rows than that is run in slices
MAX_GRID_ROWS = 65535
SCALE_LIMIT = 1e38  # the kernels take scale * log2(e) as a float32


def tree_attention(q, k, v, subtree_end=None, scale=None, *, schedule: TreeSchedule | None = None, return_lse=False):
    """Tree attention: the query at key position i attends key j iff j <= i < subtree_end[j].

    q [B, Hq, Tq, D]; k, v [B, Hkv, Tk, D] (GQA when Hq is a multiple of Hkv);
    subtree_end [Tk] or [B, Tk] int. The queries are the last Tq key positions
    (Tq < Tk: the first Tk - Tq keys are a cached prefix). Pass a ``schedule``
    from :func:`build_schedule` instead of ``subtree_end`` to reuse it across
    layers. Returns the output [B, Hq, Tq, D] (and the float32 natural-log
    LSE [B, Hq, Tq] with ``return_lse=True``, which carries no gradient).
    Differentiable in q, k, v, once (``create_graph=True`` raises). Under
    autocast, q, k and v are first cast to its dtype, as SDPA's are.
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
        schedule = build_schedule(subtree_end.to(q.device), Tq)
    elif subtree_end is not None:
        raise ValueError("pass either subtree_end or schedule, not both")
    elif not isinstance(schedule, TreeSchedule):
        raise TypeError(f"schedule must be a TreeSchedule (from build_schedule), got {type(schedule).__name__}")
    if schedule.num_keys != Tk or schedule.num_queries != Tq:
        raise ValueError(
            f"tree metadata covers {schedule.num_keys} keys / {schedule.num_queries} queries, "
            f"but k has {Tk} keys and q has {Tq} queries"
        )
    if schedule.subtree_end.shape[0] not in (1, B):
        raise ValueError(f"subtree_end has batch size {schedule.subtree_end.shape[0]}, expected 1 or {B}")
    if schedule.subtree_end.device != q.device:
        raise ValueError(f"subtree_end is on {schedule.subtree_end.device}, q on {q.device}")
    step = max(MAX_GRID_ROWS // Hq, 1)
    if B > step:  # a rollout's large batch of short rows: the kernels run on slices of it
        slices = [tree_attention(q[b : b + step], k[b : b + step], v[b : b + step], scale=scale,
                                 schedule=schedule.rows(b, b + step), return_lse=return_lse)
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
            out = tree_attention(q.float(), k.float(), v.float(), scale=sm_scale, schedule=schedule,
                                 return_lse=return_lse)  # fmt: skip
        return (out[0].to(q.dtype), out[1]) if return_lse else out.to(q.dtype)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = TreeAttentionFunction.apply(q, k, v, schedule, sm_scale)
    else:  # nothing to differentiate (a rollout step): spare the autograd Function's host cost
        o, lse, _ = _forward(q, k, v, schedule, sm_scale)
    return (o, lse) if return_lse else o
