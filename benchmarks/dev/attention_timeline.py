"""Where one tree attention call's GPU time goes: each kernel's duration and start.

    python benchmarks/attention_timeline.py [--shapes ...] [--heads 32 --kv-heads 32 --head-dim 128]

Forward + backward under ``torch.profiler``, five calls back to back (the host runs ahead, as
in ``do_bench``) and five calls each followed by a synchronize (as in the CUDA-event harness of
bench_attention.py). Per kernel of the middle call: its duration, its start after the call's first
kernel, and for the three attention kernels the useful TFLOP/s it runs at (2, 4 and 3 products per
visible pair for the forward, dK/dV and dQ: ``2 * products * pairs * D * H`` over its duration).
The gap between a synced call's span and its kernels' busy time is the GPU waiting for the host.
bf16, the schedule built once outside the timing. Prints a table and writes
attention_timeline_h{H}_d{D}.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench_attention import write_results
from compare_attention import SHAPES
from dta_fast import build_schedule, tree_attention
from dta_ref import PrefixTree

CALLS = 5
PRODUCTS = {"fwd": 2, "dkdv": 4, "dq": 3}  # tile products per visible pair in each attention kernel


def _products(kernel_name: str) -> int | None:
    for tag, n in PRODUCTS.items():
        if f"_{tag}_" in kernel_name:
            return n
    return None


def gpu_timeline(step, flops_per_product: float, synced: bool, path: Path) -> dict:
    """The middle call's kernels, by a profiler trace of CALLS calls."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            step()
            if synced:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    events = sorted((e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "kernel"),
                    key=lambda e: e["ts"])  # fmt: skip
    path.unlink()
    if len(events) % CALLS:
        raise RuntimeError(f"{len(events)} kernels over {CALLS} calls: not the same kernels in every call")
    per_call = len(events) // CALLS
    call = events[(CALLS // 2) * per_call:(CALLS // 2 + 1) * per_call]
    t0 = call[0]["ts"]
    kernels = []
    for e in call:
        n = _products(e["name"])
        kernels.append({"name": e["name"], "us": e["dur"], "start_us": e["ts"] - t0,
                        "useful_tflops": n * flops_per_product / e["dur"] / 1e6 if n else None})  # fmt: skip
    return {"span_us": call[-1]["ts"] + call[-1]["dur"] - t0, "busy_us": sum(k["us"] for k in kernels),
            "kernels": kernels}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--shapes", nargs="+", default=["GRPO P=2K N=8 R=1K", "GRPO P=8K N=16 R=1K"],
                        choices=list(SHAPES))  # fmt: skip
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    H, D = args.heads, args.head_dim
    Hkv = args.kv_heads or H
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes:
        end = PrefixTree.from_sequences(SHAPES[shape]()).subtree_end.cuda()
        T = end.numel()
        pairs = int((end.cpu() - torch.arange(T)).sum())  # key j is seen by end[j] - j queries
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        k, v = (torch.randn(1, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                for _ in range(2))  # fmt: skip
        do = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        schedule = build_schedule(end, T)

        def step():
            tree_attention(q, k, v, schedule=schedule).backward(do)
            for x in (q, k, v):
                x.grad = None

        row = {"shape": shape, "T": T, "H": H, "Hkv": Hkv, "D": D, "visible_pairs": pairs}
        flops_per_product = 2 * pairs * D * H
        for mode, synced in (("back_to_back", False), ("synced", True)):
            row[mode] = gpu_timeline(step, flops_per_product, synced, out_dir / f"trace_{os.getpid()}.json")
        rows.append(row)
        print(f"\n{shape} (T={T}, H={H}/{Hkv}, D={D}): us, back to back / synced per call; useful TFLOP/s")
        for a, b in zip(row["back_to_back"]["kernels"], row["synced"]["kernels"]):
            tflops = f"{a['useful_tflops']:6.0f} / {b['useful_tflops']:6.0f}" if a["useful_tflops"] else ""
            print(f"  {a['name'][:44]:44s} {a['us']:8.1f} / {b['us']:8.1f}  {tflops}")
        for mode in ("back_to_back", "synced"):
            print(f"  {mode}: span {row[mode]['span_us']:.0f} us, kernels busy {row[mode]['busy_us']:.0f} us")
        del q, k, v, do
    out = write_results(out_dir, f"attention_timeline_h{H}_d{D}.json", rows,
                        "attention_timeline.py: torch.profiler kernel durations of the middle of 5 calls", calls=CALLS)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
