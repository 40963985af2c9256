"""Where one tree attention call's GPU time goes: each kernel's duration and start.

    python benchmarks/dev/attention_timeline.py [--shapes ROLLOUTS ...] [--heads h32_d128]

Forward + backward under ``torch.profiler``, five calls back to back (the host runs ahead, as
in ``do_bench``) and five calls each followed by a synchronize (as in the CUDA-event harness of
bench_attention.py). Per kernel of the middle call: its duration, its start after the call's first
kernel, and for the three attention kernels the useful TFLOP/s it runs at (2, 4 and 3 products per
visible pair for the forward, dK/dV and dQ: ``2 * products * pairs * D * H`` over its duration).
The gap between a synced call's span and its kernels' busy time is the GPU waiting for the host.
bf16, the schedule built once outside the timing. Gate: the call's output and gradients against
``dta_ref.tree_attention`` (bench_attention.py's) before profiling. Writes
results/attention_timeline_<GPU>.json (one row per tree and head layout, earlier runs' other rows kept)
and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_attention  # noqa: E402
import harness  # noqa: E402
import shapes  # noqa: E402

from dta_fast import build_schedule, tree_attention  # noqa: E402

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
    events = sorted(
        (e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"]
    )
    path.unlink()
    if len(events) % CALLS:
        raise RuntimeError(f"{len(events)} kernels over {CALLS} calls: not the same kernels in every call")
    per_call = len(events) // CALLS
    call = events[(CALLS // 2) * per_call : (CALLS // 2 + 1) * per_call]
    t0 = call[0]["ts"]
    kernels = []
    for e in call:
        n = _products(e["name"])
        kernels.append(
            {
                "name": e["name"],
                "us": e["dur"],
                "start_us": e["ts"] - t0,
                "useful_tflops": n * flops_per_product / e["dur"] / 1e6 if n else None,
            }
        )
    return {
        "span_us": call[-1]["ts"] + call[-1]["dur"] - t0,
        "busy_us": sum(k["us"] for k in kernels),
        "kernels": kernels,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shapes",
        nargs="+",
        default=["grpo_p2k_n8_r1k", "grpo_p8k_n16_r1k"],
        choices=list(shapes.ROLLOUTS),
        help="shapes.ROLLOUTS keys",
    )
    p.add_argument("--heads", default="h32_d128", choices=list(shapes.HEADS), help="a shapes.HEADS layout")
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def timeline(key: str, heads_key: str, table: list) -> dict:
    """One tree's row: the gate, then the kernels of a call back to back and synced."""
    heads = shapes.HEADS[heads_key]
    tree = shapes.tree(key)
    name = f"{shapes.ROLLOUTS[key].name}, {heads.name}"
    p = bench_attention.problem(name, tree, heads)
    schedule = build_schedule(p.end)
    fn = lambda q, k, v: tree_attention(q, k, v, schedule=schedule)  # noqa: E731
    check = harness.gate("tree", bench_attention.run_grads(fn, p), bench_attention.reference(p))
    row = {
        "shape": name,
        "rollouts": key,
        "heads": heads_key,
        "T": tree.num_tokens,
        "H": heads.q,
        "Hkv": heads.kv,
        "D": heads.dim,
        "gate": check.as_dict(),
    }
    if not check.ok:
        print(f"{name}: gate {check}: not profiled", flush=True)
        return row
    pairs = int((tree.subtree_end - torch.arange(tree.num_tokens)).sum())  # key j is seen by end[j] - j queries
    row["visible_pairs"] = pairs

    def step():
        fn(p.q, p.k, p.v).backward(p.do)
        for x in p.leaves:
            x.grad = None

    with tempfile.TemporaryDirectory() as tmp:
        for mode, synced in (("back_to_back", False), ("synced", True)):
            row[mode] = gpu_timeline(step, 2 * pairs * heads.dim * heads.q, synced, Path(tmp) / "trace.json")
    for a, b in zip(row["back_to_back"]["kernels"], row["synced"]["kernels"]):
        tflops = f"{a['useful_tflops']:.0f} / {b['useful_tflops']:.0f}" if a["useful_tflops"] else ""
        table.append([name[:40], a["name"][:44], f"{a['us']:.1f} / {b['us']:.1f}", tflops])
    for mode in ("back_to_back", "synced"):
        span, busy = row[mode]["span_us"], row[mode]["busy_us"]
        table.append([name[:40], f"{mode}: span / kernels busy", f"{span:.0f} / {busy:.0f}", ""])
    return row


def main(argv=None):
    args = parser().parse_args(argv)
    table = []
    rows = [timeline(key, args.heads, table) for key in args.shapes]
    harness.write_results(
        "attention_timeline",
        rows,
        args.out,
        key=lambda r: (r.get("rollouts"), r.get("heads")),
        calls=CALLS,
        harness="torch.profiler kernel durations of the middle of 5 calls",
    )
    harness.print_table(["tree", "kernel", "us, back to back / synced", "useful TFLOP/s"], table)


if __name__ == "__main__":
    main()
