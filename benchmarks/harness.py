"""The one benchmark harness: gate, time, write, plot, print.

- Gate: :func:`gate` compares a configuration's outputs with the reference's (relative L2 per output);
  :func:`measure` refuses to time a configuration whose gate is red (:class:`GateFailed`), so no speed
  figure exists without a green check from the same run.
- Time: :func:`measure` gives ``triton.testing.do_bench``'s median, 20th and 80th percentile (ms) and the
  median of CUDA-event timings of single calls after warm-up (``event_ms``), and the peak memory of a
  call. :func:`measure_per_call` times a steady-state step (schedules, masks, plans built once, outside)
  beside the same step with that work inside each call. :func:`wall_seconds` times host-bound steps.
- Write: :func:`write_results` writes ``{"meta": ..., "rows": [...]}`` to
  ``benchmarks/results/<benchmark>_<GPU>.json`` (``attention_H100.json``): the GPU's full name, torch,
  Triton and the command in ``meta``.
- Plot: :func:`plot_bars` (nothing when matplotlib is missing). Print: :func:`print_table`, last.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # this checkout's dta_ref and dta_fast, whether installed or not
    sys.path.insert(0, str(REPO))
RESULTS = Path(__file__).resolve().parent / "results"
QUANTILES = [0.5, 0.2, 0.8]  # do_bench's median, then the 20th and 80th percentile
EVENT_REPEATS = 30  # single calls timed with CUDA events, after EVENT_WARMUP
EVENT_WARMUP = 3
GATE_TOLERANCE = 2e-2  # relative L2 of each output against the reference


# ---------------------------------------------------------------- the machine


def device_name() -> str:
    """The GPU's name as CUDA gives it, or "CPU"."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def short_name(name: str | None = None, count: int = 1) -> str:
    """ "NVIDIA H100 80GB HBM3" -> "H100", "NVIDIA A100-SXM4-80GB" -> "A100", "CPU" -> "CPU"; ``count``
    GPUs of one host: "H200x4"."""
    name = device_name() if name is None else name
    words = [w for w in re.split(r"[\s\-_]+", name) if w and w not in ("NVIDIA", "GeForce", "Tesla", "Quadro")]
    if not words:
        return "GPU"
    short = words[0] + words[1] if words[0] == "RTX" and len(words) > 1 else words[0]
    return f"{short}x{count}" if count > 1 else short


def environment(**extra) -> dict:
    """What a result depends on besides the code: the GPU, torch, Triton, the command, the date."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(
        gpu=device_name(),
        torch=torch.__version__,
        triton=triton_version,
        command=" ".join(["python", *sys.argv]),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        **extra,
    )


def result_path(benchmark: str, out_dir: str | Path = RESULTS, gpu: str | None = None) -> Path:
    """``out_dir/<benchmark>_<GPU short name>.json``."""
    return Path(out_dir) / f"{benchmark}_{gpu or short_name()}.json"


def write_results(
    benchmark: str, rows: list, out_dir: str | Path = RESULTS, *, key=None, gpu: str | None = None, **meta
) -> Path:
    """``rows`` and :func:`environment` (plus ``meta``) as :func:`result_path`; returns the path.

    With ``key`` (a function of a row), the file keeps one row per key over runs: an earlier run's
    rows whose key no new row has stay (first, in their order), the new rows replace the others; each
    new row records its run (``run``: date and command). Without, the file is this run's alone."""
    path = result_path(benchmark, out_dir, gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    env = environment(**meta)
    if key is not None:
        rows = [dict(row, run=dict(date=env["date"], command=env["command"])) for row in rows]
        if path.exists():
            old_meta, old_rows = read_results(path)
            if old_meta.get("gpu") == env["gpu"]:
                new_keys = {json.dumps(key(row), default=str) for row in rows}
                rows = [r for r in old_rows if json.dumps(key(r), default=str) not in new_keys] + rows
    path.write_text(json.dumps(dict(meta=env, rows=rows), indent=1))
    return path


def read_results(path: str | Path) -> tuple[dict, list]:
    """(meta, rows) of a result file."""
    data = json.loads(Path(path).read_text())
    return data.get("meta", {}), data["rows"]


# ---------------------------------------------------------------- the gate


def _pieces(x) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def relative_error(got, want) -> float:
    """||got - want|| / ||want|| in float32; each a tensor or a list of tensors (pieces of one output,
    compared piece by piece without concatenating them)."""
    diff = norm = 0.0
    for a, b in zip(_pieces(got), _pieces(want), strict=True):
        if a.shape != b.shape:
            return math.inf
        for a_part, b_part in zip(a.reshape(-1).split(1 << 24), b.reshape(-1).split(1 << 24)):
            b_part = b_part.to(a_part.device, torch.float32)
            diff += float((a_part.float() - b_part).square().sum())
            norm += float(b_part.square().sum())
    if math.isnan(diff):
        return math.inf
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-30)


