"""Tree attention forward+backward against its peers, on one GPU.

    python benchmarks/bench_attention.py [--shapes grpo dualkv agentic qwen2 causal] [--out DIR]
    python benchmarks/bench_attention.py --plot RESULTS.json [--out DIR]   # the table and plot of a run

Methods, each forward + backward:
  tree        dta_fast.tree_attention over the packed tree, its schedule built once outside the timing
              (as FlexAttention's BlockMask is)
  tree_call   the same with the schedule built inside every call (``subtree_end=``)
  flex        FlexAttention (compiled) with the tree mask_mod kv <= q < end[kv] and a prebuilt BlockMask
  sdpa        SDPA's default backend on each sequence alone (the flat computation: what a user gets
              without a tree; cuDNN on H100)
  sdpa_flash  the same forced to SDPA's flash backend
  dense       SDPA with a dense bool T x T mask (small trees only)
and the forward alone of tree and flex (``tree_fwd``, ``flex_fwd``).

Every method is timed twice: triton.testing.do_bench (median) and the
median of CUDA-event timings of single calls after warm-up; the table shows
both. Every row is gated on correctness first: tree's output and gradients
are compared with FlexAttention's in the same run; a red gate reports no
speedup. TFLOP/s count useful work only: 4 flops per visible query-key pair
and head dim forward, 10 backward (14 for forward + backward). do_bench's
repetitions run long enough to meet the GPU's power cap, which lowers the
clock more for some kernels than for others: bench_power.py times full
clock and the cap apart.
"""

from __future__ import annotations

import argparse
import contextlib
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
    "qwen2": [  # Qwen2-0.5B's attention: 14 query heads, 2 K/V heads, head dim 64
        dict(name="GRPO P=2K N=8 R=1K, D=64 GQA 14/2", kind="grpo", P=2048, N=8, R=1024, H=14, Hkv=2, D=64),
        dict(name="GRPO P=8K N=16 R=1K, D=64 GQA 14/2", kind="grpo", P=8192, N=16, R=1024, H=14, Hkv=2, D=64),
        dict(name="agentic 4x4x8, D=64 GQA 14/2", kind="agentic", tasks=4, rollouts=4, turns=8, H=14, Hkv=2, D=64),
    ],
    "causal": [  # one sequence: no tree, so "sdpa" is SDPA's default on the same causal problem (the base kernels)
        dict(name="causal 16K (one sequence)", kind="chain", T=16384, H=32, Hkv=32),
    ],
}
# the other GRPO and the DualKV trees at the Qwen2-0.5B heads, which "qwen2" does not hold
SHAPES["qwen2_rest"] = [dict(s, name=f"{s['name']}, D=64 GQA 14/2", H=14, Hkv=2, D=64)
                        for s in SHAPES["grpo"][2:] + SHAPES["dualkv"]]  # fmt: skip
HEAD_DIM = 128  # unless the shape says otherwise
METHODS = ("tree", "tree_call", "flex", "sdpa", "sdpa_flash", "dense", "tree_fwd", "flex_fwd")
EVENT_REPEATS = 30
DENSE_MAX_T = 36 * 1024


def build_tree(shape) -> PrefixTree:
    if shape["kind"] == "grpo":
        return PrefixTree.from_sequences(grpo_batch(1, shape["P"], shape["N"], shape["R"]))
    if shape["kind"] == "chain":
        return PrefixTree.from_sequences([list(range(shape["T"]))])
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


def write_results(out_dir, name: str, rows: list, harness: str, **meta) -> Path:
    """rows and the run's setting (GPU, torch, Triton, the harness) as out_dir/name, the JSON layout of
    benchmarks/results: {"meta": ..., "rows": ...}."""
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "harness": harness, **meta}  # fmt: skip
    out = Path(out_dir) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return out


