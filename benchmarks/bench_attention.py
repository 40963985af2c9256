"""Tree attention forward+backward against its peers, on one GPU.

    python benchmarks/bench_attention.py [--shapes grpo dualkv agentic] [--out DIR]

Methods, each timed forward + backward with triton.testing.do_bench:
  tree   dta_fast.tree_attention over the packed tree
  flex   FlexAttention (compiled) with the tree mask_mod kv <= q < end[kv]
  sdpa   SDPA flash on each sequence alone (the flat computation)
  dense  SDPA with a dense bool T x T mask (small trees only)
Every row is gated on correctness first: tree's output and gradients are
compared with FlexAttention's in the same run; a red gate reports no speedup.
TFLOP/s count useful work only: 14 * (visible query-key pairs) * D * Hq
(forward 4, backward 10 flops per pair and head dim).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from dta_fast import build_schedule, tree_attention
from dta_ref import PrefixTree, agentic_batch, grpo_batch

SHAPES = {
    "grpo": [
        dict(name="GRPO P=2K N=8 R=1K", kind="grpo", P=2048, N=8, R=1024, H=32, Hkv=32),
        dict(name="GRPO P=8K N=16 R=1K", kind="grpo", P=8192, N=16, R=1024, H=32, Hkv=32),
        dict(name="GRPO P=16K N=16 R=2K", kind="grpo", P=16384, N=16, R=2048, H=32, Hkv=32),
        dict(name="GRPO P=1K N=64 R=512", kind="grpo", P=1024, N=64, R=512, H=32, Hkv=32),
    ],
    "dualkv": [
        dict(name="DualKV N=28 P=4K R=2K", kind="grpo", P=4096, N=28, R=2048, H=32, Hkv=8),
        dict(name="DualKV N=28 P=16K R=2K", kind="grpo", P=16384, N=28, R=2048, H=32, Hkv=8),
        dict(name="DualKV N=16 P=32K R=2K", kind="grpo", P=32768, N=16, R=2048, H=32, Hkv=8),
    ],
    "agentic": [
        dict(name="agentic 4 tasks x 4 rollouts x 8 turns", kind="agentic", tasks=4, rollouts=4, turns=8, H=32, Hkv=8),
    ],
}
D = 128
DENSE_MAX_T = 36 * 1024


def build_tree(shape) -> PrefixTree:
    if shape["kind"] == "grpo":
        return PrefixTree.from_sequences(grpo_batch(1, shape["P"], shape["N"], shape["R"]))
    batch = agentic_batch(num_tasks=shape["tasks"], rollouts_per_task=shape["rollouts"], turns=shape["turns"])
    return PrefixTree.from_sequences(batch)


def fwd_bwd(fn, inputs, do):
    def step():
        out = fn(*inputs)
        out.backward(do)

    return step


def run_grads(fn, inputs, do):
    for x in inputs:
        x.grad = None
    out = fn(*inputs)
    out.backward(do)
    return [out.detach().float(), *(x.grad.float() for x in inputs)]


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def measure(step, inputs):
    """Median, 20th and 80th percentile ms and peak memory (GiB) above the inputs."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    ms = do_bench(step, quantiles=[0.5, 0.2, 0.8], grad_to_none=inputs)
    return ms, peak


