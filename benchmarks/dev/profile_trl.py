"""Where a TRL step's time goes: host (Python, launches) against GPU, GRPOTrainer and TreeGRPOTrainer.

    python benchmarks/dev/profile_trl.py [--groups P1K-G8-R1K P2K-G8-R1K] [--trainers ...] [--reentrant] [--out DIR]

bench_trl.py's micro-batches and trainers (the Qwen2-0.5B shape, bf16), gradient checkpointing off and
on. Per trainer and mode, after two warm-up steps: the step's CUDA-event time (median of 5), the host
time of one step (until ``backward`` returns, unsynchronised) beside its wall time (synchronised), and
one step under torch.profiler: the GPU time of its kernels, its kernel launches, the host time of the
tree attention's forward and backward, and the ops of most host time. A step whose host time is its
wall time is host-bound: its GPU waits on Python. No gate (bench_trl.py gates the same steps). Writes
results/profile_trl_<GPU>.json and prints the table last.
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

import bench_trl  # noqa: E402
import harness  # noqa: E402
import shapes  # noqa: E402

TOP_OPS = 12  # the ops of most host time (self, under the profiler) recorded per step


def profiled_step(step) -> dict:
    """GPU ms, kernel launches and the tree attention Function's host ms of one profiled ``step``."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    gpu_ms, launches = harness.gpu_ms_and_launches(averages)
    functions = ("TreeAttentionFunction", "TreeAttentionFunctionBackward")
    attention = {e.key: e.cpu_time_total / 1e3 for e in averages if e.key in functions}
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPS]
    return dict(
        gpu_ms=gpu_ms, launches=launches, tree_attention_host_ms=attention,
        top_host_ms={e.key: round(e.self_cpu_time_total / 1e3, 2) for e in top},
    )  # fmt: skip


def measure(trainer, inputs) -> dict:
    model = trainer.model

    def step():
        model.zero_grad(set_to_none=True)
        trainer._compute_loss(model, inputs).backward()

    for _ in range(2):
        step()
    times = harness.event_times(step, n=5)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return dict(event_ms=harness.median(times), host_ms=host * 1e3, wall_ms=wall * 1e3, **profiled_step(step))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", nargs="+", default=["P1K-G8-R1K", "P2K-G8-R1K"], choices=list(bench_trl.GROUPS))
    p.add_argument("--trainers", nargs="+", default=["GRPOTrainer", "TreeGRPOTrainer"])
    p.add_argument("--reentrant", action="store_true", help="checkpoint with use_reentrant=True (bench_trl.py's)")
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    from trl import GRPOConfig, GRPOTrainer

    from dta_fast.trl import TreeGRPOConfig, TreeGRPOTrainer

    args = parser().parse_args(argv)
    weights = shapes.build_model(bench_trl.MODEL)
    state = {k: v.clone() for k, v in weights.state_dict().items()}
    trainers = (("GRPOTrainer", GRPOTrainer, GRPOConfig), ("TreeGRPOTrainer", TreeGRPOTrainer, TreeGRPOConfig))
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for key in args.groups:
            grpo = shapes.ROLLOUTS[bench_trl.GROUPS[key]]
            P, G, R = grpo.prompt, grpo.responses, grpo.response
            inputs = bench_trl.micro_batch(P, G, R, weights.config.vocab_size)
            for checkpointing in (False, True):
                for name, trainer_cls, config_cls in trainers:
                    if name not in args.trainers:
                        continue
                    weights.load_state_dict(state)
                    trainer = bench_trl.build_trainer(
                        trainer_cls, config_cls, weights, G, R, checkpointing, out_dir, reentrant=args.reentrant
                    )  # fmt: skip
                    if "old_per_token_logps" not in inputs:
                        inputs["old_per_token_logps"] = bench_trl.behaviour_logprobs(trainer, inputs)
                    row = dict(group=key, checkpointing=checkpointing, trainer=name, **measure(trainer, inputs))
                    print(row, flush=True)
                    rows.append(row)
                    del trainer
                    harness.empty_cache()
    harness.write_results("profile_trl", rows, args.out, key=lambda r: (r["group"], r["checkpointing"], r["trainer"]))
    harness.print_table(
        ["group", "ckpt", "trainer", "step ms", "host ms", "wall ms", "GPU ms", "launches", "tree attention host ms"],
        [
            [
                r["group"],
                r["checkpointing"],
                r["trainer"],
                f"{r['event_ms']:.1f}",
                f"{r['host_ms']:.1f}",
                f"{r['wall_ms']:.1f}",
                f"{r['gpu_ms']:.1f}",
                r["launches"],
                " / ".join(f"{v:.1f}" for v in r["tree_attention_host_ms"].values()) or "-",
            ]
            for r in rows
        ],  # fmt: skip
        title=f"{harness.device_name()}; one _compute_loss + backward per micro-batch",
    )


if __name__ == "__main__":
    main()
