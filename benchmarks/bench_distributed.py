"""Step time of distributed_tree_backward on 1, 2 and 4 GPUs (NCCL), and what the balancer buys.

    python benchmarks/bench_distributed.py [--gpus 1 2 4] [--batches agentic grpo] [--tasks 16] [--chunks 8192]

One process per GPU, spawned here for each world size (each with its share
of the host's CPU threads, as launchers set it, so that a rank's host work
does not contend with the other ranks' for every core), trains the same
model (a Qwen2-0.5B shape with random weights, bfloat16) on the same batch
(sequences shuffled, as a sampler delivers them) with
``dta_fast.distributed_tree_backward``; the loss is the token-mean SFT loss.
Plans compared at each world size:

  balanced      dta_fast.partition with the cost model of this model shape (the best candidate)
  tree_tokens   the same pieces placed longest first by unique tokens only (LPT, pairs ignored)
  token_greedy  tree-unaware: single sequences longest first onto the rank with the fewest tokens

For each plan: the step time (median of --repeats after a warm-up, all
ranks, with the gradient all-reduce; the plan is made before the step, as a
data loader can, and its time is reported apart), each rank's compute time
(its shard's ``tree_backward`` alone, no collectives) and their max/mean
(measured balance), the predicted max/mean, each shard's unique tokens, and
what the step adds around the compute: each rank's time to build its shard's
tree and the time of the gradient all-reduce alone. Scaling efficiency is
T(1 GPU) / (W x T(W GPUs)) with the balanced plan. Gate, before a plan is timed:
the gradients of its step against the 1-GPU step's (the whole batch's
``tree_backward``, run first), 5% relative L2 in bf16; a plan whose gate is
red is not timed. Writes results/distributed_<GPU>x<W>.json (W: the largest
world size run), keeping the rows of earlier runs with other batches, world
sizes or plans, and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import shapes  # noqa: E402

BATCHES = ("agentic", "grpo")  # agentic: shapes.agentic(--tasks); grpo: shapes.ROLLOUTS["grpo_mixed_16"]
PLANS = ("balanced", "tree_tokens", "token_greedy")
MODEL = "qwen2-0.5b"
GRAD_TOLERANCE = 5e-2


def rollouts(key, tasks=16):
    return shapes.agentic(tasks) if key == "agentic" else shapes.ROLLOUTS["grpo_mixed_16"]


def make_batch(key, tasks=16, vocab_size=shapes.MODELS[MODEL].vocab_size):
    """The batch's sequences, shuffled as a sampler delivers them."""
    sequences = rollouts(key, tasks).sequences(vocab_size)
    random.Random(0).shuffle(sequences)
    return sequences


def cost_model(model):
    from dta_fast import CostModel

    cfg = model.config
    dense = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    matmul_params = dense + cfg.hidden_size * cfg.vocab_size  # the output head, tied or not
    return CostModel.for_model(matmul_params, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim)


def plan_for(name, sequences, world, costs):
    from dta_fast import CostModel, partition

    if name == "balanced":
        return partition(sequences, world, costs)
    if name == "tree_tokens":
        return partition(sequences, world, CostModel(token=1.0, pair=0.0), method="lpt")
    return partition(sequences, world, costs, method="token_greedy")


def timed(fn):
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def grads_of(model):
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]).cpu()


