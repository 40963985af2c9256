"""Sweep block sizes, warps and stages of the three tree attention kernels.

    python benchmarks/tune_attention.py [--heads 32 --kv-heads 32 --head-dim 128] [--out DIR]

Times each kernel alone (forward, dK/dV, dQ) on a GRPO tree and on a plain
causal chain, next to SDPA flash on the same causal problem, so the cost of
the tree machinery and the base kernel efficiency can be told apart; and on
the attention calls of one layer of a chunked ``tree_backward`` step (the
benchmark batches of bench_training.py, each chunk attending its cached
prefix, recomputed chunks running the forward twice). Prints one table per
kernel and writes JSON. The defaults in dta_fast/attention.py (the block
tables, the autotune lists) come from runs of this script.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from dta_fast import attention as ta
from dta_fast import build_schedule
from dta_fast.engine import _plan
from dta_ref import PrefixTree, agentic_batch, grpo_batch

SWEEP_SMALL_HEAD = {  # head dim <= 64: larger key blocks fit
    "fwd": [(128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    "dkdv": [(64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 4, 3), (128, 128, 8, 2), (32, 128, 4, 3), (128, 64, 8, 2)],
    "dq": [(64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 4, 3)],
}
SWEEP = {
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 4), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 4),
            (64, 128, 4, 3), (128, 32, 4, 3)],
    "dkdv": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (32, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 4),
             (64, 128, 8, 2), (32, 32, 4, 3), (16, 64, 4, 3)],
    "dq": [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3), (32, 64, 4, 3),
           (64, 128, 8, 3)],
}
KERNELS = {"fwd": ta.tree_attention_fwd_kernel, "dkdv": ta.tree_attention_bwd_dkdv_kernel, "dq": ta.tree_attention_bwd_dq_kernel}
FLOP_MATMULS = {"fwd": 2, "dkdv": 4, "dq": 3}  # matmuls per visible pair, as executed


@dataclass
class Call:
    """One tree_attention call: the keys' subtree ends (chunk coordinates), the number of queries (the
    last num_queries keys) and how many times the step runs its forward."""

    key_end: torch.Tensor
    num_queries: int
    forwards: int = 1


def step_calls(sequences, chunk_tokens, recompute):
    """The tree_attention calls of one layer of ``tree_backward`` with chunks of ``chunk_tokens``.

    A chunk [a, b) attends the ancestors of its first token (the open chunks' tokens whose subtrees
    reach past a) and itself; with ``recompute`` a chunk that stays open runs its forward again.
    """
    tree = PrefixTree.from_sequences(sequences)
    end = tree.subtree_end
    calls = []
    for a, b in _plan(tree, chunk_tokens, recompute).chunks:
        prefix = (end[:a] > a).nonzero().squeeze(1)
        key_end = torch.cat([end[prefix], end[a:b]]).clamp(max=b) - a + prefix.numel()
        reopened = recompute and int(end[a:b].max()) > b
        calls.append(Call(key_end, b - a, 2 if reopened else 1))
    return calls


def problems():
    whole = {
        "GRPO P=8K N=16 R=1K": PrefixTree.from_sequences(grpo_batch(1, 8192, 16, 1024)).subtree_end,
        "agentic 1 task": PrefixTree.from_sequences(agentic_batch(num_tasks=1, rollouts_per_task=4, turns=8)).subtree_end,
        "causal T=16K": torch.full((16384,), 16384),
    }
    calls = {name: [Call(end, end.numel())] for name, end in whole.items()}
    # the bench_training.py steps at the chunkings measured there
    calls["GRPO step, chunks 8192 kept"] = step_calls(grpo_batch(1, 8192, 16, 1024), 8192, recompute=False)
    agentic = agentic_batch(num_tasks=4, rollouts_per_task=4, turns=8)
    calls["agentic step, chunks 16384"] = step_calls(agentic, 16384, recompute=True)
    return calls


def visible_pairs(call):
    """(query, key) pairs the call's queries attend."""
    Tk = call.key_end.numel()
    first_query = Tk - call.num_queries
    lo = torch.arange(Tk).clamp(min=first_query)
    return int((call.key_end.clamp(max=Tk) - lo).clamp(min=0).sum())