def event_times(step, inputs, n: int, sync_each: bool = True) -> list[float]:
    """ms of n calls, a CUDA event pair around each; each call waited for before the next
    (``sync_each``), or all back to back as a trainer runs them."""
    events = []
    for _ in range(n):
        for x in inputs:
            x.grad = None
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        if sync_each:
            stop.synchronize()
        events.append((start, stop))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in events]


def event_median(step, inputs, repeats=EVENT_REPEATS) -> float:
    """Median ms of single calls timed with CUDA events, after three warm-up calls."""
    times = event_times(step, inputs, 3 + repeats)[3:]
    return sorted(times)[len(times) // 2]


def measure(step, inputs):
    """do_bench's median, 20th and 80th percentile ms, the CUDA-event median, and the peak memory (GiB)
    above the inputs."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    ms, lo, hi = do_bench(step, quantiles=[0.5, 0.2, 0.8], grad_to_none=inputs)
    return dict(ms=ms, ms_p20=lo, ms_p80=hi, event_ms=event_median(step, inputs), peak_gib=peak)


def bench_shape(shape, flex_compiled):
    from torch.nn.attention.flex_attention import create_block_mask

    tree = build_tree(shape)
    T, H, Hkv, D = tree.num_tokens, shape["H"], shape["Hkv"], shape.get("D", HEAD_DIM)
    end = tree.subtree_end.cuda()
    pairs = int((tree.subtree_end - torch.arange(T)).sum())  # every key j is seen by end[j] - j queries
    flops = dict(fwd=4 * pairs * D * H, both=14 * pairs * D * H)
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

    def tree_call_fn(a, b, c):
        return tree_attention(a, b, c, subtree_end=end)

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

    def forward_only(fn):
        def step():
            with torch.no_grad():
                fn(q, k, v)

        return step

    results = {}
    results["tree"] = measure(fwd_bwd(tree_fn, (q, k, v), do), [q, k, v])
    results["tree_call"] = measure(fwd_bwd(tree_call_fn, (q, k, v), do), [q, k, v])
    results["flex"] = measure(fwd_bwd(flex_fn, (q, k, v), do), [q, k, v])
    results["tree_fwd"] = measure(forward_only(tree_fn), [])
    results["flex_fwd"] = measure(forward_only(flex_fn), [])

    # each sequence alone: equal-length sequences batched, no sharing; K/V heads repeated for GQA
    lengths = tree.lengths.tolist()
    flat_inputs = []
    for L in sorted(set(lengths)):
        n = lengths.count(L)
        flat_inputs.append((rand(n, H, L, D), rand(n, Hkv, L, D), rand(n, Hkv, L, D),
                            torch.randn(n, H, L, D, device="cuda", dtype=dtype)))  # fmt: skip

    def flat_step(backend=None):  # None: SDPA's own choice, as a user gets it
        def step():
            with torch.nn.attention.sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                for a, b, c, d in flat_inputs:
                    F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=Hkv != H).backward(d)

        return step

    flat_leaves = [x for t in flat_inputs for x in t[:3]]
    results["sdpa"] = measure(flat_step(), flat_leaves)
    try:
        results["sdpa_flash"] = measure(flat_step(torch.nn.attention.SDPBackend.FLASH_ATTENTION), flat_leaves)
    except RuntimeError:  # GQA inputs the flash backend refuses
        pass
    flat_inputs.clear()

    if T <= DENSE_MAX_T:
        dense = (torch.arange(T, device="cuda")[None, :] <= torch.arange(T, device="cuda")[:, None]) & (
            torch.arange(T, device="cuda")[:, None] < end[None, :]
        )

        def dense_fn(a, b, c):
            return F.scaled_dot_product_attention(a, b, c, attn_mask=dense, enable_gqa=Hkv != H)

        results["dense"] = measure(fwd_bwd(dense_fn, (q, k, v), do), [q, k, v])
        del dense

    for method, r in results.items():
        work = flops["fwd" if method.endswith("_fwd") else "both"]
        row[method] = r | dict(tflops=work / r["ms"] / 1e9, event_tflops=work / r["event_ms"] / 1e9)
    if row["gate_ok"]:
        for peer in ("flex", "sdpa", "sdpa_flash", "dense"):
            if peer in row:
                row[f"speedup_vs_{peer}"] = row[peer]["ms"] / row["tree"]["ms"]
                row[f"event_speedup_vs_{peer}"] = row[peer]["event_ms"] / row["tree"]["event_ms"]
        row["fwd_speedup_vs_flex"] = row["flex_fwd"]["ms"] / row["tree_fwd"]["ms"]
    return row


def print_table(rows):
    """ms as do_bench / CUDA-event medians; TF/s from do_bench."""
    cols = ("tree", "tree_call", "flex", "sdpa", "sdpa_flash", "tree_fwd", "flex_fwd")
    print("ms: do_bench median / CUDA-event median; TF/s of useful work from do_bench")
    print(f"{'shape':<36} {'T':>7} {'gate':>5} " + " ".join(f"{m:>15}" for m in cols)
          + f" {'tree TF/s':>9} {'fwd TF/s':>9} {'x flex':>11} {'x sdpa':>11} {'fwd x flex':>10}")  # fmt: skip
    for r in rows:
        cells = [f"{r[m]['ms']:>7.2f}/{r[m]['event_ms']:<7.2f}" if m in r else f"{'-':>15}" for m in cols]
        def x(peer):
            return f"{r[f'speedup_vs_{peer}']:>5.2f}/{r[f'event_speedup_vs_{peer}']:<5.2f}" if f"speedup_vs_{peer}" in r else f"{'-':>11}"
        gate = "ok" if r["gate_ok"] else "FAIL"
        print(f"{r['name']:<36} {r['T']:>7} {gate:>5} " + " ".join(cells)
              + f" {r['tree']['tflops']:>9.0f} {r['tree_fwd']['tflops']:>9.0f} {x('flex')} {x('sdpa')}"
              + f" {r.get('fwd_speedup_vs_flex', float('nan')):>10.2f}")  # fmt: skip


def plot(rows, path, gpu):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    methods = ("tree", "tree_call", "flex", "sdpa", "sdpa_flash")
    width = 0.16
    for i, m in enumerate(methods):
        xs = [j + (i - 2) * width for j in range(len(rows))]
        ax.bar(xs, [r[m]["tflops"] if m in r else 0 for r in rows], width, label=m)
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s of useful tree work (fwd+bwd)")
    ax.set_title(f"Tree attention, {gpu}, bf16 (do_bench medians)")
    ax.set_ylim(0, 1.2 * max(r[m]["tflops"] for r in rows for m in methods if m in r))
    ax.legend(ncol=len(methods), loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--plot", metavar="JSON", help="print the table and draw the plot of an earlier run's JSON")
    args = parser.parse_args()
    if args.plot:
        results = json.loads(Path(args.plot).read_text())
        Path(args.out).mkdir(parents=True, exist_ok=True)
        gpu = results["meta"]["gpu"]
        plot(results["rows"], Path(args.out) / f"attention_{gpu.replace(' ', '_')}.png", gpu)
        print_table(results["rows"])
        return
    from torch.nn.attention.flex_attention import flex_attention

    flex_compiled = torch.compile(flex_attention)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
                harness="bench_attention.py: do_bench medians and CUDA-event medians")  # fmt: skip
    rows = []
    for group in args.shapes:
        for shape in SHAPES[group]:
            rows.append(bench_shape(shape, flex_compiled))
            print(f"done: {shape['name']}", flush=True)
            torch.cuda.empty_cache()
            (out / f"attention_{gpu}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    plot(rows, out / f"attention_{gpu}.png", meta["gpu"])
    print_table(rows)


if __name__ == "__main__":
    main()