def worker(rank, world, init_file, args, result_file, reference_file=None):
    """One rank of one world size: every batch and plan, each gated, then timed. The 1-GPU run saves
    its gradients (``result_file``'s .grads.pt) as the reference of the larger ones."""
    from dta_ref import PrefixTree, SFTLoss

    torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # each rank its share of the host, as launchers do
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = shapes.build_model(MODEL)
        costs = cost_model(model)
        options = dict(max_chunk_tokens=args.chunks or None, recompute=False if args.keep else None)
        references = torch.load(reference_file) if reference_file and rank == 0 else {}
        rows, saved = [], {}
        for key in args.batches:
            sequences = make_batch(key, args.tasks)
            loss_fn = SFTLoss(PrefixTree.from_sequences(sequences).logprob_mask)
            for name in args.plans if world > 1 else ("balanced",):
                t0 = time.perf_counter()
                plan = plan_for(name, sequences, world, costs)
                row = dict(
                    batch=rollouts(key, args.tasks).name,
                    world_size=world,
                    plan=name,
                    method=plan.method,
                    predicted_balance=plan.balance,
                    unique_tokens=plan.unique_tokens,
                    flat_tokens=plan.flat_tokens,
                    plan_seconds=time.perf_counter() - t0,
                )
                rows.append(row)
                measure_plan(
                    row, model, sequences, loss_fn, plan, options, args.repeats, references.get(row["batch"]), saved
                )
        if rank == 0:
            Path(result_file).write_text(json.dumps(rows))
            if saved:
                torch.save(saved, Path(result_file).with_suffix(".grads.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_plan(row, model, sequences, loss_fn, plan, options, repeats, reference, saved) -> None:
    """Gate one plan's step (its gradients against ``reference``, the 1-GPU step's; at one GPU they are
    saved as the reference), then time it, its ranks' compute alone, their trees and the all-reduce."""
    import dta_fast
    from dta_ref import PrefixTree, SFTLoss

    rank, world = dist.get_rank(), dist.get_world_size()
    label = f"W={world} {row['batch'][:24]} {row['plan']}"

    def step():
        model.zero_grad(set_to_none=True)
        dta_fast.distributed_tree_backward(model, sequences, loss_fn, plan=plan.shards, **options)

    timed(step)  # warm-up, and the gradients of the gate
    gate = [None]
    if rank == 0 and world == 1:
        saved[row["batch"]] = grads_of(model)
    elif rank == 0 and reference is not None:
        errors = dict(grad=harness.relative_error(grads_of(model), reference))
        gate[0] = harness.Gate(label, errors, GRAD_TOLERANCE).as_dict()
    dist.broadcast_object_list(gate, src=0)
    row["gate"] = gate[0]
    if gate[0] is not None and not gate[0]["ok"]:  # no timing for a red gate
        if rank == 0:
            print(f"{label}: gate FAILED {gate[0]['rel_err']}", flush=True)
        return
    times = [timed(step) for _ in range(repeats)]
    shard = [sequences[i] for i in plan.shards[rank]]
    tree = PrefixTree.from_sequences(shard)
    local = SFTLoss(tree.logprob_mask)

    def compute():  # this rank's work alone (its loss normalised by itself: the same work)
        model.zero_grad(set_to_none=True)
        dta_fast.tree_backward(model, tree, local, **options)

    compute_seconds = timed(compute)
    t0 = time.perf_counter()
    dta_fast.build_tree(shard)
    tree_seconds = time.perf_counter() - t0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    reduce_seconds = timed(lambda: [dist.all_reduce(g) for g in grads])
    gathered = [None] * world
    dist.all_gather_object(gathered, (compute_seconds, tree_seconds))
    compute_all, tree_all = [c for c, _ in gathered], [t for _, t in gathered]
    row.update(
        step_seconds=harness.median(times),
        compute_seconds=compute_all,
        measured_balance=max(compute_all) / (sum(compute_all) / world),
        tree_seconds=tree_all,
        reduce_seconds=reduce_seconds,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30,
    )
    if rank == 0:
        print(
            f"{label}: step {row['step_seconds']:.3f} s, compute {[f'{s:.3f}' for s in compute_all]}, "
            f"build tree {[f'{s:.3f}' for s in tree_all]}, all-reduce {reduce_seconds:.3f}, "
            f"balance measured {row['measured_balance']:.3f} predicted {plan.balance:.3f}",
            flush=True,
        )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--batches", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    p.add_argument("--tasks", type=int, default=16, help="tasks in the agentic batch")
    p.add_argument("--chunks", type=int, default=8192, help="max_chunk_tokens (0: one chunk)")
    p.add_argument("--keep", action=argparse.BooleanOptionalAction, default=True, help="recompute=False")
    p.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    available = torch.cuda.device_count()
    worlds = [w for w in args.gpus if w <= available]
    for w in sorted(set(args.gpus) - set(worlds)):
        print(f"skipping {w} GPUs: {available} available")
    if 1 in worlds:  # the reference of the others' gates first
        worlds = [1] + [w for w in worlds if w != 1]
    else:
        print("no 1-GPU run: the rows are not gated")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        reference = None
        for world in worlds:
            result = os.path.join(tmp, f"rows_{world}.json")
            mp.spawn(
                worker,
                args=(world, os.path.join(tmp, f"init_{world}"), args, result, reference),
                nprocs=world,
                join=True,
            )
            rows += json.loads(Path(result).read_text())
            if world == 1:
                reference = str(Path(result).with_suffix(".grads.pt"))
            add_efficiency(rows)
            # after each world size, so a cut-off run keeps what it measured
            harness.write_results(
                "distributed",
                rows,
                args.out,
                gpu=harness.short_name(count=max(worlds)),
                key=lambda r: (r["batch"], r["world_size"], r["plan"]),
                gpus=max(worlds),
                args=vars(args),
            )
    summarize(rows)


def add_efficiency(rows):
    """Scaling efficiency T(1) / (W T(W)) and each plan's step time over the balanced plan's."""
    one = {r["batch"]: r["step_seconds"] for r in rows if r["world_size"] == 1 and "step_seconds" in r}
    balanced = {
        (r["batch"], r["world_size"]): r["step_seconds"]
        for r in rows
        if r["plan"] == "balanced" and "step_seconds" in r
    }
    for r in rows:
        if "step_seconds" not in r:
            continue
        t1, tw = one.get(r["batch"]), r["step_seconds"]
        r["efficiency"] = t1 / (r["world_size"] * tw) if t1 else None
        base = balanced.get((r["batch"], r["world_size"]))
        r["balanced_gain"] = tw / base - 1 if base else None


def summarize(rows):
    table = []
    for r in rows:
        gate = "-" if r.get("gate") is None else ("ok" if r["gate"]["ok"] else "FAIL")
        if "step_seconds" not in r:
            table.append([r["batch"][:52], r["world_size"], r["plan"], "-", "-", "-", "-", gate])
            continue
        gain = r.get("balanced_gain")
        table.append(
            [
                r["batch"][:52],
                r["world_size"],
                r["plan"],
                f"{r['step_seconds']:.3f}",
                harness.cell(r.get("efficiency"), ".3f"),
                f"{r['measured_balance']:.3f} ({r['predicted_balance']:.3f})",
                "-" if gain is None else f"{100 * gain:.1f}%",
                gate,
            ]
        )
    harness.print_table(["batch", "W", "plan", "step s", "efficiency", "balance", "gain", "gate"], table)
    print(
        "balance: measured max/mean compute time (predicted); gain: this plan's step time over the balanced plan's;"
        " gate: gradients against the 1-GPU step"
    )


if __name__ == "__main__":
    main()
