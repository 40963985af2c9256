"""What the float32 dQ reductions of a fused backward cost on their own (Hopper).

    python benchmarks/bench_dq_reductions.py [--out DIR]

A backward that adds dQ inside the dK/dV pass, instead of recomputing S and dP in a dQ pass, adds one
64 x 128 float32 tile (32 KB) into dQ per (key block of 128, head, live query tile of 64). This
times those additions alone, with nothing else in the kernel, on the GRPO trees of the attention
table (H=32, D=128): one program per (key block, head) that adds a constant tile from shared memory
by TMA's bulk reduction (``cp.reduce.async.bulk``) for each of its live query tiles, with 1, 2 or 6
staging buffers in flight (6: 192 KB, one program per SM, as a fused dK/dV kernel would run), the
programs ordered key block by key block (each key block's heads side by side, as the dK/dV pass
launches them) or head by head (a head's key blocks side by side, so that the dQ rows being added
to fit the 50 MB L2); and the same additions with ``tl.atomic_add``. Gated on the sum. ``do_bench``
medians; prints a table and writes dq_reductions.json.
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.testing import do_bench

from bench_attention import write_results
from compare_attention import SHAPES
from dta_ref import PrefixTree

H, D, ROWS, KEYS = 32, 128, 64, 128

_reduce_add = getattr(tma, "async_atomic_add", None)
if _reduce_add is None:  # Triton 3.6's Gluon has the operation in its builder but no function for it
    from triton._C.libtriton import ir
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def _reduce_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def tma_reductions_kernel(dq_desc, ORDER, M_LO, M_HI, T, NUM_HEADS, NUM_KEY_BLOCKS,
                          BUFFERS: gl.constexpr, HEAD_MAJOR: gl.constexpr):  # fmt: skip
    pid = gl.program_id(0)
    if HEAD_MAJOR:
        n = gl.load(ORDER + pid % NUM_KEY_BLOCKS)
        h = pid // NUM_KEY_BLOCKS
    else:
        n = gl.load(ORDER + pid // NUM_HEADS)
        h = pid % NUM_HEADS
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    rows: gl.constexpr = dq_desc.block_type.shape[0]
    bufs = gl.allocate_shared_memory(gl.float32, [BUFFERS] + dq_desc.block_type.shape, dq_desc.layout)
    for s in gl.static_range(BUFFERS):
        bufs.index(s).store(gl.full(dq_desc.block_type.shape, 1.0, gl.float32, layout))
    fence_async_shared()
    i = 0
    for m in range(gl.load(M_LO + n), gl.load(M_HI + n)):
        tma.store_wait(BUFFERS - 1)  # at most BUFFERS additions still reading shared memory
        _reduce_add(dq_desc, [h * T + m * rows, 0], bufs.index(i % BUFFERS))
        i += 1
    tma.store_wait(0)


@triton.jit
def atomic_reductions_kernel(DQ, ORDER, M_LO, M_HI, T, NUM_HEADS, ROWS_: tl.constexpr, D_: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.load(ORDER + pid // NUM_HEADS)
    h = pid % NUM_HEADS
    offs_m, offs_d = tl.arange(0, ROWS_), tl.arange(0, D_)
    one = tl.full([ROWS_, D_], 1.0, tl.float32)
    for m in range(tl.load(M_LO + n), tl.load(M_HI + n)):
        rows = (h * T + m * ROWS_ + offs_m).to(tl.int64)
        tl.atomic_add(DQ + rows[:, None] * D_ + offs_d[None, :], one, sem="relaxed")


def live_tiles(end: torch.Tensor):
    """Per key block of KEYS: its live query tiles of ROWS, [m_lo, m_hi) (every query from the block's
    first key to its keys' largest subtree end sees one of them), and the blocks longest first."""
    T = end.numel()
    num_key_blocks = -(-T // KEYS)
    m_lo = torch.arange(num_key_blocks, dtype=torch.int32) * (KEYS // ROWS)
    padded = torch.nn.functional.pad(end, (0, num_key_blocks * KEYS - T))
    m_hi = (-(-padded.view(num_key_blocks, KEYS).amax(1) // ROWS)).to(torch.int32)
    order = torch.argsort(m_hi - m_lo, descending=True, stable=True).to(torch.int32)
    return m_lo, m_hi, order


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["GRPO P=2K N=8 R=1K", "GRPO P=8K N=16 R=1K"],
                        choices=list(SHAPES))  # fmt: skip
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    rows = []
    print("ms (do_bench median) to add every live 64 x 128 float32 dQ tile, alone")
    for shape in args.shapes:
        end = PrefixTree.from_sequences(SHAPES[shape]()).subtree_end.reshape(-1).long()
        T = end.numel()
        if T % ROWS:
            raise SystemExit(f"{shape}: {T} tokens, not a multiple of {ROWS} (the tiles here assume whole ones)")
        m_lo, m_hi, order = (x.cuda() for x in live_tiles(end))
        num_key_blocks = m_lo.numel()
        tiles = int((m_hi - m_lo).sum()) * H
        dq = torch.zeros(H * T, D, device="cuda")
        desc = TensorDescriptor.from_tensor(dq, [ROWS, D], gl.NVMMASharedLayout.get_default_for([ROWS, D], gl.float32))
        row = {"shape": shape, "T": T, "tiles": tiles, "GB_added": tiles * ROWS * D * 4 / 1e9}
        grid = (num_key_blocks * H,)
        for head_major in (False, True):
            for buffers in (1, 2, 6):
                def run(head_major=head_major, buffers=buffers):
                    tma_reductions_kernel[grid](desc, order, m_lo, m_hi, T, H, num_key_blocks, BUFFERS=buffers,
                                                HEAD_MAJOR=head_major, num_warps=4)  # fmt: skip

                dq.zero_()
                run()
                want = torch.zeros(T // ROWS + 1, device="cuda")
                for n in range(num_key_blocks):
                    want[int(m_lo[n]):int(m_hi[n])] += 1
                if not torch.equal(dq.view(H, -1, ROWS, D)[:, :, 0, 0], want[: T // ROWS].expand(H, -1)):
                    raise RuntimeError("the TMA reductions did not add up")
                row[f"tma_{'head_major' if head_major else 'key_block_major'}_{buffers}_buffers_ms"] = do_bench(run)
        row["atomic_add_key_block_major_ms"] = do_bench(
            lambda: atomic_reductions_kernel[grid](dq, order, m_lo, m_hi, T, H, ROWS_=ROWS, D_=D, num_warps=4))
        rows.append(row)
        print(f"\n{shape}: {tiles} tiles, {row['GB_added']:.2f} GB added into a {dq.numel() * 4 / 1e6:.0f} MB dQ")
        for name, ms in row.items():
            if name.endswith("_ms"):
                print(f"  {name[:-3]:40s} {ms:8.3f} ms  {row['GB_added'] / ms:5.2f} TB/s added")
    out = write_results(args.out, "dq_reductions.json", rows, "bench_dq_reductions.py: do_bench medians")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
