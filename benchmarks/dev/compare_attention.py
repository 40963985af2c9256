"""A/B of tree attention implementations: the same trees, inputs and timings for each version.

    git show REV:dta_fast/attention.py > /tmp/attention_rev.py
    python benchmarks/compare_attention.py before=/tmp/attention_rev.py now=dta_fast/attention.py [--out DIR]

Each NAME=PATH is a copy of ``dta_fast/attention.py`` loaded as its own module
(its kernels compile separately); NAME=PATH,HOPPER_PATH also gives it its own
copy of ``dta_fast/attention_hopper.py`` (the Hopper kernels' A/B). Per shape:
forward alone and forward + backward, ``triton.testing.do_bench`` medians and
medians of CUDA-event timings of single calls after warm-up (bench_attention.py's
two timings), bf16, H=32, D=128 (8 K/V heads on the agentic row; ``--heads``,
``--kv-heads``, ``--head-dim`` for another shape), the schedule built once
outside the timing; and the largest difference of each version's output and
gradients from the first version's. The versions are timed in ``--rounds``
rounds that alternate their order (A B, then B A, ...: a drift of the
machine's speed over the run favours none); each time is the mean over
rounds, and the JSON keeps every round. Prints a table and writes
compare_attention_h{H}_d{D}.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from bench_attention import event_median
from dta_ref import PrefixTree, agentic_batch, grpo_batch

SHAPES = {
    "GRPO P=2K N=8 R=1K": lambda: grpo_batch(1, 2048, 8, 1024),
    "GRPO P=8K N=16 R=1K": lambda: grpo_batch(1, 8192, 16, 1024),
    "GRPO P=16K N=16 R=2K": lambda: grpo_batch(1, 16384, 16, 2048),
    "GRPO P=1K N=64 R=512": lambda: grpo_batch(1, 1024, 64, 512),
    "agentic 4 tasks x 4 rollouts x 8 turns": lambda: agentic_batch(num_tasks=4, rollouts_per_task=4, turns=8),
    "causal 16K": lambda: [list(range(16384))],  # one sequence: the tree machinery against a plain causal kernel
}


def load(name: str, path: str, hopper_path: str = ""):
    module = _load_file(f"attention_{name}", path)
    if hopper_path:  # the copy calls its own Hopper kernels
        module.attention_hopper = _load_file(f"attention_hopper_{name}", hopper_path)
    return module


def _load_file(module_name: str, path: str):
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def time_version(module, schedule, q, k, v, do):
    """Forward and forward + backward in ms: do_bench medians, then medians of CUDA-event timings of
    single calls (bench_attention.py's two timings)."""

    def forward():
        with torch.no_grad():
            module.tree_attention(q, k, v, schedule=schedule)

    def forward_backward():
        module.tree_attention(q, k, v, schedule=schedule).backward(do)

    return (do_bench(forward, warmup=25, rep=200), do_bench(forward_backward, warmup=25, rep=200, grad_to_none=[q, k, v]),
            event_median(forward, []), event_median(forward_backward, [q, k, v]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="+",
                        help="NAME=PATH of a copy of dta_fast/attention.py, or NAME=PATH,HOPPER_PATH")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (8 on the agentic row)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=2, help="timing rounds, alternating the versions' order")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    versions = {}
    for item in args.versions:
        name, sep, paths = item.partition("=")
        path, _, hopper_path = paths.partition(",")
        if not sep or not all(Path(p).is_file() for p in filter(None, (path, hopper_path))) or not path:
            parser.error(f"expected NAME=PATH or NAME=PATH,HOPPER_PATH of existing files, got {item!r}")
        versions[name] = load(name, path, hopper_path)

    rows = []
    print("ms: do_bench median / CUDA-event median, each the mean over rounds")
    print(f"{'shape':40s} {'version':14s} {'fwd ms':>15s} {'fwd+bwd ms':>17s} {'max |diff|':>11s}")
    H, D = args.heads, args.head_dim
    for shape in args.shapes:
        end = PrefixTree.from_sequences(SHAPES[shape]()).subtree_end.cuda()
        T = end.numel()
        Hkv = args.kv_heads or (8 if shape.startswith("agentic") and H == 32 else H)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        k, v = (torch.randn(1, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                for _ in range(2))  # fmt: skip
        do = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        row, first = {"shape": shape, "T": T, "H": H, "Hkv": Hkv, "D": D}, None
        schedules = {name: module.build_schedule(end, T) for name, module in versions.items()}
        times = {name: [] for name in versions}
        for r in range(args.rounds):
            for name in list(versions)[:: 1 if r % 2 == 0 else -1]:
                times[name].append(time_version(versions[name], schedules[name], q, k, v, do))
        for name, module in versions.items():
            schedule = schedules[name]
            fwd, fwd_bwd, fwd_event, fwd_bwd_event = (sum(t) / len(t) for t in zip(*times[name]))
            out = module.tree_attention(q, k, v, schedule=schedule)
            grads = torch.autograd.grad(out, (q, k, v), do)
            results = [out.detach().float()] + [x.float() for x in grads]
            first = first or results
            diff = max(float((a - b).abs().max()) for a, b in zip(results, first))
            row[name] = {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "fwd_event_ms": fwd_event, "fwd_bwd_event_ms": fwd_bwd_event,
                         "max_abs_diff": diff, "rounds": times[name]}
            print(f"{shape:40s} {name:14s} {fwd:7.3f}/{fwd_event:7.3f} {fwd_bwd:8.3f}/{fwd_bwd_event:8.3f} {diff:11.2e}",
                  flush=True)
        rows.append(row)
        del q, k, v, do
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "versions": args.versions,
            "rounds": args.rounds}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / f"compare_attention_h{H}_d{D}.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
