"""Where a tree attention call's host time goes: each launcher and helper of dta_fast.attention, timed.

    python benchmarks/dev/host_cost.py [--rollouts grpo_p2k_n8_r1k ...] [--heads qwen2] [--calls 200] [--out DIR]

A small tree's forward + backward is host-bound (dev/small_trees.py). Per tree (schedule prebuilt, bf16),
this times ``--calls`` forward + backward calls without waiting for the GPU, with every function of
dta_fast.attention's call path wrapped in a host timer (inclusive: a wrapped function's time includes the
wrapped functions it calls), then the same calls under cProfile (the 30 largest own times). Floors of the
same run: an empty Triton kernel of as many arguments as the forward's, launched through ``kernel[grid]``,
and an autograd Function that does nothing. The calls replay from CUDA graphs, as by default
(dta_fast/attention/graphed.py); ``DTA_ATTENTION_GRAPHS=0`` times the eager path, whose every launcher
then shows. Writes results/host_cost_<GPU>.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_attention  # noqa: E402
import harness  # noqa: E402
import shapes  # noqa: E402
import small_trees  # noqa: E402

from dta_fast.attention import function, graphed, hopper, schedule  # noqa: E402

WRAPPED = {
    function: ["tree_attention", "_forward", "_backward", "_backward_preprocess", "_backward_dkdv", "_backward_dq",
               "_finite_rows", "queries_seeing", "_launch_tuned", "_tma_descriptors", "_sum_dkdv_shares",
               "_check_inputs", "autocast_inputs", "check_sinks"],
    hopper: ["forward", "backward_dkdv", "backward_dq", "descriptor", "applies"],
}  # fmt: skip
SCHEDULE_METHODS = ["block_lists", "key_block_order", "dkdv_shares"]


def timed(totals, name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name][0] += time.perf_counter() - t0
            totals[name][1] += 1

    return wrapper


def host_breakdown(step, calls: int) -> dict:
    totals = defaultdict(lambda: [0.0, 0])
    saved = []
    for module, names in WRAPPED.items():
        for name in names:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, timed(totals, f"{module.__name__.rsplit('.', 1)[-1]}.{name}", saved[-1][2]))
    for name in SCHEDULE_METHODS:
        saved.append((schedule.TreeSchedule, name, getattr(schedule.TreeSchedule, name)))
        setattr(schedule.TreeSchedule, name, timed(totals, f"TreeSchedule.{name}", saved[-1][2]))
    try:
        call_us = plain_host_us(step, calls, before=totals.clear)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return dict(
        call_us=call_us,
        parts={k: dict(us=v[0] / calls * 1e6, per_call=v[1] / calls) for k, v in sorted(totals.items())},
    )


def plain_host_us(step, calls: int, before=None) -> float:
    """Host microseconds per call of ``calls`` unsynchronised calls, after a warm-up call (then ``before()``)."""
    step()
    if before is not None:
        before()
    harness.sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    wall = time.perf_counter() - t0
    harness.sync()
    return wall / calls * 1e6


def profile(step, calls: int) -> str:
    step()
    harness.sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    harness.sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    return out.getvalue()


@triton.jit
def _empty_kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9,
                  s10, s11, s12, s13, s14, s15, s16, s17, s18, s19, s20, s21, X: tl.constexpr):  # fmt: skip
    pass


class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def floors(p, calls: int) -> dict:
    tensors = [p.q] * 13
    ints = [4096 + 16 * i for i in range(22)]

    def launch():
        _empty_kernel[(80, 14)](*tensors, *ints, X=1)

    x = torch.zeros(8, device="cuda", requires_grad=True)

    def nothing():
        _Nothing.apply(x).sum().backward()

    def empty():
        torch.empty(1, 14, 10240, 64, device="cuda", dtype=torch.bfloat16)

    return dict(
        triton_launch_35_args_us=plain_host_us(launch, calls),
        autograd_function_sum_backward_us=plain_host_us(nothing, calls),
        torch_empty_us=plain_host_us(empty, calls),
    )


def case(key: str, heads_key: str, calls: int) -> dict:
    tree, heads = shapes.tree(key), shapes.HEADS[heads_key]
    p = bench_attention.problem(key, tree, heads)
    fns = bench_attention.tree_methods(p, dense=False)
    step = bench_attention.fwd_bwd(fns["tree"], p)
    fwd = bench_attention.forward_only(fns["tree"], p)
    for _ in range(3):
        step()
    row = dict(rollouts=key, heads=heads_key, T=tree.num_tokens, graphs=graphed.ENABLED)
    row["fwd_bwd_us"] = plain_host_us(step, calls)
    row["fwd_no_grad_us"] = plain_host_us(fwd, calls)
    row["breakdown"] = host_breakdown(step, calls)
    row["floors"] = floors(p, calls)
    row["cprofile"] = profile(step, calls)
    return row


def parser() -> argparse.ArgumentParser:
    p = small_trees.parser()  # the same trees and heads
    p.description = __doc__
    p.add_argument("--calls", type=int, default=200)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    rows = [case(key, args.heads, args.calls) for key in args.rollouts]
    for r in rows:
        print(f"== {r['rollouts']} ({r['heads']}): fwd+bwd {r['fwd_bwd_us']:.0f} us host, "
              f"forward without grad {r['fwd_no_grad_us']:.0f} us; floors {r['floors']}")  # fmt: skip
        for name, part in r["breakdown"]["parts"].items():
            print(f"  {name:36s} {part['us']:8.1f} us  x{part['per_call']:.0f}")
        print(r["cprofile"])
    harness.write_results("host_cost", rows, args.out, key=lambda r: (r["rollouts"], r["heads"]))


if __name__ == "__main__":
    main()