def _bench(fn):
    ms = do_bench(fn, quantiles=[0.5])
    return ms[0] if isinstance(ms, (list, tuple)) else ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--problems", nargs="*", help="names (or leading words) of the problems to run; default all")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    H, D, dtype = args.heads, args.head_dim, torch.bfloat16
    Hkv = args.kv_heads or H
    sweep = SWEEP_SMALL_HEAD if D <= 64 else SWEEP
    rows = []
    for pname, pcalls in problems().items():
        if args.problems and not any(pname.startswith(p) for p in args.problems):
            continue
        runs = []  # per call: the three kernels' launches on its own tensors
        for call in pcalls:
            Tk, Tq = call.key_end.numel(), call.num_queries
            q, do = (torch.randn(1, H, Tq, D, device="cuda", dtype=dtype) for _ in range(2))
            k, v = (torch.randn(1, Hkv, Tk, D, device="cuda", dtype=dtype) for _ in range(2))
            schedule = build_schedule(call.key_end.cuda(), Tq)
            o, lse, _ = ta._forward(q, k, v, schedule, D**-0.5)
            delta, lse_bwd = ta._backward_preprocess(o, do, q, lse)[:2]  # the rows the backward kernels read
            runs.append((call, q, k, v, do, schedule, lse_bwd, delta))
        pairs = {kernel: sum(visible_pairs(r[0]) * (r[0].forwards if kernel == "fwd" else 1) for r in runs)
                 for kernel in FLOP_MATMULS}
        scale = D**-0.5

        def launch(kernel):
            for call, q, k, v, do, schedule, lse, delta in runs:
                if kernel == "fwd":
                    for _ in range(call.forwards):
                        ta._forward(q, k, v, schedule, scale)
                elif kernel == "dkdv":
                    ta._backward_dkdv(do, q, k, v, lse, delta, schedule, scale)
                else:
                    ta._backward_dq(do, q, k, v, lse, delta, schedule, scale)

        for kernel, configs in sweep.items():
            for BM, BN, warps, stages in configs:
                ta.block_table(D, dtype)[kernel] = (BM, BN)
                KERNELS[kernel].configs = [triton.Config({}, num_warps=warps, num_stages=stages)]
                KERNELS[kernel].cache.clear()
                ta._CHOSEN_CONFIGS.clear()  # the launches' record of the autotuner's choice
                try:
                    ms = _bench(lambda: launch(kernel))
                except Exception as exc:  # a config that does not fit (shared memory) is skipped
                    print(f"{pname} {kernel} {BM}x{BN} w{warps} s{stages}: {type(exc).__name__}")
                    continue
                tflops = 2 * FLOP_MATMULS[kernel] * pairs[kernel] * D * H / ms / 1e9
                rows.append(dict(problem=pname, heads=H, kv_heads=Hkv, head_dim=D, kernel=kernel, BM=BM, BN=BN, warps=warps, stages=stages, ms=ms, tflops=tflops))
                print(f"{pname:<28} {kernel:<5} {BM:>4}x{BN:<4} w{warps} s{stages}  {ms:8.3f} ms  {tflops:6.0f} TFLOP/s executed", flush=True)
        if pname.startswith("causal"):  # SDPA flash on the same problem (K/V heads repeated for GQA)
            _, q, k, v, do = runs[0][:5]
            T = q.shape[2]
            pairs = pairs["fwd"]
            kv = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))
            qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, *kv))
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                fwd_ms = _bench(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True))
                out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
                bwd_ms = _bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
            print(f"SDPA flash causal T={T}: fwd {fwd_ms:.3f} ms ({4 * pairs * D * H / fwd_ms / 1e9:.0f} TFLOP/s), "
                  f"bwd {bwd_ms:.3f} ms ({10 * pairs * D * H / bwd_ms / 1e9:.0f} TFLOP/s useful)")
            rows.append(dict(problem=pname, kernel="sdpa_flash", fwd_ms=fwd_ms, bwd_ms=bwd_ms))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = "" if (H, Hkv, D) == (32, 32, 128) else f"_h{H}_kv{Hkv}_d{D}"
    (out / f"tune_{torch.cuda.get_device_name().replace(' ', '_')}{shape}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
