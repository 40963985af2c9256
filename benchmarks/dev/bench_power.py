"""Tree attention against FlexAttention at full clock and under the GPU's power cap.

    python benchmarks/dev/bench_power.py [--shapes grpo qwen2 agentic] [--cool 3] [--sustain 3] [--out DIR]

A long run of tensor-core work draws the GPU to its power limit, and the driver then lowers the SM
clock until it holds that limit. How far depends on the kernels: the more of the tensor cores a
kernel keeps busy, the more power each clock costs and the lower the clock it settles at. A short
timing after idle sees full clock; a training run, minutes of work back to back, sees the capped
one. Per shape and method (forward + backward, bf16, the schedule and BlockMask built once outside),
two phases, each after ``--cool`` seconds idle:

  full clock  the median of 10 calls back to back right after the idle (about their first 30 ms
              on the smallest tree), CUDA events around each call
  sustained   calls back to back for ``--sustain`` seconds, then the median of the next 30 (or
              more, to span at least a quarter second)

while ``nvidia-smi`` samples the SM clock, the power drawn and the clock-limit reasons every 20 ms
(the phase's mean and the reasons seen are reported with it; ``power.draw`` is the driver's running
average, so it lags the first phase). Energy per call is the sustained phase's mean power times its
median time. Each method is gated first on its output and gradients against ``dta_ref.tree_attention``
(bench_attention.py's gate). Writes results/power_<GPU>.json and prints the table last.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_attention  # noqa: E402
import harness  # noqa: E402
import shapes  # noqa: E402

FULL_CLOCK_CALLS = 10
SUSTAINED_CALLS = 30
SAMPLE_MS = 20
MIN_WINDOW_S = 0.25  # the sustained timing's least span: a dozen samples
# the driver's clock-limit reasons (NVML's clocksThrottleReasons bits) that this benchmark meets
REASONS = {0x1: "idle", 0x4: "power cap", 0x8: "hw slowdown", 0x20: "sw thermal", 0x40: "hw thermal"}


class Sampler:
    """nvidia-smi's SM clock (MHz), power (W) and clock-limit reasons every SAMPLE_MS, stamped with the
    host's time when read."""

    def __init__(self, device: torch.device):
        # nvidia-smi numbers GPUs its own way (CUDA_VISIBLE_DEVICES does not apply): name this one by UUID
        gpu = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
        query = "clocks.sm,power.draw,clocks_throttle_reasons.active"
        if shutil.which("nvidia-smi") is None:
            raise SystemExit("bench_power.py samples the clock and power with nvidia-smi, which is not on PATH")
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", gpu, f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", str(SAMPLE_MS)],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.samples: list[tuple[float, float, float, int]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                clock, power, reasons = (x.strip() for x in line.split(","))
                self.samples.append((time.time(), float(clock), float(power), int(reasons, 16)))
            except ValueError:  # a header or a "[N/A]"
                continue

    def window(self, start: float, stop: float) -> dict:
        inside = [s for s in self.samples if start <= s[0] <= stop]
        inside = inside or [s for s in self.samples if s[0] >= start][:1]  # a window shorter than a sample
        if not inside:
            return dict(samples=0)
        seen = 0
        for s in inside:
            seen |= s[3]
        return dict(
            samples=len(inside),
            mhz=sum(s[1] for s in inside) / len(inside),
            watts=sum(s[2] for s in inside) / len(inside),
            reasons=[name for bit, name in REASONS.items() if seen & bit],
        )

    def close(self):
        self.proc.terminate()
        self.proc.wait()


def timed_calls(step, inputs, n: int) -> list[float]:
    """ms of n calls back to back, a CUDA event pair around each."""
    return harness.event_times(step, inputs, n, sync_each=False)


def median(xs):
    return sorted(xs)[len(xs) // 2]


def sustained(step, inputs, sampler: Sampler, cool: float, sustain: float) -> dict:
    """After ``cool`` seconds idle, calls back to back for ``sustain`` seconds, then the median of
    SUSTAINED_CALLS more, with the clock and power sampled over those and the energy of a call."""
    torch.cuda.synchronize()
    time.sleep(cool)
    t0 = time.time()
    while time.time() - t0 < sustain:  # the host runs ahead; the synchronize bounds how far
        timed_calls(step, inputs, 5)
    t1 = time.time()
    times = timed_calls(step, inputs, SUSTAINED_CALLS)
    while time.time() - t1 < MIN_WINDOW_S:  # enough samples of a short pass's clock and power
        times += timed_calls(step, inputs, SUSTAINED_CALLS)
    out = dict(ms=median(times), **sampler.window(t1, time.time()))
    if "watts" in out:
        out["mj_per_call"] = out["watts"] * out["ms"]
    return out


def phases(step, inputs, sampler: Sampler, cool: float, sustain: float) -> dict:
    """The full-clock and sustained phases of one method, each after ``cool`` seconds idle."""
    torch.cuda.synchronize()
    time.sleep(cool)
    t0 = time.time()
    times = timed_calls(step, inputs, FULL_CLOCK_CALLS)
    full_clock = dict(ms=median(times), **sampler.window(t0, time.time()))
    return dict(full_clock=full_clock, sustained=sustained(step, inputs, sampler, cool, sustain))


def bench_case(case: shapes.AttentionCase, flex, sampler, cool, sustain) -> dict:
    tree, heads = shapes.tree(case.rollouts), shapes.HEADS[case.heads]
    p = bench_attention.problem(case.name, tree, heads)
    fns = {m: fn for m, fn in bench_attention.tree_methods(p, flex, dense=False).items() if m in ("tree", "flex")}
    ref = bench_attention.reference(p)
    gates = {m: harness.gate(m, bench_attention.run_grads(fn, p), ref) for m, fn in fns.items()}
    del ref
    row = dict(
        name=case.name,
        rollouts=case.rollouts,
        heads=case.heads,
        T=tree.num_tokens,
        H=heads.q,
        Hkv=heads.kv,
        D=heads.dim,
        gate={m: g.as_dict() for m, g in gates.items()},
        gate_ok=gates["tree"].ok,
    )
    for method, fn in fns.items():
        if not gates[method].ok:
            print(f"{case.name}: gate {gates[method]}", flush=True)
            continue
        step = bench_attention.fwd_bwd(fn, p)
        timed_calls(step, p.leaves, 3)  # warm-up: compilation, the autotuner
        row[method] = phases(step, p.leaves, sampler, cool, sustain)
    if "tree" in row and "flex" in row:
        for phase in ("full_clock", "sustained"):
            row[f"x_flex_{phase}"] = row["flex"][phase]["ms"] / row["tree"][phase]["ms"]
    return row


def print_table(rows):
    def cell(r, m, phase, watts=False):
        if m not in r:
            return "-"
        p = r[m][phase]
        text = f"{p['ms']:.3f} ({harness.cell(p.get('mhz'), '.0f')}"
        return text + (f", {harness.cell(p.get('watts'), '.0f')} W)" if watts else ")")

    def energy(r, m):
        return harness.cell(r.get(m, {}).get("sustained", {}).get("mj_per_call"), ".0f")

    table = [
        [
            r["name"],
            "ok" if r["gate_ok"] else "FAIL",
            cell(r, "tree", "full_clock"),
            cell(r, "flex", "full_clock"),
            harness.cell(r.get("x_flex_full_clock")),
            cell(r, "tree", "sustained", True),
            cell(r, "flex", "sustained", True),
            harness.cell(r.get("x_flex_sustained")),
            f"{energy(r, 'tree')}/{energy(r, 'flex')}",
        ]
        for r in rows
    ]
    harness.print_table(
        [
            "case",
            "gate",
            "tree full",
            "flex full",
            "x flex",
            "tree sustained",
            "flex sustained",
            "x flex",
            "mJ tree/flex",
        ],
        table,
        title="ms (mean SM MHz) of forward + backward; sustained: also mean W; x flex = flex ms / tree ms",
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["grpo", "qwen2", "agentic"], choices=list(shapes.ATTENTION))
    p.add_argument("--cool", type=float, default=3.0, help="seconds idle before each phase")
    p.add_argument("--sustain", type=float, default=3.0, help="seconds of calls before the sustained timing")
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    if args.cool < 0 or args.sustain < 0:
        ap.error("--cool and --sustain must be at least 0")
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)
    sampler = Sampler(torch.device("cuda", torch.cuda.current_device()))
    rows = []
    try:
        for group in args.shapes:
            for case in shapes.ATTENTION[group]:
                rows.append(bench_case(case, flex, sampler, args.cool, args.sustain))
                print(f"done: {case.name}", flush=True)
                torch.cuda.empty_cache()
    finally:
        sampler.close()
    harness.write_results(
        "power",
        rows,
        args.out,
        key=lambda r: (r.get("rollouts"), r.get("heads")),
        harness="CUDA-event medians at full clock and sustained, nvidia-smi clock and power",
        cool_s=args.cool,
        sustain_s=args.sustain,
    )
    print_table(rows)


if __name__ == "__main__":
    main()
