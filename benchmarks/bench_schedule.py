"""Per-call cost of a tree attention schedule on one GPU: building it, with and without checking the tree.

    python benchmarks/bench_schedule.py [--head-dim 128] [--out DIR]

For each tree of compare_attention.py (bench_attention.py's): ``build_schedule`` plus the block lists
the three kernels read (forward and dQ key-block lists, dK/dV key-block order) at the head dim's
blocks, mean of 20 calls after 3 warm-up calls: host time (until the calls return) and host time
after draining the GPU. Rows: built from a checked tree (``validate=False``: what the library's
own paths and a prebuilt-schedule-per-chunk caller do), and with the tree checked (a new tensor each
call: what ``tree_attention(subtree_end=...)`` costs on its first call with a tensor; later calls with
the same tensor skip the check). Gated on the block lists equalling a dense reference computed with
tensor ops. Writes schedule_build.json.
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
from dta_ref import PrefixTree


def build(end, T, validate, head_dim):
    schedule = build_schedule(end, T, validate=validate)
    for kind in ("fwd", "dq", "dkdv"):
        BM, BN = ta._blocks(kind, head_dim)
        schedule.key_block_order(BM, BN) if kind == "dkdv" else schedule.block_lists(BM, BN)
    return schedule


def reference_rows(end, BM, BN):
    """Live key blocks per query block from the largest subtree end of each key block (tensor ops)."""
    T = end.numel()
    Nk, Mq = -(-T // BN), -(-T // BM)
    max_end = torch.nn.functional.pad(end, (0, Nk * BN - T)).view(Nk, BN).amax(1)
    q_first = torch.arange(Mq, device=end.device) * BM
    k_first = torch.arange(Nk, device=end.device) * BN
    live = (k_first[None, :] < (q_first + BM).clamp(max=T)[:, None]) & (max_end[None, :] > q_first[:, None])
    return [torch.nonzero(row)[:, 0].tolist() for row in live.cpu()]


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
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "head_dim": args.head_dim}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "schedule_build.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
