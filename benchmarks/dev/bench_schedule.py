"""Per-call cost of a tree attention schedule on one GPU: building it, with and without checking the tree.

    python benchmarks/dev/bench_schedule.py [--head-dim 128] [--out DIR]

For each tree of bench_attention.py's ``grpo``, ``agentic`` and ``causal`` cases: ``build_schedule`` plus
the block lists the three kernels read (forward and dQ key-block lists, dK/dV key-block order) at the
head dim's blocks, mean of 20 calls after 3 warm-up calls: host time (until the calls return) and host
time after draining the GPU. Rows: built from a checked tree (``validate=False``: what the library's
own paths and a prebuilt-schedule-per-chunk caller do), and with the tree checked (a new tensor each
call: what ``tree_attention(subtree_end=...)`` costs on its first call with a tensor; later calls with
the same tensor skip the check). Gate: the block lists equal a dense reference computed with tensor
ops. Then the host cost of one ``tree_attention`` call with a prebuilt schedule, on a tree so small
(384 tokens, Qwen2-0.5B heads) that the GPU waits on the host: mean host time of 300 calls after
warm-up, not synchronised, forward without a graph (a rollout step's layer), forward with one,
forward + backward, and the isolation's ``queries_seeing`` pass. Writes
results/schedule_build_<GPU>.json and prints the table last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import shapes  # noqa: E402

from dta_fast import build_schedule, tree_attention  # noqa: E402
from dta_fast.attention.function import block_table, queries_seeing  # noqa: E402

ROLLOUTS = list(dict.fromkeys(c.rollouts for g in ("grpo", "agentic", "causal") for c in shapes.ATTENTION[g]))


def build(end, T, validate, head_dim):
    schedule = build_schedule(end, T, validate=validate)
    for kind in ("fwd", "dq", "dkdv"):
        BM, BN = block_table(head_dim)[kind]
        schedule.key_block_order(BM, BN) if kind == "dkdv" else schedule.block_lists(BM, BN)
    return schedule


def lists_gate(schedule, end, head_dim) -> harness.Gate:
    """The forward's and dQ's block lists against :func:`reference_rows`: the share of rows that differ."""
    errors = {}
    for kind in ("fwd", "dq"):
        BM, BN = block_table(head_dim)[kind]
        got, want = schedule.block_lists(BM, BN).rows(), reference_rows(end, BM, BN)
        errors[kind] = sum(a != b for a, b in zip(got, want)) / max(len(want), 1) + (len(got) != len(want))
    return harness.Gate("block lists", errors, 0.0)


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
        (torch.nonzero(f)[:, 0].tolist(), torch.nonzero(l & ~f)[:, 0].tolist()) for l, f in zip(live.cpu(), full.cpu())
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
    case = shapes.AttentionCase("grpo_p128_n4_r64", "qwen2")
    end = shapes.tree(case.rollouts).subtree_end.cuda()
    T, heads = end.numel(), shapes.HEADS[case.heads]

    def rand(n):
        return torch.randn(1, n, T, heads.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = rand(heads.q), rand(heads.kv), rand(heads.kv)
    do = torch.randn_like(q)
    schedule = build_schedule(end, validate=False)
    flags = torch.zeros(1, heads.kv, T, dtype=torch.int8, device="cuda")  # V's non-finite rows: none
    with torch.no_grad():
        row = {"forward, no graph": host_us(lambda: tree_attention(q, k, v, schedule=schedule))}
    row["forward"] = host_us(lambda: tree_attention(q, k, v, schedule=schedule))
    row["forward + backward"] = host_us(lambda: tree_attention(q, k, v, schedule=schedule).backward(do))
    row["isolation: queries seeing a bad row"] = host_us(lambda: queries_seeing(flags, schedule.subtree_end, T))
    return {"shape": f"host cost of a call: {case.name}", "T": T, "host_us": row}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    rows = []
    for key in ROLLOUTS:
        end = shapes.tree(key).subtree_end.cuda()
        T = end.numel()
        row = {"shape": shapes.ROLLOUTS[key].name, "rollouts": key, "T": T, "head_dim": args.head_dim}
        check = lists_gate(build(end, T, False, args.head_dim), end, args.head_dim)
        row["gate"] = check.as_dict()
        rows.append(row)
        if not check.ok:
            print(f"{row['shape']}: gate {check}", flush=True)
            continue
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
    rows.append(call_host_cost())
    harness.write_results(
        "schedule_build", rows, args.out, key=lambda r: (r["shape"], r.get("head_dim")), head_dim=args.head_dim
    )
    table = [
        [
            r["shape"],
            "ok" if r["gate"]["ok"] else "FAIL",
            *(
                f"{r[k]['host_ms']:.3f} / {r[k]['host_plus_drain_ms']:.3f}" if k in r else "-"
                for k in ("build", "build + check")
            ),
        ]
        for r in rows
        if "gate" in r
    ]
    harness.print_table(
        ["tree", "gate", "build, ms host / drained", "build + check"],
        table,
        title=f"schedule build at head dim {args.head_dim}, mean of 20 calls",
    )
    harness.print_table(
        ["tree_attention call, prebuilt schedule", "host us"],
        [[k, f"{v:.1f}"] for k, v in rows[-1]["host_us"].items()],
        title=rows[-1]["shape"],
    )


if __name__ == "__main__":
    main()
