"""The Hopper forward (dta_fast/attention_hopper.py).

On any host: it compiles for sm_90 with the installed Triton (CI checks the oldest supported one and
the newest) and fits an H100's shared memory. On a Hopper GPU: it runs exactly where ``applies`` says,
and its output and LSE are bitwise those of the Triton forward it stands in for, which the rest of the
suite checks against the reference (outputs and gradients) on every GPU.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dta_fast import attention_hopper, build_schedule, tree_attention
from dta_ref import PrefixTree, agentic_batch, grpo_batch
from tests.attention_checks import poison_empty, random_depths, subtree_end_from_depths  # noqa: F401 (autouse)

HOPPER_SHARED_MEMORY = 227 * 1024  # bytes a block may use on sm_90
IS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9

pytestmark = pytest.mark.skipif(not attention_hopper.HAVE_GLUON, reason="this Triton has no Gluon")


def compile_for_hopper(head_dim: int, dtype_name: str) -> dict:
    """Compile the kernel for sm_90 on this host (no GPU needed); what the compiler reports."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    gl = attention_hopper.gl
    dtype = getattr(torch, dtype_name)
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    x = torch.empty(2, 4, 1000, head_dim, dtype=dtype)
    ints = torch.empty(8, dtype=torch.int32)
    args = dict(
        q_desc=attention_hopper._descriptor(x, [1, 1, attention_hopper.BLOCK_M // 2, head_dim], gl_dtype),
        k_desc=attention_hopper._descriptor(x, [1, 1, attention_hopper.BLOCK_N, head_dim], gl_dtype),
        v_desc=attention_hopper._descriptor(x, [1, 1, attention_hopper.BLOCK_N, head_dim], gl_dtype),
        O=x, LSE=torch.empty(4), END=ints, KV_COUNT=ints, KV_FULL=ints, KV_IDX=ints, KV_RUN=ints,
        SEES_BAD=torch.empty(4, dtype=torch.int8), qk_scale=0.1, stride_ob=4000 * head_dim, stride_oh=1000 * head_dim,
        stride_ot=head_dim, stride_eb=0, stride_kv_b=0, NK=8, Hq=4, GROUP=1, Tq=1000, Tk=1000,
    )  # fmt: skip
    kernel = attention_hopper.tree_attention_fwd_hopper_kernel
    names = inspect.signature(kernel.fn).parameters
    signature = {n: "constexpr" if n == "STAGES" else mangle_type(args[n]) for n in names}
    source = GluonASTSource(kernel, signature, constexprs={"STAGES": attention_hopper.STAGES})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
    ptx = compiled.asm["ptx"]
    return {"num_warps": compiled.metadata.num_warps, "shared": compiled.metadata.shared,
            "wgmma": "wgmma.mma_async" in ptx, "setmaxnreg": "setmaxnreg" in ptx}


@pytest.mark.kernel
def test_compiles_for_hopper():
    """In a process of its own: Triton's interpreter (the CPU suite's mode) replaces the jit functions
    Gluon's reductions are built from, so the compiler cannot run beside it."""
    code = ("import json, tests.test_attention_hopper as t; print(json.dumps([t.compile_for_hopper(d, n) "
            "for d in (64, 128) for n in ('bfloat16', 'float16')]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parent.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    for report in json.loads(done.stdout.strip().splitlines()[-1]):
        assert report["num_warps"] == 12, report  # 4 + 4 compute, 1 loader rounded up to a warpgroup
        assert 0 < report["shared"] <= HOPPER_SHARED_MEMORY, report
        assert report["wgmma"] and report["setmaxnreg"], report


def test_applies_only_where_it_can():
    """Off the GPU (and, on one, for float32, other head dims and short calls) the Triton forward runs."""
    x = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    assert not attention_hopper.applies(x, x, x, (128, 128))
    if IS_HOPPER:
        y = x.cuda()
        assert attention_hopper.applies(y, y, y, (128, 128)) == attention_hopper.ENABLED
        assert not attention_hopper.applies(y.float(), y.float(), y.float(), (128, 128))
        z = torch.zeros(1, 2, 256, 80, dtype=torch.bfloat16, device="cuda")
        assert not attention_hopper.applies(z, z, z, (128, 128))
        assert not attention_hopper.applies(y[:, :, :63], y, y, (128, 128))
        assert not attention_hopper.applies(y, y, y, (128, 64))
        assert not attention_hopper.applies(y[..., 1:65], y[..., 1:65], y[..., 1:65], (128, 128))  # misaligned


def _case(name):
    """(q, k, v, subtree_end, scale) of a named case, on the GPU."""
    rng = np.random.default_rng(7)
    g = torch.Generator(device="cuda").manual_seed(0)

    def qkv(B, Hq, Hkv, Tq, Tk, D, dtype=torch.bfloat16):
        return (torch.randn(B, Hq, Tq, D, generator=g, device="cuda", dtype=dtype),
                torch.randn(B, Hkv, Tk, D, generator=g, device="cuda", dtype=dtype),
                torch.randn(B, Hkv, Tk, D, generator=g, device="cuda", dtype=dtype))  # fmt: skip

    grpo = PrefixTree.from_sequences(grpo_batch(1, 700, 5, 300)).subtree_end.cuda()
    T = grpo.numel()
    if name == "grpo":
        return (*qkv(1, 4, 4, T, T, 128), grpo, None)
    if name == "gqa head dim 64, float16":
        return (*qkv(1, 14, 2, T, T, 64, torch.float16), grpo, None)
    if name == "agentic":
        end = PrefixTree.from_sequences(agentic_batch(700, 3, 60, 3, 3, 90, 200)).subtree_end.cuda()
        return (*qkv(1, 8, 2, end.numel(), end.numel(), 128), end, None)
    if name == "cached prefix, odd query count":
        end = subtree_end_from_depths(random_depths(3001, rng, p_up=0.02)).cuda()
        return (*qkv(2, 4, 2, 1111, 3001, 128), end, None)
    if name == "non-finite rows":
        q, k, v = qkv(1, 4, 2, T, T, 128)
        v[0, 1, 100] = float("nan")
        v[0, 0, T - 5] = float("inf")
        k[0, 1, 2000] = float("-inf")
        q[0, 3, 10] = float("nan")
        return q, k, v, grpo, None
    if name == "model layout, a tree per row, negative scale":
        ends = torch.stack([subtree_end_from_depths(random_depths(1500, rng)) for _ in range(2)]).cuda()
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv(2, 6, 3, 1500, 1500, 128))
        return q, k, v, ends, -0.3
    if name == "one tree for two rows":
        return (*qkv(2, 4, 4, T, T, 128), grpo, None)
    raise ValueError(name)


CASES = ["grpo", "gqa head dim 64, float16", "agentic", "cached prefix, odd query count", "non-finite rows",
         "model layout, a tree per row, negative scale", "one tree for two rows"]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", CASES)
def test_bitwise_the_triton_forward(name, monkeypatch):
    q, k, v, end, scale = _case(name)
    schedule = build_schedule(end, q.shape[2])
    ran = []
    hopper_forward = attention_hopper.forward
    monkeypatch.setattr(attention_hopper, "forward", lambda *a: ran.append(1) or hopper_forward(*a))
    out, lse = tree_attention(q, k, v, scale=scale, schedule=schedule, return_lse=True)
    assert ran, "the Hopper forward did not run"
    monkeypatch.setattr(attention_hopper, "ENABLED", False)
    out_triton, lse_triton = tree_attention(q, k, v, scale=scale, schedule=schedule, return_lse=True)
    assert len(ran) == 1
    torch.testing.assert_close(out, out_triton, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lse, lse_triton, rtol=0, atol=0, equal_nan=True)
    if name == "non-finite rows":
        assert out.isnan().any() and not out.isnan().all()


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper GPU")
def test_gradients_through_the_hopper_forward(monkeypatch):
    """The backward reads the forward's LSE: the gradients are bitwise those with the Triton forward."""
    q, k, v, end, _ = _case("agentic")
    do = torch.randn_like(q)
    schedule = build_schedule(end)
    grads = []
    for enabled in (True, False):
        monkeypatch.setattr(attention_hopper, "ENABLED", enabled)
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        tree_attention(*x, schedule=schedule).backward(do)
        grads.append([t.grad for t in x])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
