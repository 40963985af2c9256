"""Where a decode step's time goes: dta_fast.sample against transformers' generate, host against GPU.

    python benchmarks/dev/profile_rollout.py [--rows 32] [--prompt 64] [--new-tokens 512 128] [--out DIR]

bench_rollout.py's random-weight policy (shapes.MODELS["llama-24m"], bf16, eval), ``--rows`` rows of
one ``--prompt``-token prompt, plain sampling at temperature 1 with no end token, so every row makes
every token. Per method and length, after a warm-up run: wall ms per generated token step (median of
3 runs), how many of a run's decode steps replayed a CUDA graph (``dta_fast.decode``; 0 off CUDA or
where a capture failed), and one run of ``--profiled-steps`` new tokens under torch.profiler: per step, the GPU time of
its kernels, its launches (a CUDA graph's replay counts one), and the host operators that take the most
time. A step whose wall time is far above its GPU time is host-bound: its GPU waits on Python. No gate
(the samplers' draws are tested against dta_ref's in the test suite; bench_rollout.py gates the policy).
Writes results/profile_rollout_<GPU>.json and prints the table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_rollout  # noqa: E402
import harness  # noqa: E402

import dta_fast  # noqa: E402
from dta_fast.decode import DecodeSteps  # noqa: E402


def methods(model, prompts):
    """name -> run(new_tokens): the two samplers on the same rows."""

    def ours(new_tokens):
        generator = torch.Generator(device=model.device).manual_seed(1)
        return dta_fast.sample(model, prompts, new_tokens, generator=generator, progress=False)

    def generate(new_tokens):
        return bench_rollout.hf_generate(model, prompts, new_tokens, seed=1, eos=None)

    return {"dta_fast.sample": ours, "generate": generate}


def replayed_steps(run, steps: int) -> int:
    """How many decode steps of a ``steps``-token run replayed a CUDA graph (dta_fast.decode)."""
    engines, init = [], DecodeSteps.__init__

    def collect(self, *args):
        init(self, *args)
        engines.append(self)

    DecodeSteps.__init__ = collect
    try:
        run(steps)
    finally:
        DecodeSteps.__init__ = init
    return sum(e.replays for e in engines)


def profiled(run, steps: int) -> dict:
    """Per step of a ``steps``-token run under torch.profiler: GPU ms, launches, top host ops."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run(steps)
        harness.sync()
    averages = prof.key_averages()
    gpu_ms, launches = harness.gpu_ms_and_launches(averages)
    host = [e for e in averages if e.device_type == torch.autograd.DeviceType.CPU and e.key not in harness.LAUNCHES]
    host.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    top = [dict(name=e.key[:80], ms_per_step=e.self_cpu_time_total / 1e3 / steps) for e in host[:8]]
    return dict(gpu_ms_per_step=gpu_ms / steps, launches_per_step=launches / steps, top_host=top)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, nargs="+", default=[512, 128])
    p.add_argument("--profiled-steps", type=int, default=32, help="new tokens of the profiled run")
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    device = torch.device(bench_rollout.DEVICE)
    model = bench_rollout.build_model(device, seed=1).to(torch.bfloat16).eval()
    prompt = torch.randint(3, bench_rollout.VOCAB, (args.prompt,), generator=torch.Generator().manual_seed(0))
    prompts = [prompt.tolist()] * args.rows
    rows = []
    for name, run in methods(model, prompts).items():
        run(16)  # warm-up: kernels compiled, allocator sized
        for new_tokens in args.new_tokens:
            run(new_tokens)
            seconds = [harness.wall_seconds(lambda r=run, n=new_tokens: r(n))[0] for _ in range(3)]
            per_step = 1e3 * harness.median(seconds) / new_tokens
            row = dict(method=name, rows=args.rows, prompt=args.prompt, new_tokens=new_tokens, ms_per_step=per_step,
                       replayed_steps=replayed_steps(run, new_tokens) if name == "dta_fast.sample" else None,
                       **profiled(run, args.profiled_steps))  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    key = lambda r: (r["method"], r["rows"], r["prompt"], r["new_tokens"])  # noqa: E731
    harness.write_results("profile_rollout", rows, args.out, key=key)

    def cells(r):
        top = r["top_host"][0]
        return [r["method"], r["new_tokens"], f"{r['ms_per_step']:.2f}", f"{r['gpu_ms_per_step']:.2f}",
                f"{r['launches_per_step']:.0f}", harness.cell(r["replayed_steps"], "d"),
                f"{top['name'][:40]} ({top['ms_per_step']:.2f})"]  # fmt: skip

    harness.print_table(
        [
            "method",
            "new tokens",
            "wall ms/step",
            "GPU ms/step",
            "launches/step",
            "replayed steps",
            "top host op (ms/step)",
        ],  # fmt: skip
        [cells(r) for r in rows],
        title=f"{harness.device_name()}; {args.rows} rows x {args.prompt}-token prompt, plain sampling, bf16",
    )


if __name__ == "__main__":
    main()
