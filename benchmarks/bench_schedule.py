"""Per-call cost of a tree attention schedule on one GPU: building it, with and without checking the tree.

    python benchmarks/bench_schedule.py [--out DIR]

For each tree of compare_attention.py (bench_attention.py's): ``build_schedule`` plus the block lists
the three kernels read (forward and dQ CSR, dK/dV key-block order) at the
head dim 128 blocks, mean of 20 calls after 3 warm-up calls, host time (the
calls return) and host time after draining the GPU. Rows: the block lists
built with one host sync (the pre-sync-free path, forced), without one, and
without one but with ``validate=True`` (what ``tree_attention(subtree_end=...)``
does on every call). Gated on the block lists of both ways being equal.
Writes schedule_build.json.
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


def build(end, T, validate):
    schedule = build_schedule(end, T, validate=validate)
    for kind in ("fwd", "dq", "dkdv"):
        BM, BN = ta._blocks(kind, 128)
        schedule.key_block_order(BM, BN) if kind == "dkdv" else schedule.csr(BM, BN)
    return schedule


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    rows, static_max = [], ta.STATIC_CSR_MAX_PAIRS
    for name, make in SHAPES.items():
        end = PrefixTree.from_sequences(make()).subtree_end.cuda()
        T = end.numel()
        row = {"shape": name, "T": T}
        # gate: the block lists built without a sync are the ones built with one
        lists = {}
        for max_pairs in (0, static_max):
            ta.STATIC_CSR_MAX_PAIRS = max_pairs
            schedule = build(end, T, False)
            lists[max_pairs] = [(ptr, idx[: int(ptr[-1])]) for ptr, idx in schedule._csr.values()]
        if not all(torch.equal(a, b) for x, y in zip(lists[0], lists[static_max]) for a, b in zip(x, y)):
            raise SystemExit(f"{name}: the block lists built without a sync differ from the synced ones")
        for label, max_pairs, validate in [("one sync", 0, False), ("no sync", static_max, False),
                                           ("no sync, validate", static_max, True)]:  # fmt: skip
            ta.STATIC_CSR_MAX_PAIRS = max_pairs
            for _ in range(3):
                build(end, T, validate)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                build(end, T, validate)
            host = (time.perf_counter() - t0) / 20 * 1e3
            torch.cuda.synchronize()
            drained = (time.perf_counter() - t0) / 20 * 1e3
            row[label] = {"host_ms": host, "host_plus_drain_ms": drained}
            print(f"{name:40s} {label:18s} host {host:6.3f} ms  drained {drained:6.3f} ms", flush=True)
        ta.STATIC_CSR_MAX_PAIRS = static_max
        rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "schedule_build.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