@dataclass
class Gate:
    """A configuration's outputs against the reference's: relative L2 error of each."""

    name: str
    errors: dict[str, float]
    tolerance: float | dict[str, float]  # one for every output, or one per output

    @property
    def ok(self) -> bool:
        return bool(self.errors) and all(e <= self.limit(k) for k, e in self.errors.items())

    def limit(self, output: str) -> float:
        return self.tolerance[output] if isinstance(self.tolerance, Mapping) else self.tolerance

    def as_dict(self) -> dict:
        return dict(ok=self.ok, tolerance=self.tolerance, rel_err=self.errors)

    def __str__(self) -> str:
        errors = ", ".join(f"{k} {v:.1e} (<= {self.limit(k):.0e})" for k, v in self.errors.items())
        return f"{self.name}: {'ok' if self.ok else 'FAILED'} ({errors})"


class GateFailed(RuntimeError):
    pass


def gate(name: str, got: Mapping, want: Mapping, tolerance: float | dict[str, float] = GATE_TOLERANCE) -> Gate:
    """``got[k]`` against ``want[k]`` for every output ``k`` of the reference; a missing output fails."""
    errors = {k: relative_error(got[k], w) if k in got else math.inf for k, w in want.items()}
    return Gate(name, errors, tolerance)


def require(check: Gate) -> None:
    """Raise :class:`GateFailed` unless ``check`` is green."""
    if not isinstance(check, Gate):
        raise TypeError(f"a timing needs the Gate of its configuration, got {type(check).__name__}")
    if not check.ok:
        raise GateFailed(f"no timing for a red gate: {check}")


# ---------------------------------------------------------------- timing


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak() -> None:
    """Start a peak-memory window (nothing on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_allocated_gib() -> float:
    """The peak allocated since :func:`reset_peak`, GiB (0 on the CPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def allocated_bytes() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _clear_grads(inputs) -> None:
    for x in inputs:
        x.grad = None


def bench_ms(step: Callable[[], object], grad_to_none: Sequence[torch.Tensor] = ()) -> dict:
    """``triton.testing.do_bench``'s median, 20th and 80th percentile, ms (gradients reset each call)."""
    from triton.testing import do_bench

    ms, lo, hi = do_bench(step, quantiles=QUANTILES, grad_to_none=list(grad_to_none) or None)
    return dict(ms=ms, ms_p20=lo, ms_p80=hi)


def event_times(step, inputs: Sequence[torch.Tensor] = (), n: int = EVENT_REPEATS, sync_each: bool = True) -> list:
    """ms of ``n`` calls, a CUDA event pair around each, gradients reset before each; each call waited
    for before the next (``sync_each``), or all back to back as a trainer runs them."""
    events = []
    for _ in range(n):
        _clear_grads(inputs)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        if sync_each:
            stop.synchronize()
        events.append((start, stop))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in events]


