"""What is alive at a tree_backward step's memory peak, next to the estimate (one CUDA GPU).

    python benchmarks/dev/memory_snapshot.py [--models qwen2-0.5b qwen3-1.7b] [--checkpoint] [--out DIR]

For each (model shape, batch, chunk size, mode) below: one warm-up step, then one step from unset
gradients (as ``bench_training.py`` times it) recorded with
``torch.cuda.memory._record_memory_history``. The recorded allocations are replayed to find the
peak; what is alive there is grouped by the Python line that allocated it (allocations made by
autograd's backward thread carry no Python frames: they are named by size, parameter-gradient sized
or head-weight sized). Each row prints the measured peak over the weights, ``estimated_step_bytes``
plus the gradients, their ratio, and the step (``F3``: chunk 3's forward, ``B3``: its close) where
the peak fell. Gate: the recorded step's logprobs and gradients against the warm-up step's (the
same step, so equal to float rounding): a snapshot of a step that went wrong is not reported.
Writes results/memory_snapshot_<GPU>.json (one row per case, earlier runs' other cases kept) and
prints the table last.
"""

import argparse
import collections
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import shapes  # noqa: E402
from bench_training import BATCHES  # noqa: E402

import dta_fast  # noqa: E402
from dta_fast.chunked.engine import ChunkEngine  # noqa: E402
from dta_ref import SFTLoss, adapt  # noqa: E402

CASES = {
    "qwen2-0.5b": [("grpo2k", 2048, True), ("grpo2k", 8192, True), ("grpo2k", 10240, False), ("grpo", 9067, True)],
    "qwen3-1.7b": [("grpo2k", 2048, True), ("grpo2k", 8192, True), ("grpo", 16384, True)],
}
# (batch, chunk size, recompute, checkpointed layers): with --checkpoint
CHECKPOINT_CASES = {
    "qwen2-0.5b": [("grpo2k", 10240, False, True), ("grpo2k", 2048, False, True), ("grpo", 8192, True, True)],
    "qwen3-1.7b": [("grpo2k", 10240, False, True), ("grpo2k", 2048, False, True), ("grpo", 8192, True, True)],
}
MARK_BYTES = 1 << 20


class StepMarks:
    """Marks each forward and close of the engine (``ChunkEngine``) in the allocation trace: a 1 MiB
    allocation made by :meth:`mark`, whose Python frame names it. A context manager: the engine's
    methods are wrapped inside it only."""

    def __init__(self, device="cuda"):
        self.labels, self.device = [], device

    def __enter__(self):
        self.forward, self.close = ChunkEngine.forward, ChunkEngine.close
        forward, close = self.forward, self.close
        ChunkEngine.forward = lambda eng, c: (self.mark(f"F{c}"), forward(eng, c))[1]
        ChunkEngine.close = lambda eng, c, seed: (self.mark(f"B{c}"), close(eng, c, seed))[1]
        return self

    def __exit__(self, *exc):
        ChunkEngine.forward, ChunkEngine.close = self.forward, self.close

    def mark(self, label):
        self.labels.append(label)
        torch.empty(MARK_BYTES, dtype=torch.uint8, device=self.device)  # freed at once


def where(frames, head_bytes, grad_sizes, size):
    own = [
        f for f in frames if any(s in f["filename"] for s in ("dta_fast", "transformers/models", "torch/nn/functional"))
    ]
    if own:
        return " <- ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in own[:2])
    if size == head_bytes:
        return "[backward] head-weight sized"
    if size in grad_sizes:
        return "[backward] parameter-gradient sized"
    return "[backward] other"


