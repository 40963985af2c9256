"""Per-call cost of a tree attention schedule on one GPU: building it, with and without checking the tree.

    python benchmarks/bench_schedule.py [--head-dim 128] [--out DIR]

For each tree of compare_attention.py (bench_attention.py's): ``build_schedule`` plus the block lists
the three kernels read (forward and dQ key-block lists, dK/dV key-block order) at the head dim's
blocks, mean of 20 calls after 3 warm-up calls: host time (until the calls return) and host time
after draining the GPU. Rows: built from a checked tree (``validate=False``: what the library's
own paths and a prebuilt-schedule-per-chunk caller do), and with the tree checked (a new tensor each
call: what ``tree_attention(subtree_end=...)`` costs on its first call with a tensor; later calls with
the same tensor skip the check). Gated on the block lists equalling a dense reference computed with
tensor ops. Then the host cost of one ``tree_attention`` call with a prebuilt schedule, on a tree
so small (384 tokens, Qwen2-0.5B heads) that the GPU waits on the host: mean host time of 300 calls
after warm-up, not synchronised, forward without a graph (a rollout step's layer), forward with one,
forward + backward, and the isolation's two helpers. Writes schedule_build.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import dta_fast.attention as ta
from compare_attention import SHAPES  # the same trees as the kernel A/B
from dta_fast import build_schedule
from dta_ref import PrefixTree, grpo_batch


def build(end, T, validate, head_dim):
    schedule = build_schedule(end, T, validate=validate)
    for kind in ("fwd", "dq", "dkdv"):
        BM, BN = ta.block_table(head_dim)[kind]
        schedule.key_block_order(BM, BN) if kind == "dkdv" else schedule.block_lists(BM, BN)
    return schedule


def reference_rows(end, BM, BN):
    """(full, partly visible) live key blocks per query block from the smallest and largest subtree end
    of each key block (tensor ops)."""
    T = end.numel()
    Nk, Mq = -(-T // BN), -(-T // BM)
    padded = torch.nn.functional.pad(end, (0, Nk * BN - T)).view(Nk, BN)
    q_first = torch.arange(Mq, device=end.device) * BM
    q_last = (q_first + BM).clamp(max=T) - 1
    k_first = torch.arange(Nk, device=end.device) * BN
    live = (k_first[None, :] <= q_last[:, None]) & (padded.amax(1)[None, :] > q_first[:, None])
    full = (k_first[None, :] + BN - 1 <= q_first[:, None]) & (padded.amin(1)[None, :] > q_last[:, None])
    return [
        (torch.nonzero(f)[:, 0].tolist(), torch.nonzero(l & ~f)[:, 0].tolist())
        for l, f in zip(live.cpu(), full.cpu())
    ]


def host_us(fn, calls=300):
    """Mean host microseconds per call, not synchronised (the GPU has idle time on these sizes)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def call_host_cost():
    """Host microseconds of one tree_attention call and of its parts, with a prebuilt schedule."""
    end = PrefixTree.from_sequences(grpo_batch(1, 128, 4, 64)).subtree_end.cuda()
    T = end.numel()

    def rand(heads):
        return torch.randn(1, heads, T, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = rand(14), rand(2), rand(2)
    do = torch.randn_like(q)
    schedule = build_schedule(end, validate=False)
    bad = ta._finite_rows(v.detach())[1]
    with torch.no_grad():
        row = {"forward, no graph": host_us(lambda: ta.tree_attention(q, k, v, schedule=schedule))}
    row["forward"] = host_us(lambda: ta.tree_attention(q, k, v, schedule=schedule))
    row["forward + backward"] = host_us(lambda: ta.tree_attention(q, k, v, schedule=schedule).backward(do))
    row["isolation: finite rows of V"] = host_us(lambda: ta._finite_rows(v.detach()))
    row["isolation: queries seeing a bad row"] = host_us(lambda: ta._queries_seeing(bad, schedule.subtree_end, T))
    for label, us in row.items():
        print(f"tree_attention host cost, T={T}: {label:38s} {us:7.1f} us", flush=True)
    return {"T": T, "heads": [14, 2], "head_dim": 64, "host_us": row}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    rows = []
    for name, make in SHAPES.items():
        end = PrefixTree.from_sequences(make()).subtree_end.cuda()
        T = end.numel()
        row = {"shape": name, "T": T}
        schedule = build(end, T, False, args.head_dim)
        for (BM, BN), lists in schedule._lists.items():
            if lists.rows() != reference_rows(end, BM, BN):
                raise SystemExit(f"{name}: the block lists of blocks {BM}x{BN} differ from the reference")
        for label, validate in [("build", False), ("build + check", True)]:
            ends = [end.clone() for _ in range(23)]  # checking: a tensor not seen before, each call
            for e in ends[:3]:
                build(e, T, validate, args.head_dim)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for e in ends[3:]:
                build(e, T, validate, args.head_dim)
            host = (time.perf_counter() - t0) / 20 * 1e3
            torch.cuda.synchronize()
            drained = (time.perf_counter() - t0) / 20 * 1e3
            row[label] = {"host_ms": host, "host_plus_drain_ms": drained}
            print(f"{name:40s} {label:14s} host {host:6.3f} ms  drained {drained:6.3f} ms", flush=True)
        rows.append(row)
    calls = call_host_cost()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "head_dim": args.head_dim}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "schedule_build.json").write_text(json.dumps({"meta": meta, "rows": rows, "call": calls}, indent=1))


if __name__ == "__main__":
    main()
