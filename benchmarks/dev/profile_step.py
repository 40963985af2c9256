"""Where one training step spends GPU time, per-sequence vs tree, by kernel category.

    python benchmarks/dev/profile_step.py [--model qwen3-1.7b] [--batch agentic] [--chunks 16384] [--keep]

Profiles (torch.profiler) one warmed-up ``tree_backward`` step and the
per-sequence ``flat`` step over about ``--flat-sequences`` rollouts (every
k-th, so all depths are seen), and
sorts every GPU kernel into a category by its name. Each category's time is
shown per unit of its own work (the work of the whole flat batch / of the
tree, FLOPs as in bench_training), so a category that costs the tree more per
unit than it costs per-sequence training is where the step loses against the
FLOP-ideal speedup. Gate: the profiled tree step's gradients against the flat step's on the same
strided sequences (bench_training.py's tolerance), before profiling. Writes
results/profile_step_<GPU>.json (one row per model and batch, earlier runs' other rows kept) and prints
the table last.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import shapes  # noqa: E402

# First match wins; names as CUDA kernels appear in the trace.
CATEGORIES = [
    ("attention", r"tree_attention|flash|fmha|attention"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|sm90_|wgmma|splitK"),
    ("log_softmax", r"softmax|SoftMax|logsumexp"),
    ("gather_scatter", r"gather|scatter|index"),
    ("copy_cat", r"Cat|copy|Copy|memcpy|memset|fill"),
    ("reduce", r"reduce|Reduce|norm"),
    ("elementwise", r"elementwise|vectorized|unrolled|triton_"),
]


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"


def profiled(fn):
    """(wall seconds, {category: GPU ms}, top kernels) of one call of fn after one warm-up."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    by_category, by_kernel = defaultdict(float), defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            ms = event.device_time / 1e3
            by_category[category(event.name)] += ms
            by_kernel[event.name] += ms
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]
    return wall, dict(by_category), [(name[:90], ms) for name, ms in top]


def parser() -> argparse.ArgumentParser:
    from bench_training import BATCHES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b", choices=[m for m in shapes.MODELS if m != "llama-24m"])
    p.add_argument("--batch", default="agentic", choices=list(BATCHES))
    p.add_argument("--chunks", type=int, default=16384, help="max_chunk_tokens (0: one chunk)")
    p.add_argument("--keep", action="store_true", help="recompute=False")
    p.add_argument("--flat-sequences", type=int, default=16)
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def gate(model, few, few_tree, options) -> harness.Gate:
    """tree_backward's gradients on the strided sequences against each sequence alone (flat)."""
    from bench_training import GRAD_TOLERANCE, flat_step, model_grads

    import dta_fast
    from dta_ref import PrefixTree, SFTLoss

    loss = SFTLoss(few_tree.logprob_mask)
    model.zero_grad(set_to_none=True)
    flat_step(model, [PrefixTree.from_sequences([s]).to(next(model.parameters()).device) for s in few], loss)
    want = model_grads(model).cpu()
    model.zero_grad(set_to_none=True)
    dta_fast.tree_backward(model, few_tree, loss, **options)
    got = model_grads(model).cpu()
    model.zero_grad(set_to_none=True)
    return harness.gate("tree step", dict(grad=got), dict(grad=want), GRAD_TOLERANCE)


def main(argv=None):
    from bench_training import BATCHES, batch, flat_and_tree_flops, flat_step

    import dta_fast
    from dta_ref import PrefixTree, SFTLoss

    args = parser().parse_args(argv)
    model = shapes.build_model(args.model)
    name, sequences = batch(args.batch, model.config.vocab_size)
    tree = PrefixTree.from_sequences(sequences)
    loss_fn = SFTLoss(tree.logprob_mask)
    flat_flops, tree_flops = flat_and_tree_flops(model, tree, sequences)
    few = sequences[:: max(1, len(sequences) // args.flat_sequences)]  # strided: all turn depths
    few_tree = PrefixTree.from_sequences(few)
    few_flops, _ = flat_and_tree_flops(model, few_tree, few)
    few_loss = SFTLoss(few_tree.logprob_mask)
    few_chains = [PrefixTree.from_sequences([s]).to(next(model.parameters()).device) for s in few]
    options = dict(max_chunk_tokens=args.chunks or None, recompute=False if args.keep else None)
    check = gate(model, few, few_tree, options)
    row = dict(batch=name, rollouts=BATCHES[args.batch], model=args.model, options=options, gate=check.as_dict())
    if not check.ok:
        harness.write_results("profile_step", [row], args.out, key=lambda r: (r["model"], r["batch"]))
        raise SystemExit(f"gate {check}: not profiled")

    def tree_step():
        model.zero_grad(set_to_none=True)
        dta_fast.tree_backward(model, tree, loss_fn, **options)

    def flat_few():
        model.zero_grad(set_to_none=True)
        flat_step(model, few_chains, few_loss)

    tree_wall, tree_cat, tree_top = profiled(tree_step)
    flat_wall, flat_cat, flat_top = profiled(flat_few)
    scale = flat_flops / few_flops  # the flat step over the whole batch, by work
    rows = {}
    for label in sorted(set(tree_cat) | set(flat_cat), key=lambda c: -tree_cat.get(c, 0.0)):
        rows[label] = dict(tree_ms=tree_cat.get(label, 0.0), flat_ms=flat_cat.get(label, 0.0) * scale)
    row.update(
        ideal_speedup=flat_flops / tree_flops,
        tree_wall_s=tree_wall,
        flat_wall_s_scaled=flat_wall * scale,
        categories=rows,
        tree_top=tree_top,
        flat_top=flat_top,
    )
    harness.write_results("profile_step", [row], args.out, key=lambda r: (r["model"], r["batch"]))
    print("tree, top kernels:")
    for kernel, ms in tree_top:
        print(f"  {ms:9.1f} ms  {kernel}")
    print("flat, top kernels (unscaled):")
    for kernel, ms in flat_top:
        print(f"  {ms:9.1f} ms  {kernel}")
    print(f"\n{name}, {args.model}; tree: chunks {args.chunks}, {'keep' if args.keep else 'recompute'}")
    print(
        f"ideal speedup {flat_flops / tree_flops:.2f}; tree wall {tree_wall:.3f} s (profiled); "
        f"flat wall {flat_wall * scale:.3f} s ({len(few)} sequences x {scale:.1f})"
    )
    busy_t, busy_f = sum(tree_cat.values()), sum(flat_cat.values()) * scale
    table = [
        [
            label,
            f"{r['tree_ms']:.1f}",
            f"{r['flat_ms']:.1f}",
            harness.cell(r["flat_ms"] / r["tree_ms"] if r["tree_ms"] else None),
        ]
        for label, r in rows.items()
    ] + [["GPU busy", f"{busy_t:.1f}", f"{busy_f:.1f}", f"{busy_f / busy_t:.2f}"]]
    harness.print_table(["category", "tree ms", "flat ms (scaled)", "flat/tree"], table)


if __name__ == "__main__":
    main()