def grads_of(model):
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def snapshot(model, marks, batch, size, recompute, checkpoint_layers=False):
    tree = dta_fast.build_tree(shapes.ROLLOUTS[BATCHES[batch]].sequences(model.config.vocab_size))
    loss = SFTLoss(tree.logprob_mask)
    options = dict(max_chunk_tokens=size, recompute=recompute, checkpoint_layers=checkpoint_layers)
    step = lambda: dta_fast.tree_backward(model, tree, loss, **options)[0]  # noqa: E731
    model.zero_grad(set_to_none=True)  # the warm-up's gradients alone: the gate's reference
    want_lp = step()
    want_grads = grads_of(model).cpu()
    model.zero_grad(set_to_none=True)
    gc.collect(), torch.cuda.empty_cache(), torch.cuda.synchronize()
    estimate = dta_fast.estimated_step_bytes(
        model, tree, size, recompute, checkpoint_layers
    )  # gradients unset, as in the step
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    marks.labels.clear()
    torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    got_lp = step()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"]
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated() - base
    check = harness.gate(
        "recorded step",
        dict(logprobs=got_lp, grads=grads_of(model)),
        dict(logprobs=want_lp, grads=want_grads),
        tolerance=1e-3,
    )
    if not check.ok:
        return dict(
            model=model.config.model_type,
            batch=batch,
            chunk_tokens=size,
            recompute=recompute,
            checkpoint_layers=checkpoint_layers,
            gate=check.as_dict(),
        )

    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    head = adapt(model).head.weight
    head_bytes = head.numel() * head.element_size()
    grad_sizes = {p.numel() * p.element_size() for p in model.parameters()}
    live, total, best, at_best, seen, now, peak_at = {}, 0, -1, {}, 0, "start", "start"
    for event in (e for device in trace for e in device):
        frames = event.get("frames", [])
        if event["action"] == "alloc" and any(f["name"] == "mark" for f in frames):
            now, seen = marks.labels[seen], seen + 1
        elif event["action"] == "alloc":
            live[event["addr"]] = (event["size"], where(frames, head_bytes, grad_sizes, event["size"]))
            total += event["size"]
            if total > best:
                best, at_best, peak_at = total, dict(live), now
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    groups = collections.Counter()
    for nbytes, line in at_best.values():
        groups[line] += nbytes
    return dict(
        model=model.config.model_type,
        batch=batch,
        chunk_tokens=size,
        recompute=recompute,
        checkpoint_layers=checkpoint_layers,
        gate=check.as_dict(),
        peak_over_weights_gib=peak / 2**30,
        estimate_with_gradients_gib=(estimate + grads) / 2**30,
        estimate_over_peak=(estimate + grads) / peak,
        peak_at=peak_at,
        alive_at_peak_gib=[(line, nbytes / 2**30) for line, nbytes in groups.most_common(25)],
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--checkpoint", action="store_true", help="the cases with checkpointed layers")
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    rows, table = [], []
    with StepMarks() as marks:
        for name in args.models:
            model = shapes.build_model(name)
            for case in (CHECKPOINT_CASES if args.checkpoint else CASES)[name]:
                row = snapshot(model, marks, *case)
                rows.append(row)
                label = (
                    f"{name} {case[0]} chunks of {case[1]} {'recompute' if case[2] else 'keep'}"
                    f"{', checkpointed layers' if case[3:] and case[3] else ''}"
                )
                if not row["gate"]["ok"]:
                    print(f"{label}: gate FAILED {row['gate']['rel_err']}", flush=True)
                    continue
                table.append(
                    [
                        label,
                        f"{row['peak_over_weights_gib']:.2f}",
                        f"{row['estimate_with_gradients_gib']:.2f}",
                        f"{row['estimate_over_peak']:.3f}",
                        row["peak_at"],
                        "; ".join(f"{gib:.2f} {line}" for line, gib in row["alive_at_peak_gib"][:3]),
                    ]
                )
            del model
            gc.collect(), torch.cuda.empty_cache()
    harness.write_results(
        "memory_snapshot",
        rows,
        args.out,
        key=lambda r: (r["model"], r["batch"], r["chunk_tokens"], r["recompute"], r.get("checkpoint_layers")),
    )
    harness.print_table(
        ["case", "peak GiB over weights", "estimate + gradients", "ratio", "at", "largest alive"], table
    )


if __name__ == "__main__":
    main()
