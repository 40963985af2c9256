"""Reentrant against non-reentrant checkpointing inside TreeGRPOTrainer, interleaved in one process.

    python benchmarks/dev/checkpoint_ab.py [--groups P1K-G8-R1K P2K-G8-R1K] [--rounds 8] [--out DIR]

A host-bound step's time moves between processes by a quarter or more, so the modes are compared in one
process, round by round: per round, three steps (CUDA events) of each of: checkpointing off, the model's
own non-reentrant checkpointing (``dta_fast.checkpointing.ENABLED`` False), and dta's reentrant form
(True). Medians over the rounds. Writes results/checkpoint_ab_<GPU>.json and prints the table last.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_trl  # noqa: E402
import harness  # noqa: E402
import shapes  # noqa: E402

MODES = ("off", "non_reentrant", "reentrant")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", nargs="+", default=["P1K-G8-R1K", "P2K-G8-R1K"], choices=list(bench_trl.GROUPS))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def ab_row(key, weights, out_dir, rounds) -> dict:
    import dta_fast.checkpointing as checkpointing
    from dta_fast.trl import TreeGRPOConfig, TreeGRPOTrainer

    grpo = shapes.ROLLOUTS[bench_trl.GROUPS[key]]
    P, G, R = grpo.prompt, grpo.responses, grpo.response
    inputs = bench_trl.micro_batch(P, G, R, weights.config.vocab_size)
    trainer = bench_trl.build_trainer(TreeGRPOTrainer, TreeGRPOConfig, weights, G, R, True, out_dir)
    inputs["old_per_token_logps"] = bench_trl.behaviour_logprobs(trainer, inputs)
    model = trainer.model

    def step():
        model.zero_grad(set_to_none=True)
        trainer._compute_loss(model, inputs).backward()

    def mode(name):
        if name == "off":
            model.gradient_checkpointing_disable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpointing.ENABLED = name == "reentrant"

    times = {m: [] for m in MODES}
    for _ in range(rounds + 1):  # the first round warms up
        for m in MODES:
            mode(m)
            times[m].append(harness.median(harness.event_times(step, n=3)))
    checkpointing.ENABLED = True
    return dict(
        group=key, ms={m: harness.median(t[1:]) for m, t in times.items()}, rounds={m: t[1:] for m, t in times.items()}
    )


def main(argv=None):
    args = parser().parse_args(argv)
    weights = shapes.build_model(bench_trl.MODEL)
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for key in args.groups:
            rows.append(ab_row(key, weights, out_dir, args.rounds))
            print(rows[-1], flush=True)
            harness.empty_cache()
    harness.write_results("checkpoint_ab", rows, args.out, key=lambda r: r["group"])
    harness.print_table(
        ["group", *MODES],
        [[r["group"], *(f"{r['ms'][m]:.1f}" for m in MODES)] for r in rows],
        title=f"{harness.device_name()}; TreeGRPOTrainer step ms (median of rounds)",
    )


if __name__ == "__main__":
    main()
