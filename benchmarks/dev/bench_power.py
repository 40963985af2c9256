"""Tree attention against FlexAttention at full clock and under the GPU's power cap.

    python benchmarks/bench_power.py [--shapes grpo qwen2 agentic] [--cool 3] [--sustain 3] [--out DIR]

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
median time. Each row is gated on the tree's output and gradients against FlexAttention's.

With ``--passes``, also each pass of a tree call alone, sustained (its forward with V's finite copy,
the backward's preprocess, dK/dV, K's finite copy, dQ): where a call's energy goes. Prints tables
and writes power.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import threading
import time

import torch

from bench_attention import SHAPES, build_tree, event_times, fwd_bwd, rel_err, run_grads, write_results
from dta_fast import attention, build_schedule, tree_attention

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
            ["nvidia-smi", "-i", gpu, f"--query-gpu={query}", "--format=csv,noheader,nounits",
             "-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
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
        return dict(samples=len(inside), mhz=sum(s[1] for s in inside) / len(inside),
                    watts=sum(s[2] for s in inside) / len(inside),
                    reasons=[name for bit, name in REASONS.items() if seen & bit])  # fmt: skip

    def close(self):
        self.proc.terminate()
        self.proc.wait()


def timed_calls(step, inputs, n: int) -> list[float]:
    """ms of n calls back to back, a CUDA event pair around each."""
    return event_times(step, inputs, n, sync_each=False)


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


def pass_calls(q, k, v, do, schedule) -> dict:
    """The passes of a tree call (``dta_fast.attention._forward`` and ``_backward``'s four) as calls
    without arguments, on inputs made by running each once."""
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        o, lse, v_finite = attention._forward(q, k, v, schedule, scale)
        delta, lse_bwd, do_finite, q_finite = attention._backward_preprocess(o, do, q, lse)
        k_finite = attention._finite_rows(k)[0]
    return {
        "forward": lambda: attention._forward(q, k, v, schedule, scale),
        "preprocess": lambda: attention._backward_preprocess(o, do, q, lse),
        "dkdv": lambda: attention._backward_dkdv(do_finite, q_finite, k, v_finite, lse_bwd, delta, schedule, scale),
        "k_copy": lambda: attention._finite_rows(k),
        "dq": lambda: attention._backward_dq(do, q, k_finite, v_finite, lse_bwd, delta, schedule, scale),
    }


def tree_passes(q, k, v, do, schedule, sampler, cool, sustain) -> dict:
    """Each pass of a tree call alone, sustained."""
    with torch.no_grad():
        return {name: sustained(fn, (), sampler, cool, sustain) for name, fn in pass_calls(q, k, v, do, schedule).items()}


def bench_shape(shape, flex_compiled, sampler, cool, sustain, passes) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask

    tree = build_tree(shape)
    T, H, Hkv, D = tree.num_tokens, shape["H"], shape["Hkv"], shape.get("D", 128)
    end = tree.subtree_end.cuda()
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*s):
        return torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(True)

    q, k, v = rand(1, H, T, D), rand(1, Hkv, T, D), rand(1, Hkv, T, D)
    do = torch.randn(1, H, T, D, generator=g, device="cuda", dtype=torch.bfloat16)
    schedule = build_schedule(end)
    block_mask = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (qi < end[ki]), None, None, T, T, device="cuda")
    fns = {
        "tree": lambda a, b, c: tree_attention(a, b, c, schedule=schedule),
        "flex": lambda a, b, c: flex_compiled(a, b, c, block_mask=block_mask, enable_gqa=Hkv != H),
    }
    ours, theirs = run_grads(fns["tree"], (q, k, v), do), run_grads(fns["flex"], (q, k, v), do)
    errors = {n: rel_err(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs)}
    row = dict(name=shape["name"], T=T, H=H, Hkv=Hkv, D=D, gate_rel_err=errors, gate_ok=max(errors.values()) < 2e-2)
    del ours, theirs
    for method, fn in fns.items():
        step = fwd_bwd(fn, (q, k, v), do)
        timed_calls(step, (q, k, v), 3)  # warm-up: compilation, the autotuner
        row[method] = phases(step, (q, k, v), sampler, cool, sustain)
    if passes:
        row["tree_passes"] = tree_passes(q.detach(), k.detach(), v.detach(), do, schedule, sampler, cool, sustain)
    if row["gate_ok"]:
        for phase in ("full_clock", "sustained"):
            row[f"x_flex_{phase}"] = row["flex"][phase]["ms"] / row["tree"][phase]["ms"]
    return row


def print_table(rows):
    print("ms (mean SM MHz) of forward + backward; sustained: also mean W; x flex = flex ms / tree ms")
    print(f"{'shape':<36} {'gate':>4} {'tree full':>16} {'flex full':>16} {'x flex':>6}"
          f" {'tree sustained':>22} {'flex sustained':>22} {'x flex':>6} {'mJ tree/flex':>13}")  # fmt: skip

    def cell(r, m, phase, watts=False):
        p = r[m][phase]
        text = f"{p['ms']:.3f} ({p.get('mhz', float('nan')):.0f}"
        return text + (f", {p.get('watts', float('nan')):.0f} W)" if watts else ")")

    for r in rows:
        x = [f"{r.get(f'x_flex_{p}', float('nan')):>6.2f}" for p in ("full_clock", "sustained")]
        energy = [r[m]["sustained"].get("mj_per_call", float("nan")) for m in ("tree", "flex")]
        print(f"{r['name']:<36} {'ok' if r['gate_ok'] else 'FAIL':>4} {cell(r, 'tree', 'full_clock'):>16}"
              f" {cell(r, 'flex', 'full_clock'):>16} {x[0]} {cell(r, 'tree', 'sustained', True):>22}"
              f" {cell(r, 'flex', 'sustained', True):>22} {x[1]} {energy[0]:>6.0f}/{energy[1]:<6.0f}")  # fmt: skip


def print_passes(rows):
    print("each pass of a tree call alone, sustained: ms (mean SM MHz, mean W) mJ")
    for r in rows:
        parts = r["tree_passes"]
        total = sum(p.get("mj_per_call", float("nan")) for p in parts.values())
        print(f"{r['name']}: " + "; ".join(
            f"{n} {p['ms']:.3f} ({p.get('mhz', float('nan')):.0f}, {p.get('watts', float('nan')):.0f} W) "
            f"{p.get('mj_per_call', float('nan')):.0f}" for n, p in parts.items()
        ) + f"; sum {total:.0f} mJ against the call's {r['tree']['sustained'].get('mj_per_call', float('nan')):.0f}")  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["grpo", "qwen2", "agentic"], choices=list(SHAPES))
    parser.add_argument("--cool", type=float, default=3.0, help="seconds idle before each phase")
    parser.add_argument("--sustain", type=float, default=3.0, help="seconds of calls before the sustained timing")
    parser.add_argument("--passes", action="store_true", help="also each pass of a tree call alone")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if args.cool < 0 or args.sustain < 0:
        parser.error("--cool and --sustain must be at least 0")
    from torch.nn.attention.flex_attention import flex_attention

    flex_compiled = torch.compile(flex_attention)
    sampler = Sampler(torch.device("cuda", torch.cuda.current_device()))
    rows = []
    try:
        for group in args.shapes:
            for shape in SHAPES[group]:
                rows.append(bench_shape(shape, flex_compiled, sampler, args.cool, args.sustain, args.passes))
                print(f"done: {shape['name']}", flush=True)
                torch.cuda.empty_cache()
    finally:
        sampler.close()
    path = write_results(args.out, "power.json", rows, harness="bench_power.py: CUDA-event medians at full clock "
                         "and sustained, nvidia-smi clock and power", cool_s=args.cool, sustain_s=args.sustain)  # fmt: skip
    print_table(rows)
    if args.passes:
        print_passes(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
