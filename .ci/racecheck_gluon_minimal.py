"""The smallest warp-specialised Gluon kernel, for compute-sanitizer racecheck (.ci/README.md, "Sanitizers").

A loader warp hands one TMA tile to a compute warpgroup through an mbarrier; the kernel touches no shared
memory but that tile and the barrier. racecheck reports hazards on it all the same, at the lines of the
kernel's definition and of gl.warp_specialize: Triton's lowering of warp specialisation, which
dta_fast/attention/hopper.py's kernels show at the same lines. The lowering's hand-off is ordered by
CTA-wide barriers; racecheck misreads it because the default warps also meet at a counted barrier
(.ci/racecheck_counted_barrier.cu shows that alone in CUDA).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from dta_fast.attention.hopper import tma_load  # noqa: E402


@gluon.jit
def _compute(buf, bar, OUT):
    mbarrier.wait(bar, 0)
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    x = buf.load(layout)
    offs_m = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    offs_n = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    gl.store(OUT + gl.program_id(0) * 4096 + offs_m[:, None] * 64 + offs_n[None, :], x)


@gluon.jit
def _loader(desc, buf, bar):
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma_load(desc, [gl.program_id(0) * 64, 0], bar, buf)


@gluon.jit
def kernel(desc, OUT):
    buf = gl.allocate_shared_memory(desc.dtype, desc.block_type.shape, desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    gl.warp_specialize([(_compute, (buf, bar, OUT)), (_loader, (desc, buf, bar))], [1], [24])


x = torch.randn(64 * 8, 64, device="cuda", dtype=torch.float16)
out = torch.empty_like(x)
layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float16)
kernel[(8,)](TensorDescriptor.from_tensor(x, [64, 64], layout), out, num_warps=4)
torch.cuda.synchronize()
assert torch.equal(out, x)
print("ok")
