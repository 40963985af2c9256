"""Sweep block sizes, warps and stages of the three tree attention kernels.

    python benchmarks/tune_attention.py [--heads 32 --kv-heads 32 --head-dim 128] [--out DIR]

Times each kernel alone (forward, dK/dV, dQ) on a GRPO tree and on a plain
causal chain, next to SDPA flash on the same causal problem, so the cost of
the tree machinery and the base kernel efficiency can be told apart. Prints
one table per kernel and writes JSON. The defaults in dta_fast/attention.py
(the block tables, the autotune lists) come from runs of this script.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from dta_fast import build_schedule
from dta_fast import attention as ta
from dta_ref import PrefixTree, agentic_batch, grpo_batch

SWEEP_SMALL_HEAD = {  # head dim <= 64: larger key blocks fit
    "fwd": [(128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    "dkdv": [(64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 4, 3), (128, 128, 8, 2), (32, 128, 4, 3), (128, 64, 8, 2)],
    "dq": [(64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 4, 3)],
}
SWEEP = {
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 4)],
    "dkdv": [(64, 128, 8, 2), (64, 128, 4, 2), (32, 128, 4, 3), (64, 64, 4, 2), (128, 128, 8, 1), (32, 64, 4, 3)],
    "dq": [(128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 8, 2)],
}
KERNELS = {"fwd": ta.tree_attention_fwd_kernel, "dkdv": ta.tree_attention_bwd_dkdv_kernel, "dq": ta.tree_attention_bwd_dq_kernel}
FLOP_MATMULS = {"fwd": 2, "dkdv": 4, "dq": 3}  # matmuls per visible pair, as executed


def problems():
    grpo = PrefixTree.from_sequences(grpo_batch(1, 8192, 16, 1024)).subtree_end
    agentic = PrefixTree.from_sequences(agentic_batch(num_tasks=1, rollouts_per_task=4, turns=8)).subtree_end
    chain = torch.full((16384,), 16384)
    return {"GRPO P=8K N=16 R=1K": grpo, "agentic 1 task": agentic, "causal T=16K": chain}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    H, D, dtype = args.heads, args.head_dim, torch.bfloat16
    Hkv = args.kv_heads or H
    sweep = SWEEP_SMALL_HEAD if D <= 64 else SWEEP
    rows = []
    for pname, end in problems().items():
        T = end.shape[0]
        end = end.cuda()
        pairs = int((end.cpu() - torch.arange(T)).sum())
        q, do = (torch.randn(1, H, T, D, device="cuda", dtype=dtype) for _ in range(2))
        k, v = (torch.randn(1, Hkv, T, D, device="cuda", dtype=dtype) for _ in range(2))
        scale = D**-0.5
        schedule = build_schedule(end)
        o, lse = ta._forward(q, k, v, schedule, scale)
        delta = ta._backward_preprocess(o, do)
        calls = {
            "fwd": lambda: ta._forward(q, k, v, schedule, scale),
            "dkdv": lambda: ta._backward_dkdv(do, q, k, v, lse, delta, schedule, scale),
            "dq": lambda: ta._backward_dq(do, q, k, v, lse, delta, schedule, scale),
        }
        for kernel, configs in sweep.items():
            for BM, BN, warps, stages in configs:
                ta.block_table(D)[kernel] = (BM, BN)
                KERNELS[kernel].configs = [triton.Config({}, num_warps=warps, num_stages=stages)]
                KERNELS[kernel].cache.clear()
                try:
                    ms = do_bench(calls[kernel], quantiles=[0.5])
                    if isinstance(ms, (list, tuple)):
                        ms = ms[0]
                except Exception as exc:  # a config that does not fit (shared memory) is skipped
                    print(f"{pname} {kernel} {BM}x{BN} w{warps} s{stages}: {type(exc).__name__}")
                    continue
                tflops = 2 * FLOP_MATMULS[kernel] * pairs * D * H / ms / 1e9
                rows.append(dict(problem=pname, heads=H, kv_heads=Hkv, head_dim=D, kernel=kernel, BM=BM, BN=BN, warps=warps, stages=stages, ms=ms, tflops=tflops))
                print(f"{pname:<22} {kernel:<5} {BM:>4}x{BN:<4} w{warps} s{stages}  {ms:8.3f} ms  {tflops:6.0f} TFLOP/s executed", flush=True)
        if pname.startswith("causal"):  # SDPA flash on the same problem (K/V heads repeated for GQA)
            kv = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))
            qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, *kv))
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                fwd_ms = do_bench(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True), quantiles=[0.5])
                out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
                bwd_ms = do_bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True), quantiles=[0.5])
            fwd_ms = fwd_ms[0] if isinstance(fwd_ms, (list, tuple)) else fwd_ms
            bwd_ms = bwd_ms[0] if isinstance(bwd_ms, (list, tuple)) else bwd_ms
            print(f"SDPA flash causal T={T}: fwd {fwd_ms:.3f} ms ({4 * pairs * D * H / fwd_ms / 1e9:.0f} TFLOP/s), "
                  f"bwd {bwd_ms:.3f} ms ({10 * pairs * D * H / bwd_ms / 1e9:.0f} TFLOP/s useful)")
            rows.append(dict(problem=pname, kernel="sdpa_flash", fwd_ms=fwd_ms, bwd_ms=bwd_ms))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = "" if (H, Hkv, D) == (32, 32, 128) else f"_h{H}_kv{Hkv}_d{D}"
    (out / f"tune_{torch.cuda.get_device_name().replace(' ', '_')}{shape}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