def bench_shape(shape, flex_compiled):
    from torch.nn.attention.flex_attention import create_block_mask

    tree = build_tree(shape)
    T, H, Hkv = tree.num_tokens, shape["H"], shape["Hkv"]
    end = tree.subtree_end.cuda()
    pairs = int((tree.subtree_end - torch.arange(T)).sum())  # every key j is seen by end[j] - j queries
    flops = 14 * pairs * D * H
    g = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16

    def rand(*s):
        return torch.randn(*s, generator=g, device="cuda", dtype=dtype).requires_grad_(True)

    q, k, v = rand(1, H, T, D), rand(1, Hkv, T, D), rand(1, Hkv, T, D)
    do = torch.randn(1, H, T, D, generator=g, device="cuda", dtype=dtype)
    row = dict(name=shape["name"], T=T, flat_tokens=tree.flat_tokens, N=tree.num_sequences, H=H, Hkv=Hkv, D=D)

    schedule = build_schedule(end)

    def tree_fn(a, b, c):
        return tree_attention(a, b, c, schedule=schedule)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < end[kv_idx])

    block_mask = create_block_mask(mask_mod, None, None, T, T, device="cuda")

    def flex_fn(a, b, c):
        return flex_compiled(a, b, c, block_mask=block_mask, enable_gqa=Hkv != H)

    # correctness gate: tree vs FlexAttention, outputs and gradients
    ours, theirs = run_grads(tree_fn, (q, k, v), do), run_grads(flex_fn, (q, k, v), do)
    errors = {n: rel_err(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs)}
    row["gate_rel_err"] = errors
    row["gate_ok"] = all(e < 2e-2 for e in errors.values())
    del ours, theirs

    results = {}
    results["tree"] = measure(fwd_bwd(tree_fn, (q, k, v), do), [q, k, v])
    results["flex"] = measure(fwd_bwd(flex_fn, (q, k, v), do), [q, k, v])

    # each sequence alone with flash: equal-length sequences batched, no sharing
    lengths = tree.lengths.tolist()
    flat_inputs = []
    for L in sorted(set(lengths)):
        n = lengths.count(L)
        flat_inputs.append(tuple(rand(n, H, L, D) for _ in range(3)) + (torch.randn(n, H, L, D, device="cuda", dtype=dtype),))

    def flat_step():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            for a, b, c, d in flat_inputs:
                F.scaled_dot_product_attention(a, b, c, is_causal=True).backward(d)

    results["sdpa"] = measure(flat_step, [x for t in flat_inputs for x in t[:3]])
    flat_inputs.clear()

    if T <= DENSE_MAX_T:
        dense = (torch.arange(T, device="cuda")[None, :] <= torch.arange(T, device="cuda")[:, None]) & (
            torch.arange(T, device="cuda")[:, None] < end[None, :]
        )

        def dense_fn(a, b, c):
            return F.scaled_dot_product_attention(a, b, c, attn_mask=dense, enable_gqa=Hkv != H)

        results["dense"] = measure(fwd_bwd(dense_fn, (q, k, v), do), [q, k, v])
        del dense

    for method, ((ms, lo, hi), peak) in results.items():
        row[method] = dict(ms=ms, ms_p20=lo, ms_p80=hi, tflops=flops / ms / 1e9, peak_gib=peak)
    if row["gate_ok"]:
        for peer in ("flex", "sdpa", "dense"):
            if peer in row:
                row[f"speedup_vs_{peer}"] = row[peer]["ms"] / row["tree"]["ms"]
    return row


def print_table(rows):
    header = f"{'shape':<40} {'T':>7} {'flat':>8} {'gate':>5} " + " ".join(
        f"{m + ' ms':>10} {m + ' TF/s':>10}" for m in ("tree", "flex", "sdpa", "dense")
    ) + f" {'x flex':>7} {'x sdpa':>7} {'tree GiB':>9}"
    print(header)
    for r in rows:
        cells = []
        for m in ("tree", "flex", "sdpa", "dense"):
            cells.append(f"{r[m]['ms']:>10.2f} {r[m]['tflops']:>10.0f}" if m in r else f"{'-':>10} {'-':>10}")
        sf = f"{r.get('speedup_vs_flex', float('nan')):>7.2f}"
        ss = f"{r.get('speedup_vs_sdpa', float('nan')):>7.2f}"
        gate = "ok" if r["gate_ok"] else "FAIL"
        print(f"{r['name']:<40} {r['T']:>7} {r['flat_tokens']:>8} {gate:>5} " + " ".join(cells) + f" {sf} {ss} {r['tree']['peak_gib']:>9.2f}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    methods = [m for m in ("tree", "flex", "sdpa", "dense")]
    width = 0.2
    for i, m in enumerate(methods):
        xs = [j + (i - 1.5) * width for j in range(len(rows))]
        ax.bar(xs, [r[m]["tflops"] if m in r else 0 for r in rows], width, label=m)
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s of useful tree work (fwd+bwd)")
    ax.set_title(f"Tree attention, {torch.cuda.get_device_name()}, bf16, D={D}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import flex_attention

    flex_compiled = torch.compile(flex_attention)
    rows = []
    for group in args.shapes:
        for shape in SHAPES[group]:
            rows.append(bench_shape(shape, flex_compiled))
            print(f"done: {shape['name']}", flush=True)
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__)
    (out / f"attention_{gpu}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    plot(rows, out / f"attention_{gpu}.png")
    print_table(rows)


if __name__ == "__main__":
    main()
