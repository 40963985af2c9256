"""Where verl's policy update spends its time, and how far two exact float32 updates fall apart.

    python benchmarks/dev/profile_verl.py [--model qwen2-0.5b] [--prompts 4] [--skip-float32]
                                          [--fused-backend torch] [--out DIR]

bench_verl.py's mini-batch and workers (``--fused-backend none``: verl without its fused kernels).
(1) float32 compute: the update of verl's engine with padding removal on, off, and the tree engine's,
each pair's relative L2 distance: how far two exact computations of one update land apart on this GPU,
the floor any exactness gate stands on. (2) bf16, after a warm-up step: one ``train_mini_batch`` of
each engine under torch.profiler, its wall seconds, its kernels' GPU time and the ten operators that
spend the most GPU time. No gate (bench_verl.py gates the same steps). Runs in verl's pinned
environment. Writes results/profile_verl_<GPU>.json and prints the table last.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_verl  # noqa: E402
import harness  # noqa: E402


def profiled(w, td) -> dict:
    """Wall seconds, kernels' GPU ms and the top GPU operators of one profiled ``train_mini_batch``."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    harness.sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        w.train_mini_batch(td.clone())
        harness.sync()
    seconds = time.perf_counter() - start
    averages = prof.key_averages()
    events = sorted((e for e in averages if harness.on_gpu(e)), key=lambda e: e.self_device_time_total, reverse=True)
    top = [dict(name=e.key[:90], gpu_ms=e.self_device_time_total / 1e3, calls=e.count) for e in events[:10]]
    return dict(seconds=seconds, gpu_ms=harness.gpu_ms_and_launches(averages)[0], top=top)


def run(args, fused_backend: str | None, skip_float32: bool, directory: str, **overrides) -> dict:
    """The row of one model (``args``: bench_verl's) from bench_verl's checkpoint, mini-batch and workers."""
    model = args.models[0]
    path = bench_verl.checkpoint(model, os.path.join(directory, model), **overrides)
    with bench_verl.own_forward_kept(path):
        return _row(args, fused_backend, skip_float32, path, overrides)


def _row(args, fused_backend, skip_float32, path, overrides) -> dict:
    model = args.models[0]
    vocab = overrides.get("vocab_size", bench_verl.shapes.MODELS[model].vocab_size)
    td, _, _ = bench_verl.mini_batch(args.prompts, args.group, args.prompt_len, args.response, vocab)
    row = dict(model=model, prompts=args.prompts, group=args.group, verl_fused_backend=fused_backend)
    updates = {}
    for name, (tree, remove_padding) in bench_verl.ENGINES.items() if not skip_float32 else ():
        w = bench_verl.worker(path, tree, args.group, args.prompts, "fp32", remove_padding, fused_backend)
        updates[name] = bench_verl.update(w, td)
        del w
        harness.empty_cache()
    pairs = [] if skip_float32 else [("verl", "verl_padded"), ("tree", "verl"), ("tree", "verl_padded")]
    row["float32_rel_diff"] = {f"{a}~{b}": harness.relative_error(updates[a], updates[b]) for a, b in pairs}
    print(row, flush=True)
    row["bf16"] = {}
    for name, (tree, remove_padding) in bench_verl.ENGINES.items():
        w = bench_verl.worker(path, tree, args.group, args.prompts, "bf16", remove_padding, fused_backend)
        w.train_mini_batch(td.clone())  # warm-up
        row["bf16"][name] = profiled(w, td)
        print(name, row["bf16"][name], flush=True)
        del w
        harness.empty_cache()
    return row


def print_table(row) -> None:
    table = [
        [name, f"{r['seconds']:.2f}", f"{r['gpu_ms']:.0f}", r["top"][0]["name"][:50] if r["top"] else "-"]
        for name, r in row["bf16"].items()
    ]
    harness.print_table(["engine", "step s", "GPU ms", "top GPU operator"], table, title=str(row["float32_rel_diff"]))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2-0.5b", choices=list(bench_verl.shapes.MODELS))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--skip-float32", action="store_true", help="only the profiled bf16 steps")
    p.add_argument("--fused-backend", default="torch", choices=["none", "torch", "triton"], help="verl's fused kernels")
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    mine = parser().parse_args(argv)
    args = bench_verl.parser().parse_args(["--models", mine.model, "--prompts", str(mine.prompts)])
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29574", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(k, v)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as directory:
        row = run(args, None if mine.fused_backend == "none" else mine.fused_backend, mine.skip_float32, directory)
    harness.write_results("profile_verl", [row], mine.out, key=lambda r: (r["model"], r["verl_fused_backend"]))
    print_table(row)


if __name__ == "__main__":
    main()
