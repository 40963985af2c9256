"""What is alive at a tree_backward step's memory peak, next to the estimate (one CUDA GPU).

    python benchmarks/memory_snapshot.py [--out DIR]

For each (model shape, batch, chunk size, mode) below: one warm-up step, then one step from unset
gradients (as ``bench_training.py`` times it) recorded with
``torch.cuda.memory._record_memory_history``. The recorded allocations are replayed to find the
peak; what is alive there is grouped by the Python line that allocated it (allocations made by
autograd's backward thread carry no Python frames: they are named by size, parameter-gradient sized
or head-weight sized). Each row prints the measured peak over the weights, ``estimated_step_bytes``
plus the gradients, their ratio, and the step (``F3``: chunk 3's forward, ``B3``: its close) where
the peak fell. Writes memory_snapshot.json.
"""

import argparse
import collections
import gc
import json
import os

import torch

import dta_fast
import dta_fast.engine as engine
from bench_training import BATCHES, build_model
from dta_ref import SFTLoss

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
    """Marks each forward and close of the engine in the allocation trace: a 1 MiB allocation made
    by :meth:`mark`, whose Python frame names it."""

    def __init__(self):
        self.labels = []
        forward, close = engine._Engine.forward, engine._Engine.close
        engine._Engine.forward = lambda eng, c: (self.mark(f"F{c}"), forward(eng, c))[1]
        engine._Engine.close = lambda eng, c, seed: (self.mark(f"B{c}"), close(eng, c, seed))[1]

    def mark(self, label):
        self.labels.append(label)
        torch.empty(MARK_BYTES, dtype=torch.uint8, device="cuda")  # freed at once


def where(frames, head_bytes, grad_sizes, size):
    own = [f for f in frames if any(s in f["filename"] for s in ("dta_fast", "transformers/models", "torch/nn/functional"))]
    if own:
        return " <- ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in own[:2])
    if size == head_bytes:
        return "[backward] head-weight sized"
    if size in grad_sizes:
        return "[backward] parameter-gradient sized"
    return "[backward] other"


def snapshot(model, marks, batch, size, recompute, checkpoint_layers=False):
    tree = dta_fast.build_tree(BATCHES[batch][1]())
    loss = SFTLoss(tree.logprob_mask)
    options = dict(max_chunk_tokens=size, recompute=recompute, checkpoint_layers=checkpoint_layers)
    step = lambda: dta_fast.tree_backward(model, tree, loss, **options)  # noqa: E731
    step()
    model.zero_grad(set_to_none=True)
    gc.collect(), torch.cuda.empty_cache(), torch.cuda.synchronize()
    estimate = engine.estimated_step_bytes(model, tree, size, recompute, checkpoint_layers)  # gradients unset, as in the step
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    marks.labels.clear()
    torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"]
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated() - base

    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    head = engine.adapt(model).head.weight
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
        model=model.config.model_type, batch=batch, chunk_tokens=size, recompute=recompute,
        checkpoint_layers=checkpoint_layers,
        peak_over_weights_gib=peak / 2**30, estimate_with_gradients_gib=(estimate + grads) / 2**30,
        estimate_over_peak=(estimate + grads) / peak, peak_at=peak_at,
        alive_at_peak_gib=[(line, nbytes / 2**30) for line, nbytes in groups.most_common(25)],
    )  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--checkpoint", action="store_true", help="the cases with checkpointed layers")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    marks, rows = StepMarks(), []
    for name in args.models:
        model = build_model(name)
        for case in (CHECKPOINT_CASES if args.checkpoint else CASES)[name]:
            row = snapshot(model, marks, *case)
            rows.append(row)
            print(f"\n{name} {case[0]} chunks of {case[1]} {'recompute' if case[2] else 'keep'}"
                  f"{', checkpointed layers' if case[3:] and case[3] else ''}: peak {row['peak_over_weights_gib']:.2f} GiB "
                  f"over the weights, estimate + gradients {row['estimate_with_gradients_gib']:.2f} ({row['estimate_over_peak']:.3f}x), at {row['peak_at']}")  # fmt: skip
            for line, gib in row["alive_at_peak_gib"][:12]:
                print(f"    {gib:7.3f} GiB  {line}")
        del model
        gc.collect(), torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"memory_snapshot{'_checkpoint' if args.checkpoint else ''}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
