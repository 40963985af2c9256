"""Tree attention called eagerly against the same call replayed from a CUDA graph.

    python benchmarks/dev/bench_cuda_graphs.py [--out DIR]

A small call's time is its host's: Python, argument binding, launches. A CUDA graph captured once
replays the same kernels with none of that. Per tree and head shape: the CUDA-event median of single
calls (each followed by a synchronize, after warm-up), forward without autograd (a rollout or
reference-logprob step's layer) and forward + backward, eager and replayed, bf16, the schedule built
once outside. The graph is captured as PyTorch's docs say (warm-up calls on a side stream first) and
gated on the eager call's output and gradients against ``dta_ref.tree_attention`` (bench_attention.py's
gate) and on replaying them bitwise. Writes results/cuda_graphs_<GPU>.json and prints the table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_attention  # noqa: E402
import harness  # noqa: E402
import shapes  # noqa: E402

from dta_fast import build_schedule, tree_attention  # noqa: E402

# chunk-sized trees at Qwen2-0.5B's and Qwen3-1.7B's heads, and the attention table's smallest tree
CASES = [
    shapes.AttentionCase("grpo_p128_n4_r64", "qwen2"),
    shapes.AttentionCase("grpo_p512_n4_r256", "qwen2"),
    shapes.AttentionCase("grpo_p512_n8_r256", "qwen3"),
    shapes.AttentionCase("grpo_p2k_n8_r1k", "h32_d128"),
]


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def bench_case(case: shapes.AttentionCase) -> dict:
    tree, heads = shapes.tree(case.rollouts), shapes.HEADS[case.heads]
    p = bench_attention.problem(case.name, tree, heads)
    q, k, v, do = p.q, p.k, p.v, p.do
    schedule = build_schedule(p.end)
    row = {
        "case": case.name,
        "rollouts": case.rollouts,
        "heads": case.heads,
        "T": tree.num_tokens,
        "Hq": heads.q,
        "Hkv": heads.kv,
        "D": heads.dim,
    }

    def forward():
        with torch.no_grad():
            return tree_attention(q, k, v, schedule=schedule)

    def forward_backward():
        for x in (q, k, v):
            x.grad = None
        out = tree_attention(q, k, v, schedule=schedule)
        out.backward(do)
        return out.detach()

    check = harness.gate(
        "eager",
        bench_attention.run_grads(lambda a, b, c: tree_attention(a, b, c, schedule=schedule), p),
        bench_attention.reference(p),
    )
    row["gate"] = check.as_dict()
    if not check.ok:
        print(f"{case.name}: gate {check}", flush=True)
        return row
    want_out = forward()
    want_grads = [forward_backward()] + [x.grad.clone() for x in (q, k, v)]
    fwd_graph, fwd_out = capture(forward)
    fb_graph, fb_out = capture(forward_backward)
    fwd_graph.replay()
    fb_graph.replay()
    torch.cuda.synchronize()
    got = [fb_out] + [x.grad for x in (q, k, v)]
    if not (torch.equal(fwd_out, want_out) and all(torch.equal(a, b) for a, b in zip(got, want_grads))):
        raise RuntimeError("the replayed graph does not give the eager call's output and gradients")
    row.update(
        fwd_eager_ms=harness.event_median(forward),
        fwd_graph_ms=harness.event_median(fwd_graph.replay),
        fwd_bwd_eager_ms=harness.event_median(forward_backward, [q, k, v]),
    )
    grads = [x.grad for x in (q, k, v)]  # the graph's own buffers: event_median's grad = None would drop them
    row["fwd_bwd_graph_ms"] = harness.event_median(fb_graph.replay)
    for x, grad in zip((q, k, v), grads):
        x.grad = grad
    return row


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    rows = []
    for case in CASES:
        rows.append(bench_case(case))
        print(f"done: {case.name}", flush=True)
    harness.write_results(
        "cuda_graphs",
        rows,
        args.out,
        key=lambda r: (r.get("rollouts"), r.get("heads")),
        harness="CUDA-event medians of single synced calls",
    )
    table = []
    for r in rows:
        cells = [
            f"{r[f'{k}_eager_ms']:.3f} / {r[f'{k}_graph_ms']:.3f} ({r[f'{k}_eager_ms'] / r[f'{k}_graph_ms']:.1f}x)"
            if f"{k}_graph_ms" in r
            else "gate FAILED"
            for k in ("fwd", "fwd_bwd")
        ]
        table.append([r["case"], *cells])
    harness.print_table(
        ["case", "forward", "forward + backward"],
        table,
        title="CUDA-event medians of single calls, ms: eager / replayed from a CUDA graph",
    )


if __name__ == "__main__":
    main()
