"""The Hopper kernels (dta_fast/attention/hopper.py).

On any host: all three compile for sm_90 with the installed Triton (CI checks the oldest supported one
and the newest) and fit an H100's shared memory. On a Hopper GPU: they run where ``applies`` says, and
their outputs, LSE and gradients are bitwise those of the Triton kernels they stand in for, which the
rest of the suite checks against the reference on every GPU.
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dta_fast import build_schedule, tree_attention
from dta_fast.attention import hopper as attention_hopper
from dta_fast.attention.function import block_table
from dta_ref import PrefixTree, agentic_batch, grpo_batch
from tests.attention_checks import random_depths, subtree_end_from_depths

HOPPER_SHARED_MEMORY = 227 * 1024  # bytes a block may use on sm_90
IS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9

pytestmark = pytest.mark.skipif(not attention_hopper.HAVE_GLUON, reason="this Triton has no Gluon")


def compile_for_hopper(kernel_name: str, head_dim: int, dtype_name: str) -> dict:
    """Compile one of the kernels for sm_90 on this host (no GPU needed); what the compiler reports."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    H = attention_hopper
    gl = H.gl
    dtype = getattr(torch, dtype_name)
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    x = torch.empty(2, 4, 1000, head_dim, dtype=dtype)
    ints, floats = torch.empty(8, dtype=torch.int32), torch.empty(4)
    strides = dict(zip("bht", x.stride()[:3]))

    def desc(rows):
        return H.descriptor(x, [1, 1, rows, head_dim], gl_dtype)

    rows = H.descriptor(torch.empty(2, 4, 1000), [1, 1, H.DKDV_BLOCK_M], gl.float32)  # the backward's LSE, delta

    scalars = dict(Hq=4, GROUP=1, Tq=1000, Tk=1000, qk_scale=0.1, stride_eb=0)
    lists = dict(KV_COUNT=ints, KV_FULL=ints, KV_IDX=ints, KV_RUN=ints, stride_kv_b=0, NK=8)
    if kernel_name == "forward":
        kernel, stages, maxnreg = H.tree_attention_fwd_hopper_kernel, H.STAGES, 168
        args = dict(
            q_desc=desc(H.BLOCK_M // 2),
            k_desc=desc(H.BLOCK_N),
            v_desc=desc(H.BLOCK_N),
            O=x,
            LSE=floats,
            END=ints,
            SEES_BAD=torch.empty(4, dtype=torch.int8),
            **lists,
            **scalars,
            **{f"stride_o{d}": v for d, v in strides.items()},
        )
    elif kernel_name == "dkdv":
        kernel, stages, maxnreg = H.tree_attention_bwd_dkdv_hopper_kernel, H.DKDV_STAGES, 168
        args = dict(
            q_desc=desc(H.DKDV_BLOCK_M),
            k_desc=desc(H.DKDV_BLOCK_N // 2),
            v_desc=desc(H.DKDV_BLOCK_N // 2),
            do_desc=desc(H.DKDV_BLOCK_M),
            lse_desc=rows,
            delta_desc=rows,
            DK=x,
            DV=x,
            END=ints,
            ORDER=ints,
            SHARES=ints,
            FIRST=ints,
            WS=floats,
            sm_scale=0.1,
            heads_per_row=4,
            SPLITS=2,
            Hkv=4,
            **scalars,
            **{f"stride_dk{d}": v for d, v in strides.items()},
            **{f"stride_dv{d}": v for d, v in strides.items()},
        )
    else:
        kernel, stages, maxnreg = H.tree_attention_bwd_dq_hopper_kernel, H.DQ_STAGES, 128
        dq_block_m, dq_block_n = block_table(head_dim, dtype)["dq"]  # the Triton dQ's, which it twins
        assert H.dq_takes(dq_block_m, dq_block_n, head_dim)
        args = dict(
            q_desc=desc(H.DQ_BLOCK_M),
            do_desc=desc(H.DQ_BLOCK_M),
            k_desc=desc(dq_block_n),
            v_desc=desc(dq_block_n),
            LSE=floats,
            DELTA=floats,
            DQ=x,
            END=ints,
            sm_scale=0.1,
            stride_rows=1000,
            **lists,
            **scalars,
            **{f"stride_dq{d}": v for d, v in strides.items()},
        )
    names = inspect.signature(kernel.fn).parameters
    signature = {n: "constexpr" if n == "STAGES" else mangle_type(args[n]) for n in names}
    source = GluonASTSource(kernel, signature, constexprs={"STAGES": stages})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": maxnreg})
    ptx = compiled.asm["ptx"]
    return {
        "kernel": kernel_name,
        "num_warps": compiled.metadata.num_warps,
        "shared": compiled.metadata.shared,
        "wgmma": "wgmma.mma_async" in ptx,
        "setmaxnreg": "setmaxnreg" in ptx,
    }


@pytest.mark.kernel
@pytest.mark.slow
def test_compiles_for_hopper():
    """In a process of its own: Triton's interpreter (the CPU suite's mode) replaces the jit functions
    Gluon's reductions are built from, so the compiler cannot run beside it."""
    code = (
        "import json, tests.test_attention_hopper as t; print(json.dumps([t.compile_for_hopper(k, d, n) "
        "for k in ('forward', 'dkdv', 'dq') for d in (64, 128) for n in ('bfloat16', 'float16')]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    reports = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(reports) == 12
    for report in reports:
        # forward and dK/dV: 4 + 4 compute warps and a loader warp rounded up to a warpgroup; dQ: 4 + 1
        assert report["num_warps"] == (8 if report["kernel"] == "dq" else 12), report
        limit = HOPPER_SHARED_MEMORY // (2 if report["kernel"] == "dq" else 1)  # dQ: two programs per SM
        assert 0 < report["shared"] <= limit, report
        assert report["wgmma"] and report["setmaxnreg"], report


def test_applies_only_where_it_can():
    """Off the GPU, and on one for float32, other head dims, short calls and misaligned tensors, the
    Triton kernels run."""
    x = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    assert not attention_hopper.applies(x, x, x)
    if IS_HOPPER:
        y = x.cuda()
        assert attention_hopper.applies(y, y, y) == attention_hopper.ENABLED
        assert not attention_hopper.applies(y.float(), y.float(), y.float())
        z = torch.zeros(1, 2, 256, 80, dtype=torch.bfloat16, device="cuda")
        assert not attention_hopper.applies(z, z, z)
        assert not attention_hopper.applies(y[:, :, :63], y, y)
        w = torch.zeros(1, 2, 256, 136, dtype=torch.bfloat16, device="cuda")[..., 1:129]  # rows 2 bytes off
        assert not attention_hopper.applies(y, w, y)


def test_descriptor_layouts_are_each_blocks_default():
    """The layouts ``_descriptor`` keeps per (block, dtype) are the ones Gluon would pick for each call."""
    gl = attention_hopper.gl
    x = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    for block in ([1, 1, 64, 128], [1, 1, 128, 128], [1, 1, 64, 64]):
        for dtype in (gl.bfloat16, gl.float16, gl.bfloat16):  # the second bfloat16 call reads the cache
            layout = attention_hopper.descriptor(x, block, dtype).layout
            assert layout == gl.NVMMASharedLayout.get_default_for(block, dtype)


def _case(name):
    """(q, k, v, subtree_end, scale) of a named case, on the GPU."""
    rng = np.random.default_rng(7)
    g = torch.Generator(device="cuda").manual_seed(0)

    def qkv(B, Hq, Hkv, Tq, Tk, D, dtype=torch.bfloat16):
        return (
            torch.randn(B, Hq, Tq, D, generator=g, device="cuda", dtype=dtype),
            torch.randn(B, Hkv, Tk, D, generator=g, device="cuda", dtype=dtype),
            torch.randn(B, Hkv, Tk, D, generator=g, device="cuda", dtype=dtype),
        )

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


CASES = [
    "grpo",
    "gqa head dim 64, float16",
    "agentic",
    "cached prefix, odd query count",
    "non-finite rows",
    "model layout, a tree per row, negative scale",
    "one tree for two rows",
]


@pytest.mark.gpu
@pytest.mark.kernel
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
@pytest.mark.kernel
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", CASES)
def test_gradients_bitwise_the_triton_kernels(name, monkeypatch):
    """dK/dV and dQ run on Hopper (and the backward reads the Hopper forward's LSE): every gradient is
    bitwise the one the Triton kernels give."""
    q, k, v, end, scale = _case(name)
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=torch.Generator(device="cuda").manual_seed(1))
    schedule = build_schedule(end, q.shape[2])
    ran = []
    for kernel in ("backward_dkdv", "backward_dq"):
        original = getattr(attention_hopper, kernel)
        monkeypatch.setattr(attention_hopper, kernel, lambda *a, _f=original, _k=kernel: ran.append(_k) or _f(*a))
    grads = []
    for enabled in (True, False):
        monkeypatch.setattr(attention_hopper, "ENABLED", enabled)
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        tree_attention(*x, scale=scale, schedule=schedule).backward(do)
        grads.append([t.grad for t in x])
    assert ran == ["backward_dkdv", "backward_dq"]
    for a, b, what in zip(*grads, ("dq", "dk", "dv")):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=what)
    if name == "non-finite rows":
        assert all(g.isnan().any() and not g.isnan().all() for g in grads[0])


@st.composite
def _random_calls(draw):
    """(q, k, v, subtree_end, scale) of a call the Hopper kernels take: random forests up to 3,500 tokens,
    sizes at the block edges, GQA, a tree per row, cached prefixes, the model's [B, T, H, D] layout,
    non-finite rows."""
    D = draw(st.sampled_from([64, 128]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    Hq, Hkv = draw(st.sampled_from([(4, 4), (8, 2), (14, 2), (6, 3), (2, 1)]))
    B = draw(st.integers(1, 3))
    Tk = draw(st.one_of(st.sampled_from([64, 65, 127, 128, 129, 191, 255, 257]), st.integers(64, 3500)))
    Tq = draw(st.one_of(st.just(Tk), st.integers(64, Tk)))
    p_up = draw(st.sampled_from([0.0, 0.01, 0.05, 0.3, 0.8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    trees = [subtree_end_from_depths(random_depths(Tk, rng, p_up)) for _ in range(draw(st.sampled_from([1, B])))]
    end = (trees[0] if len(trees) == 1 else torch.stack(trees)).cuda()
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    model_layout = draw(st.booleans())

    def tensor(H, T):
        x = torch.randn(B, H, T, D, generator=g, device="cuda", dtype=dtype)
        return x.transpose(1, 2).contiguous().transpose(1, 2) if model_layout else x

    q, k, v = tensor(Hq, Tq), tensor(Hkv, Tk), tensor(Hkv, Tk)
    for x in (q, k, v):  # now and then a non-finite row, which isolation keeps to the queries that see it
        bad = draw(st.sampled_from([None, None, None, float("nan"), float("inf"), float("-inf")]))
        if bad is not None:
            x[tuple(int(rng.integers(n)) for n in x.shape[:3])] = bad
    scale = draw(st.one_of(st.none(), st.sampled_from([-0.3, 0.05, 0.2])))
    return q, k, v, end, scale


@pytest.mark.gpu
@pytest.mark.kernel
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper GPU")
@settings(
    max_examples=max(4, settings.default.max_examples // 5), suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # poison_empty holds for every example
@given(call=_random_calls())
def test_bitwise_the_triton_kernels_on_random_trees(call):
    """The named cases above, generalised: output, LSE and every gradient bitwise the Triton kernels'."""
    q, k, v, end, scale = call
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=torch.Generator(device="cuda").manual_seed(1))
    schedule = build_schedule(end, q.shape[2])
    ran, results = [], []
    hopper_forward = attention_hopper.forward
    with pytest.MonkeyPatch.context() as patch:  # per example, not per test
        patch.setattr(attention_hopper, "forward", lambda *a: ran.append(1) or hopper_forward(*a))
        for enabled in (True, False):
            patch.setattr(attention_hopper, "ENABLED", enabled)
            x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
            out, lse = tree_attention(*x, scale=scale, schedule=schedule, return_lse=True)
            out.backward(do)
            results.append([out.detach(), lse, *(t.grad for t in x)])
    assert len(ran) == 1, "the Hopper forward should run once, with the kernels enabled"
    for a, b, what in zip(*results, ("out", "lse", "dq", "dk", "dv")):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=what)
