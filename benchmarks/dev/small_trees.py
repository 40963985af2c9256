"""Small trees: what one tree attention call costs the host and the GPU, against SDPA on each sequence alone.

    python benchmarks/dev/small_trees.py [--rollouts grpo_p2k_n8_r1k grpo_p1k_n8_r1k] [--heads qwen2] [--out DIR]

A model's layer calls attention once per forward and once per backward, and a small tree's call can
cost more host time than GPU time. Per tree (shapes.ROLLOUTS at shapes.HEADS, bf16), forward +
backward of: ``tree`` (the schedule built once, as a model's forward builds it for all its layers),
``tree_call`` (built inside the call), ``sdpa`` (SDPA's default backend on each sequence alone: no
sharing) and ``per_path`` (each sequence's tokens that no earlier sequence holds as queries, its whole
path's keys gathered, through ``torch.nn.attention.varlen``'s FlashAttention; the per-sequence
computation without its repeated queries). Each method: the CUDA-event median of single synced calls,
``do_bench``'s median (calls back to back: the GPU's time where the host keeps up), and the host time
of a call (20 calls unsynchronised). Gate: every method's output and gradients against
``dta_ref.tree_attention`` in float32 (bench_attention.py's gate). Writes
results/small_trees_<GPU>.json and prints the table last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_attention  # noqa: E402
import harness  # noqa: E402
import shapes  # noqa: E402

HOST_CALLS = 20


def owned_paths(tree) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence holding a token no earlier sequence holds: (those tokens, its whole path), packed
    indices. In preorder the tokens a sequence adds are one contiguous end of its path."""
    seen = torch.zeros(tree.num_tokens, dtype=torch.bool)
    out = []
    for s in range(tree.num_sequences):
        path = tree.seq_index[s, : int(tree.lengths[s])]
        new = ~seen[path]
        if bool(new.any()):
            first = int(new.nonzero()[0])
            out.append((path[first:], path))
            seen[path] = True
    return out


def per_path_attention(tree, heads, device):
    """fn(q, k, v) [1, H, T, D] -> [1, H, T, D]: each owned path through varlen FlashAttention (causal,
    aligned at the path's end), outputs scattered back; autograd's gathers sum the keys' gradients."""
    from torch.nn.attention import varlen

    paths = owned_paths(tree)
    queries = torch.cat([q for q, _ in paths]).to(device)
    keys = torch.cat([k for _, k in paths]).to(device)
    cu_q = torch.tensor([0] + [len(q) for q, _ in paths], device=device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [len(k) for _, k in paths], device=device).cumsum(0).to(torch.int32)
    max_q, max_k = max(len(q) for q, _ in paths), max(len(k) for _, k in paths)
    group = heads.q // heads.kv

    def attend(q, k, v):
        Q = q[0].transpose(0, 1)[queries]  # [Tq, H, D]
        K, V = (x[0].transpose(0, 1)[keys].repeat_interleave(group, 1) for x in (k, v))
        out = varlen.varlen_attn(Q, K, V, cu_q, cu_k, max_q, max_k, window_size=(-1, 0))
        full = out.new_zeros(q.shape[2], heads.q, q.shape[3]).index_copy(0, queries, out)
        return full.transpose(0, 1)[None]

    return attend


def host_ms(step) -> float:
    """Host milliseconds of one call: HOST_CALLS calls without waiting for the GPU."""
    harness.sync()
    t0 = time.perf_counter()
    for _ in range(HOST_CALLS):
        step()
    seconds = time.perf_counter() - t0
    harness.sync()
    return seconds / HOST_CALLS * 1e3


def case(key: str, heads_key: str) -> dict:
    tree, heads = shapes.tree(key), shapes.HEADS[heads_key]
    p = bench_attention.problem(key, tree, heads)
    ref = bench_attention.reference(p)
    fns = bench_attention.tree_methods(p, dense=False)
    row = dict(rollouts=key, heads=heads_key, T=tree.num_tokens, flat_tokens=tree.flat_tokens, methods={})
    try:
        fns["per_path"] = per_path_attention(tree, heads, p.end.device)
    except (ImportError, RuntimeError) as error:  # no varlen FlashAttention in this build
        row["methods"]["per_path"] = dict(error=str(error).splitlines()[0])
    steps = {name: bench_attention.fwd_bwd(fn, p) for name, fn in fns.items()}
    gates = {name: harness.gate(name, bench_attention.run_grads(fn, p), ref) for name, fn in fns.items()}
    groups = bench_attention.flat_groups(p)
    gates["sdpa"] = bench_attention.flat_gate("sdpa", groups, p.gqa, None, ref)
    steps["sdpa"] = bench_attention.flat_step(groups, p.gqa)
    leaves = {name: p.leaves for name in fns} | {"sdpa": [x for g in groups for x in (g.q, g.k, g.v)]}
    for name, step in steps.items():
        entry = dict(gate=gates[name].as_dict())
        if gates[name].ok:
            entry.update(harness.measure(step, leaves[name], gate=gates[name]), host_ms=host_ms(step))
        row["methods"][name] = entry
    return row


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--rollouts", nargs="+", default=["grpo_p2k_n8_r1k", "grpo_p1k_n8_r1k"], choices=list(shapes.ROLLOUTS)
    )
    p.add_argument("--heads", default="qwen2", choices=list(shapes.HEADS))
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    rows = [case(key, args.heads) for key in args.rollouts]
    harness.write_results("small_trees", rows, args.out, key=lambda r: (r["rollouts"], r["heads"]))
    methods = ("tree", "tree_call", "sdpa", "per_path")

    def cell(r, m):
        e = r["methods"].get(m, {})
        return f"{e['event_ms']:.2f} / {e['ms']:.2f} / {e['host_ms']:.2f}" if "ms" in e else "-"

    harness.print_table(
        ["tree", "T", *methods],
        [[r["rollouts"], r["T"], *(cell(r, m) for m in methods)] for r in rows],
        title=f"{harness.device_name()}; {args.heads} heads; ms: single call (events) / do_bench / host",
    )


if __name__ == "__main__":
    main()
