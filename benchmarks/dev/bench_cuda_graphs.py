"""Tree attention called eagerly against the same call replayed from a CUDA graph.

    python benchmarks/bench_cuda_graphs.py [--out DIR]

A small call's time is its host's: Python, argument binding, launches. A CUDA graph captured once
replays the same kernels with none of that. Per tree and head shape: the CUDA-event median of single
calls (each followed by a synchronize, after warm-up), forward without autograd (a rollout or
reference-logprob step's layer) and forward + backward, eager and replayed, bf16, the schedule built
once outside. The graph is captured as PyTorch's docs say (warm-up calls on a side stream first) and
gated on replaying bitwise the eager call's output and gradients. Prints a table and writes
cuda_graphs.json.
"""

from __future__ import annotations

import argparse
import os

import torch

from bench_attention import event_median, write_results
from dta_fast import build_schedule, tree_attention
from dta_ref import PrefixTree, grpo_batch

# (name, prompt, rollouts, response length, query heads, K/V heads, head dim): chunk-sized trees at
# Qwen2-0.5B's and Qwen3-1.7B's heads, and the attention table's smallest tree
CASES = [
    ("384 tokens, 14/2 heads, D=64", 128, 4, 64, 14, 2, 64),
    ("1,536 tokens, 14/2 heads, D=64", 512, 4, 256, 14, 2, 64),
    ("2,560 tokens, 16/8 heads, D=128", 512, 8, 256, 16, 8, 128),
    ("GRPO P=2K N=8 R=1K, 32/32 heads, D=128", 2048, 8, 1024, 32, 32, 128),
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


def bench_case(P, N, R, Hq, Hkv, D) -> dict:
    end = PrefixTree.from_sequences(grpo_batch(1, P, N, R)).subtree_end.cuda()
    T = end.numel()
    schedule = build_schedule(end)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, Hq, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(1, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))  # fmt: skip
    do = torch.randn(1, Hq, T, D, device="cuda", dtype=torch.bfloat16, generator=g)

    def forward():
        with torch.no_grad():
            return tree_attention(q, k, v, schedule=schedule)

    def forward_backward():
        for x in (q, k, v):
            x.grad = None
        out = tree_attention(q, k, v, schedule=schedule)
        out.backward(do)
        return out.detach()

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
    row = {"T": T, "Hq": Hq, "Hkv": Hkv, "D": D,
           "fwd_eager_ms": event_median(forward, []), "fwd_graph_ms": event_median(fwd_graph.replay, []),
           "fwd_bwd_eager_ms": event_median(forward_backward, [q, k, v])}  # fmt: skip
    grads = [x.grad for x in (q, k, v)]  # the graph's own buffers: event_median's grad = None would drop them
    row["fwd_bwd_graph_ms"] = event_median(fb_graph.replay, [])
    for x, grad in zip((q, k, v), grads):
        x.grad = grad
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    rows = []
    print("CUDA-event medians of single calls, ms: eager / replayed from a CUDA graph")
    print(f"{'case':42s} {'forward':>22s} {'forward + backward':>24s}")
    for name, *shape in CASES:
        row = {"case": name, **bench_case(*shape)}
        rows.append(row)
        pairs = [(row[f"{kind}_eager_ms"], row[f"{kind}_graph_ms"]) for kind in ("fwd", "fwd_bwd")]
        cells = [f"{eager:.3f} / {graph:.3f} ({eager / graph:.1f}x)" for eager, graph in pairs]
        print(f"{name:42s} {cells[0]:>22s} {cells[1]:>24s}", flush=True)
    out = write_results(args.out, "cuda_graphs.json", rows,
                        "bench_cuda_graphs.py: CUDA-event medians of single synced calls")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