def median(values: Sequence[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def event_median(step, inputs: Sequence[torch.Tensor] = (), repeats: int = EVENT_REPEATS) -> float:
    """Median ms of single calls timed with CUDA events, after EVENT_WARMUP warm-up calls."""
    return median(event_times(step, inputs, EVENT_WARMUP + repeats)[EVENT_WARMUP:])


def peak_gib(step, inputs: Sequence[torch.Tensor] = ()) -> float:
    """Peak memory of one call above what was allocated before it, GiB (0 on the CPU)."""
    if not torch.cuda.is_available():
        return 0.0
    _clear_grads(inputs)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def measure(step, inputs: Sequence[torch.Tensor] = (), *, gate: Gate) -> dict:
    """do_bench's quantiles, the CUDA-event median and the peak GiB of ``step``, whose configuration
    passed ``gate`` (a red gate raises :class:`GateFailed` before anything runs). ``inputs``: the
    leaves whose gradients are reset before each call."""
    require(gate)
    peak = peak_gib(step, inputs)
    return dict(**bench_ms(step, inputs), event_ms=event_median(step, inputs), peak_gib=peak)


def measure_per_call(
    steady, per_call, inputs: Sequence[torch.Tensor] = (), *, gate: Gate, per_call_gate: Gate | None = None
) -> tuple[dict, dict]:
    """:func:`measure` of the steady-state step (what every call shares, a schedule, a mask, a plan,
    built once outside) and of the same step building it inside each call, with ``overhead_ms`` (and
    ``event_overhead_ms``) over the first. ``per_call_gate``: the second's own gate (default ``gate``)."""
    require(gate)
    require(per_call_gate or gate)
    a, b = measure(steady, inputs, gate=gate), measure(per_call, inputs, gate=per_call_gate or gate)
    b["overhead_ms"] = b["ms"] - a["ms"]
    b["event_overhead_ms"] = b["event_ms"] - a["event_ms"]
    return a, b


def wall_seconds(fn):
    """(seconds, result) of one call, the GPU drained before and after."""
    sync()
    t0 = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - t0, result


class TritonCompiles:
    """Triton's JIT compiles in this process while the context is open: ``count`` and ``seconds`` (a
    kernel's first call at each new specialisation, the autotuner's configs included; a load from
    Triton's disk cache counts too), through ``triton.knobs``' runtime hooks, which it chains to any
    installed before it. Nothing counts where Triton has no such hooks or runs interpreted."""

    def __init__(self):
        self.count, self.seconds, self._started, self._saved = 0, 0.0, [], None

    def __enter__(self) -> TritonCompiles:
        try:
            from triton import knobs

            runtime = knobs.runtime
            self._saved = runtime, runtime.jit_cache_hook, runtime.jit_post_compile_hook
        except (ImportError, AttributeError):  # no Triton, or one older than its knobs
            return self
        _, before, after = self._saved

        def started(**kwargs):
            skip = before(**kwargs) if before else None  # a hook before it may skip the compile
            if not skip:
                self._started.append(time.perf_counter())
            return skip

        def compiled(**kwargs):
            self.count += 1
            self.seconds += time.perf_counter() - self._started.pop()
            return after(**kwargs) if after else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = started, compiled
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            runtime, runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._saved


# ---------------------------------------------------------------- plot and table


def plot_bars(
    path: str | Path,
    labels: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    *,
    ylabel: str,
    title: str,
    horizontal: bool = False,
) -> Path | None:
    """Grouped bars, one group per label and one bar per series (None: no bar); written to ``path``.
    Returns None, drawing nothing, when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    n = max(len(series), 1)
    width = 0.8 / n
    size = (9, 0.35 * len(labels) * n + 1.5) if horizontal else (max(6, 1.1 * len(labels) + 3), 4.5)
    fig, ax = plt.subplots(figsize=size)
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(labels))]
        ys = [0 if v is None else v for v in values]
        (ax.barh if horizontal else ax.bar)(xs, ys, width, label=name)
    if horizontal:
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(ylabel)
    else:
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if len(series) > 1:
        ax.legend(ncol=min(n, 5), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# the runtime calls that launch work on the GPU: kernels, and CUDA graphs (one call replays a whole graph)
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")


def on_gpu(event) -> bool:
    """Whether a torch.profiler entry is a kernel or copy on the GPU: the profiler also charges that time
    to the operator that launched it and to the ranges the code marks, so only these entries add up to
    the GPU's time."""
    return event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation


def gpu_ms_and_launches(averages) -> tuple[float, int]:
    """The GPU time (ms) and the kernel launches of a profile's ``key_averages()``."""
    gpu_ms = sum(e.self_device_time_total for e in averages if on_gpu(e)) / 1e3
    return gpu_ms, sum(e.count for e in averages if e.key in LAUNCHES)


def cell(value, fmt: str = ".2f") -> str:
    """A table cell: "-" for a missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt) if isinstance(value, (int, float)) else str(value)


_NUMERIC = re.compile(r"^[-+]?[\d.,/x%e+\- ()*]*$|^(ok|FAIL|OOM|-)$")


def print_table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> None:
    """Columns as wide as their widest cell: numbers right-aligned, text left-aligned."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows if i < len(r)]) for i, h in enumerate(headers)]
    right = [all(_NUMERIC.match(r[i]) for r in rows if i < len(r) and r[i]) for i in range(len(headers))]

    def line(cells):
        return "  ".join(c.rjust(w) if right[i] else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    if title:
        print(f"\n{title}")
    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
