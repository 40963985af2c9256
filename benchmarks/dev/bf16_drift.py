"""How far bfloat16 drifts from the float32 truth, each sequence alone and on the tree (CPU).

    python benchmarks/dev/bf16_drift.py [--layers 8]

The training benchmark's gate compares the tree with each sequence alone, both in bfloat16. On a
random-weight MoE model each token's top-k experts sit close together, so bfloat16 rounding flips
some routes, and a flip changes that token's output outright; with a linear-attention recurrence
carrying the change along the path, two bfloat16 runs of the same sequences can end far apart. This
probe measures it on smaller models of the benchmark's families (Qwen3-Next with 64 experts, top 8;
the same with dense MLPs; Qwen3.5's dense hybrid), one GRPO group of 1K-token prompts and 4 x 512
completions: each method's largest logprob error and relative gradient error against each sequence
alone in float32. Writes results/bf16_drift_CPU.json and prints the table.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import shapes  # noqa: E402

import dta_fast  # noqa: E402
import dta_ref  # noqa: E402
from dta_ref import PrefixTree  # noqa: E402

MOE = dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=128, shared_expert_intermediate_size=128)
FAMILIES = {
    "qwen3-next, 64 experts": ("qwen3_next", MOE),
    "qwen3-next, dense MLPs": ("qwen3_next", dict(MOE, mlp_only_layers="all")),
    "qwen3.5 (dense)": ("qwen3_5_text", {}),
}
METHODS = {  # label -> (dtype, attn_implementation, on the tree)
    "each alone, float32, sdpa": (torch.float32, "sdpa", False),
    "tree, float32": (torch.float32, "sdpa", True),
    "each alone, bfloat16, sdpa": (torch.bfloat16, "sdpa", False),
    "each alone, bfloat16, eager": (torch.bfloat16, "eager", False),
    "tree, bfloat16": (torch.bfloat16, "sdpa", True),
}


def shape(family: str, extra: dict, layers: int) -> shapes.ModelShape:
    extra = {k: (list(range(layers)) if v == "all" else v) for k, v in extra.items()}
    linear = dict(linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    return shapes.ModelShape(
        family, 512, 1024, layers, 8, 2, 64, 4096, tie_word_embeddings=False,
        extra=dict(layer_types=layer_types, **linear, **extra),
    )  # fmt: skip


def run(model_shape: shapes.ModelShape, sequences) -> dict:
    tree = PrefixTree.from_sequences(sequences)
    weights = torch.randn(tree.logprob_mask.shape, generator=torch.Generator().manual_seed(0)) * tree.logprob_mask
    results = {}
    for label, (dtype, impl, on_tree) in METHODS.items():
        model = model_shape.build("cpu", dtype=dtype, attn_implementation=impl)  # the same weights every time
        lp = dta_fast.tree_logprobs(model, tree) if on_tree else dta_ref.flat_logprobs(model, sequences)
        (lp.float() * weights).sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        results[label] = (lp.detach().float(), grads)
    truth_lp, truth_grads = results["each alone, float32, sdpa"]
    return {
        label: dict(
            logprob_max_abs=float((lp - truth_lp).abs().max()),
            grad_rel_err=float((g - truth_grads).norm() / truth_grads.norm()),
        )
        for label, (lp, g) in results.items()
        if label != "each alone, float32, sdpa"
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="a multiple of 4 (three linear layers to one attention)")
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.layers < 4 or args.layers % 4:
        p.error("--layers must be a positive multiple of 4")
    sequences = dta_ref.grpo_batch(
        num_groups=1, prompt_len=1024, num_responses=4, response_len=512, vocab_size=4096, seed=1
    )  # fmt: skip
    rows = []
    for name, (family, extra) in FAMILIES.items():
        for label, errors in run(shape(family, extra, args.layers), sequences).items():
            rows.append(dict(model=name, layers=args.layers, method=label, **errors))
            print(f"{name}: {label} {errors}", flush=True)
    harness.write_results("bf16_drift", rows, args.out, gpu="CPU", key=lambda r: (r["model"], r["layers"], r["method"]))
    harness.print_table(
        ["model", "method", "logprob max abs", "gradient rel. error"],
        [[r["model"], r["method"], f"{r['logprob_max_abs']:.1e}", f"{r['grad_rel_err']:.1e}"] for r in rows],
        title="distance from each sequence alone in float32",
    )


if __name__ == "__main__":
    main()
