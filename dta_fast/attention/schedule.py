"""The schedule of a tree: what every tree attention call over one tree shares (all layers).

``build_schedule(subtree_end)`` checks the tree once and keeps a copy of it; the block lists, the dK/dV
launch order and the dK/dV head shares are built on the GPU from it (kernels.py), with no host sync,
once per block shape, and kept.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from dta_ref.tree import nesting_depth

from .interpreter import INTERPRET
from .kernels import block_lists_kernel, dkdv_shares_kernel, key_block_work_kernel

SCHEDULE_CHUNK = 16  # key blocks a schedule program looks at per step


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host: ``triton.cdiv`` is a constexpr function whose host call costs ~3 us, and
    a tree attention call makes a dozen of them."""
    return -(-a // b)


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """The device's SMs; 4 under the interpreter, so that the CPU suite's small trees split too."""
    if device.type != "cuda":
        return 4
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


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

    ``block_lists(BLOCK_M, BLOCK_N, window)`` lists, per query block, its live key
    blocks (under a sliding window over ``position_ids``, the keys' depths);
    ``key_block_order`` ranks the key blocks by the queries they walk in dK/dV;
    ``dkdv_shares`` shares out the query heads of the key blocks that walk the most.
    Each is built on the GPU without waiting for it, once per block shape (or head
    layout), and kept; except inside a CUDA graph capture, where a kernel only
    records its work: what it builds there is filled in when the graph replays, so
    it serves that graph and is not kept for later calls.
    """

    subtree_end: torch.Tensor  # [B, Tk] int32, contiguous; the schedule's own (build_schedule copies it)
    num_queries: int
    position_ids: torch.Tensor | None = None  # [B, Tk] int32 depths, as subtree_end; sliding windows need them
    _lists: dict = field(default_factory=dict, repr=False)
    _order: dict = field(default_factory=dict, repr=False)
    _work: dict = field(default_factory=dict, repr=False)
    _shares: dict = field(default_factory=dict, repr=False)
    graphs: dict = field(default_factory=dict, repr=False)  # its calls' CUDA graphs (graphed.py)

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
        pos = self.position_ids
        if pos is not None and not (
            isinstance(pos, torch.Tensor) and pos.dtype == torch.int32 and pos.shape == end.shape
            and pos.is_contiguous() and pos.device == end.device
        ):  # fmt: skip
            raise ValueError("TreeSchedule.position_ids must be a contiguous int32 tensor shaped as subtree_end")

    @property
    def num_keys(self) -> int:
        return self.subtree_end.shape[1]

    def rows(self, start: int, stop: int) -> TreeSchedule:
        """The schedule of batch rows ``start:stop`` (this one where the batch shares one tree)."""
        if self.subtree_end.shape[0] == 1:
            return self
        pos = None if self.position_ids is None else self.position_ids[start:stop]
        return TreeSchedule(self.subtree_end[start:stop], self.num_queries, pos)

    @property
    def q_offset(self) -> int:
        return self.num_keys - self.num_queries

    def block_lists(self, BLOCK_M: int, BLOCK_N: int, window: int | None = None) -> BlockLists:
        key = (BLOCK_M, BLOCK_N, window)
        if key in self._lists:
            return self._lists[key]
        BLOCK_M, BLOCK_N = _block_shape(BLOCK_M, BLOCK_N)
        if window is not None and self.position_ids is None:
            raise ValueError("a sliding window needs the keys' depths: build_schedule(..., position_ids=...)")
        lists = _build_block_lists(self.subtree_end, self.position_ids, window, self.num_queries, BLOCK_M, BLOCK_N)
        if not self._capturing():
            self._lists[(BLOCK_M, BLOCK_N, window)] = lists
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
        work = key_block_work(self.subtree_end, self.num_queries, BLOCK_M, BLOCK_N)
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


def key_block_work(subtree_end, Tq, BLOCK_M, BLOCK_N):
    """[B * Nk] int32: query blocks each key block's dK/dV program walks."""
    B, Tk = subtree_end.shape
    Nk = cdiv(Tk, BLOCK_N)
    work = torch.empty(B * Nk, dtype=torch.int32, device=subtree_end.device)
    key_block_work_kernel[(cdiv(Nk, SCHEDULE_CHUNK), B)](
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
    unit: int  # keys per unit (DKDV_SPLIT_UNIT when it was built)

    def workspace(self, head_dim: int, head_dim_v: int, device) -> torch.Tensor:
        """The float32 partials' room: ``slots`` dK tiles and dV tiles of a unit's keys, [slots, unit * (D + Dv)]."""
        return torch.empty(max(self.slots, 1), self.unit * (head_dim + head_dim_v), device=device, dtype=torch.float32)


def _dkdv_shares(work, heads_per_row: int, group: int, head_dim: int) -> DkdvShares:
    """DkdvShares from ``work`` [B * NU], the query blocks (of DKDV_SPLIT_QUERY_BLOCK) each unit walks."""
    units = work.numel()
    shares, first = torch.ones(2, units, dtype=torch.int32, device=work.device)
    if group == 1 or units == 0:  # one query head per K/V head: nothing to share out
        return DkdvShares(shares, first, 1, 0, DKDV_SPLIT_UNIT)
    per_slot = 2 * DKDV_SPLIT_UNIT * head_dim * 4  # a float32 dK and dV tile of one unit (Dv as D)
    sms = sm_count(work.device)
    # the largest F's slots stay under 2 F x SMs (docs/design_notes.md, "dK/dV shares by each key block's
    # work"), and under every unit split into every head
    slots = min(DKDV_SPLIT_WORKSPACE_BYTES // per_slot, 2 * DKDV_SPLIT_PROGRAMS_PER_SM * sms,
                units * heads_per_row * group)  # fmt: skip
    dkdv_shares_kernel[(1,)](
        work, shares, first, units, heads_per_row, group, sms, DKDV_SPLIT_PROGRAMS_PER_SM, slots,
        NUM_F=DKDV_SPLIT_PROGRAMS_PER_SM.bit_length() + 1, CHUNK=256 if not INTERPRET else 16,
    )  # fmt: skip
    return DkdvShares(shares, first, group if slots > 0 else 1, slots, DKDV_SPLIT_UNIT)


def _build_block_lists(subtree_end, position_ids, window, Tq, BLOCK_M, BLOCK_N) -> BlockLists:
    B, Tk = subtree_end.shape
    Mq, Nk = cdiv(Tq, BLOCK_M), cdiv(Tk, BLOCK_N)
    count, full = torch.empty(2, B * Mq, dtype=torch.int32, device=subtree_end.device)
    idx, run = torch.empty(2, B * Mq * Nk, dtype=torch.int32, device=subtree_end.device)
    block_lists_kernel[(Mq, B)](
        subtree_end, subtree_end if window is None else position_ids, count, full, idx, run, subtree_end.stride(0),
        Tq, Tk, Nk, window or 0, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CHUNK=SCHEDULE_CHUNK, WINDOW=window is not None,
    )  # fmt: skip
    return BlockLists(count, full, idx, run, Nk)


def _check_num_queries(num_queries, Tk: int) -> None:
    if isinstance(num_queries, bool) or not isinstance(num_queries, int):
        raise TypeError(f"num_queries must be an int, got {type(num_queries).__name__}")
    if not 1 <= num_queries <= Tk:
        raise ValueError(f"number of queries ({num_queries}) must be between 1 and the number of keys ({Tk})")


def build_schedule(
    subtree_end: torch.Tensor, num_queries: int | None = None, validate: bool = True, *, position_ids=None
) -> TreeSchedule:
    """Check ``subtree_end`` ([Tk] or [B, Tk] int) and wrap a copy of it for the kernels: writing to
    ``subtree_end`` later leaves the schedule as it was built. ``position_ids`` (the keys' depths, shaped
    as ``subtree_end``) serve sliding windows."""
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
    end = rows.to(torch.int32, memory_format=torch.contiguous_format, copy=True)
    pos = None
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype.is_floating_point:
            raise TypeError(f"position_ids must be an integer tensor, got {type(position_ids).__name__}")
        if position_ids.shape != subtree_end.shape:
            raise ValueError(
                f"position_ids has shape {tuple(position_ids.shape)}, subtree_end {tuple(subtree_end.shape)}"
            )
        pos = (position_ids if position_ids.dim() == 2 else position_ids[None]).to(end.device)
        pos = pos.to(torch.int32, memory_format=torch.contiguous_format, copy=True)
    return TreeSchedule(end, num_queries, pos)
