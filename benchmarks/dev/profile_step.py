"""Where one training step spends GPU time, per-sequence vs tree, by kernel category.

    python benchmarks/profile_step.py [--model qwen3-1.7b] [--batch agentic] [--chunks 16384] [--keep]

Profiles (torch.profiler) one warmed-up ``tree_backward`` step and the
per-sequence ``flat`` step over about ``--flat-sequences`` rollouts (every
k-th, so all depths are seen), and
sorts every GPU kernel into a category by its name. Each category's time is
shown per unit of its own work (the work of the whole flat batch / of the
tree, FLOPs as in bench_training), so a category that costs the tree more per
unit than it costs per-sequence training is where the step loses against the
FLOP-ideal speedup. Prints a table and writes JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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


def main():
    from bench_training import BATCHES, build_model, flat_and_tree_flops, flat_step

    import dta_fast
    from dta_ref import PrefixTree, SFTLoss

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--batch", default="agentic", choices=list(BATCHES))
    parser.add_argument("--chunks", type=int, default=16384, help="max_chunk_tokens (0: one chunk)")
    parser.add_argument("--keep", action="store_true", help="recompute=False")
    parser.add_argument("--flat-sequences", type=int, default=16)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()

    model = build_model(args.model)
    name, make = BATCHES[args.batch]
    sequences = make()
    tree = PrefixTree.from_sequences(sequences)
    loss_fn = SFTLoss(tree.logprob_mask)
    flat_flops, tree_flops = flat_and_tree_flops(model, tree, sequences)
    few = sequences[:: max(1, len(sequences) // args.flat_sequences)]  # strided: all turn depths
    few_tree = PrefixTree.from_sequences(few)
    few_flops, _ = flat_and_tree_flops(model, few_tree, few)
    few_loss = SFTLoss(few_tree.logprob_mask)
    options = dict(max_chunk_tokens=args.chunks or None, recompute=False if args.keep else None)

    def tree_step():
        model.zero_grad(set_to_none=True)
        dta_fast.tree_backward(model, tree, loss_fn, **options)

    def flat_few():
        model.zero_grad(set_to_none=True)
        flat_step(model, few, few_loss)

    tree_wall, tree_cat, tree_top = profiled(tree_step)
    flat_wall, flat_cat, flat_top = profiled(flat_few)
    scale = flat_flops / few_flops  # the flat step over the whole batch, by work
    print(f"{name}, {args.model}; tree: chunks {args.chunks}, {'keep' if args.keep else 'recompute'}")
    print(f"ideal speedup {flat_flops / tree_flops:.2f}; tree wall {tree_wall:.3f} s (profiled); "
          f"flat wall {flat_wall * scale:.3f} s ({len(few)} sequences x {scale:.1f})")  # fmt: skip
    print(f"{'category':<16} {'tree ms':>9} {'flat ms (scaled)':>17} {'flat/tree':>10}")
    rows = {}
    for label in sorted(set(tree_cat) | set(flat_cat), key=lambda c: -tree_cat.get(c, 0.0)):
        t, f = tree_cat.get(label, 0.0), flat_cat.get(label, 0.0) * scale
        rows[label] = dict(tree_ms=t, flat_ms=f)
        print(f"{label:<16} {t:>9.1f} {f:>17.1f} {f / t if t else float('nan'):>10.2f}")
    busy_t, busy_f = sum(tree_cat.values()), sum(flat_cat.values()) * scale
    print(f"{'GPU busy':<16} {busy_t:>9.1f} {busy_f:>17.1f} {busy_f / busy_t:>10.2f}")
    print("tree, top kernels:")
    for kernel, ms in tree_top:
        print(f"  {ms:9.1f} ms  {kernel}")
    print("flat, top kernels (unscaled):")
    for kernel, ms in flat_top:
        print(f"  {ms:9.1f} ms  {kernel}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(batch=name, model=args.model, options=options, ideal_speedup=flat_flops / tree_flops,
                  tree_wall_s=tree_wall, flat_wall_s_scaled=flat_wall * scale, categories=rows,
                  tree_top=tree_top, flat_top=flat_top, gpu=torch.cuda.get_device_name())  # fmt: skip
    (out / f"profile_{args.batch}_{args.model}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
