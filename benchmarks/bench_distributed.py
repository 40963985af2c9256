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
T(1 GPU) / (W x T(W GPUs)) with the balanced plan. Prints a table and writes
JSON under --out.
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

BATCHES = {
    "agentic": "agentic 4.8K system, {tasks} tasks x 4 rollouts x 8 turns",
    "grpo": "GRPO 16 groups, P in 512..8K, N=16, R=1K",
}
PLANS = ("balanced", "tree_tokens", "token_greedy")


def make_batch(key, tasks=16):
    from dta_ref import agentic_batch, grpo_batch

    if key == "agentic":
        sequences = agentic_batch(num_tasks=tasks, rollouts_per_task=4, turns=8, vocab_size=151936)
    else:
        sequences = sum((grpo_batch(1, 512 * (1 + g), 16, 1024, vocab_size=151936, seed=g) for g in range(16)), [])
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


def worker(rank, world, init_file, args, result_file):
    from bench_training import build_model

    import dta_fast
    from dta_ref import PrefixTree, SFTLoss

    torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # each rank its share of the host, as launchers do
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = build_model("qwen2-0.5b")
        costs = cost_model(model)
        options = dict(max_chunk_tokens=args.chunks or None, recompute=False if args.keep else None)
        rows = []
        for key in args.batches:
            sequences = make_batch(key, args.tasks)
            loss_fn = SFTLoss(PrefixTree.from_sequences(sequences).logprob_mask)
            for name in args.plans if world > 1 else ("balanced",):
                t0 = time.perf_counter()
                plan = plan_for(name, sequences, world, costs)
                plan_seconds = time.perf_counter() - t0

                def step():
                    model.zero_grad(set_to_none=True)
                    dta_fast.distributed_tree_backward(model, sequences, loss_fn, plan=plan.shards, **options)

                times = [timed(step) for _ in range(args.repeats + 1)][1:]
                shard = plan.shards[rank]
                tree = PrefixTree.from_sequences([sequences[i] for i in shard])
                local = SFTLoss(tree.logprob_mask)

                def compute():  # this rank's work alone (its loss normalised by itself: the same work)
                    model.zero_grad(set_to_none=True)
                    dta_fast.tree_backward(model, tree, local, **options)

                compute_seconds = timed(compute)
                t0 = time.perf_counter()
                dta_fast.build_tree([sequences[i] for i in shard])
                tree_seconds = time.perf_counter() - t0
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                reduce_seconds = timed(lambda: [dist.all_reduce(g) for g in grads])
                gathered = [None] * world
                dist.all_gather_object(gathered, (compute_seconds, tree_seconds))
                tree_gathered = [t for _, t in gathered]
                gathered = [c for c, _ in gathered]
                step_seconds = sorted(times)[len(times) // 2]
                row = dict(batch=BATCHES[key].format(tasks=args.tasks), world_size=world, plan=name, method=plan.method,
                           step_seconds=step_seconds, compute_seconds=gathered,
                           measured_balance=max(gathered) / (sum(gathered) / world),
                           predicted_balance=plan.balance, unique_tokens=plan.unique_tokens,
                           flat_tokens=plan.flat_tokens, plan_seconds=plan_seconds,
                           tree_seconds=tree_gathered, reduce_seconds=reduce_seconds,
                           peak_gib=torch.cuda.max_memory_allocated() / 2**30)  # fmt: skip
                rows.append(row)
                if rank == 0:
                    print(f"W={world} {key} {name}: step {step_seconds:.3f} s, compute {['%.3f' % s for s in gathered]}, "
                          f"build tree {['%.3f' % s for s in tree_gathered]}, all-reduce {reduce_seconds:.3f}, "
                          f"balance measured {row['measured_balance']:.3f} predicted {plan.balance:.3f}", flush=True)  # fmt: skip
        if rank == 0:
            Path(result_file).write_text(json.dumps(rows))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--batches", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    parser.add_argument("--tasks", type=int, default=16, help="tasks in the agentic batch")
    parser.add_argument("--chunks", type=int, default=8192, help="max_chunk_tokens (0: one chunk)")
    parser.add_argument("--keep", action=argparse.BooleanOptionalAction, default=True, help="recompute=False")
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    available = torch.cuda.device_count()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, args=vars(args))
    rows = []
    for world in args.gpus:
        if world > available:
            print(f"skipping {world} GPUs: {available} available")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "rows.json")
            mp.spawn(worker, args=(world, os.path.join(tmp, "init"), args, result), nprocs=world, join=True)
            rows += json.loads(Path(result).read_text())
        summarize(rows)  # after each world size, so a cut-off run keeps what it measured
        (out / "distributed.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


def summarize(rows):
    one = {r["batch"]: r["step_seconds"] for r in rows if r["world_size"] == 1}
    balanced = {(r["batch"], r["world_size"]): r["step_seconds"] for r in rows if r["plan"] == "balanced"}
    print(f"\n{'batch':<52} {'W':>2} {'plan':<13} {'step s':>7} {'efficiency':>10} {'balance':>15} {'gain':>6}")
    for r in rows:
        t1, tw = one.get(r["batch"]), r["step_seconds"]
        r["efficiency"] = t1 / (r["world_size"] * tw) if t1 else None
        r["balanced_gain"] = tw / balanced.get((r["batch"], r["world_size"]), float("nan")) - 1
        eff = f"{r['efficiency']:.3f}" if r["efficiency"] else "-"
        bal = f"{r['measured_balance']:.3f} ({r['predicted_balance']:.3f})"
        print(f"{r['batch']:<52} {r['world_size']:>2} {r['plan']:<13} {tw:>7.3f} {eff:>10} {bal:>15} "
              f"{100 * r['balanced_gain']:>5.1f}%")  # fmt: skip
    print("balance: measured max/mean compute time (predicted); gain: this plan's step time over the balanced plan's")


if __name__ == "__main__":
    main()
