"""One training step (forward + backward) of a Hugging Face model, per-sequence vs tree.

    python benchmarks/bench_training.py speed  [--model qwen2-0.5b] [--batches grpo agentic]
    python benchmarks/bench_training.py memory [--model qwen3-1.7b]

Models are built from configs with random weights (bfloat16, SDPA attention).
The loss is the token-mean SFT loss over every next-token logprob, the same
for every method. Methods:

  flat         each sequence alone, SDPA flash (causal), gradient accumulation
  flat_ckpt    the same with activation checkpointing
  flat_kernel  each sequence alone through the Triton tree kernel (a one-sequence tree): not a
               contender, it measures how far two exact bf16 implementations drift apart
  packed       dta_fast.tree_logprobs over the whole forest, one backward
  tree_B       dta_fast.tree_backward with chunks of B packed tokens (B=all: one chunk),
               recomputing each chunk's forward at its backward; tree_B_keep keeps the graphs
  tree_GGiB    dta_fast.tree_backward with memory_budget_bytes=G GiB (it picks the chunking)

``speed`` runs one warm-up step of each method (its result, gradients and
peak), then the timed steps round-robin over the methods, so that a host
that slows down during the run weighs on all of them alike; a row's time is
the median of its timed steps. It gates every row: the tree methods'
logprobs and gradients are compared with ``flat`` in the same run, within
5% relative L2 for gradients or twice the drift of ``flat_kernel`` from
``flat`` when that ran.
``memory`` trains agentic forests of growing size at a fixed path length and
one forest of ~1M unique tokens with paths up to 32K, recording the peak
memory. Both print a table and write JSON
(and ``memory`` a plot) under --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

import dta_fast
from dta_fast.engine import MemoryModel, _choose_plan, _Forest, _plan_for_budget, chunk_tokens_for_budget, plan_chunks
from dta_fast.logprobs import rows_logprobs
from dta_ref import PrefixTree, SFTLoss, agentic_batch, grpo_batch, sft_loss

MODELS = {
    "qwen2-0.5b": dict(
        family="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936, tie_word_embeddings=True,
    ),
    "qwen3-1.7b": dict(
        family="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
}  # fmt: skip

def irregular_agentic_batch(num_tasks=4, rollouts_per_task=4, min_turns=4, max_turns=12, min_len=40, max_len=900,
                            system_len=4800, task_len=200, vocab_size=151936, seed=0):  # fmt: skip
    """Agentic rollouts with irregular turns: a random number of turns per rollout, each message of
    ``min_len`` to ``max_len`` tokens; every turn is a training sample holding the context so far."""
    rng = np.random.default_rng(seed)

    def tokens(n):
        return rng.integers(0, vocab_size, size=int(n)).tolist()

    system, batch = tokens(system_len), []
    for _ in range(num_tasks):
        start = system + tokens(task_len)
        for _ in range(rollouts_per_task):
            context, turns = list(start), int(rng.integers(min_turns, max_turns + 1))
            for turn in range(turns):
                context += tokens(rng.integers(min_len, max_len + 1))  # assistant
                batch.append(list(context))
                if turn + 1 < turns:
                    context += tokens(rng.integers(min_len, max_len + 1))  # tool
    return batch


BATCHES = {
    "grpo": ("GRPO P=8K N=16 R=1K", lambda: grpo_batch(1, 8192, 16, 1024, vocab_size=151936)),
    "grpo2k": ("GRPO P=2K N=8 R=1K", lambda: grpo_batch(1, 2048, 8, 1024, vocab_size=151936)),
    "agentic": (
        "agentic 4.8K system, 4 tasks x 4 rollouts x 8 turns",
        lambda: agentic_batch(num_tasks=4, rollouts_per_task=4, turns=8, vocab_size=151936),
    ),
    "irregular": ("agentic, irregular turns: 4 tasks x 4 rollouts x 4-12 turns of 40-900 tokens", irregular_agentic_batch),
}


def build_model(name, device="cuda"):
    import transformers

    spec = dict(MODELS[name])
    family = spec.pop("family")
    config_cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    model_cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[family]
    config = config_cls(**spec, attention_dropout=0.0, max_position_embeddings=65536)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    return model.train()


def step_flops(model, tokens, pairs, logit_rows):
    """Training FLOPs: 6 per parameter per token (embeddings excluded), attention, vocabulary projection."""
    cfg = model.config
    dense = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    attention = 12 * pairs * cfg.head_dim * cfg.num_attention_heads * cfg.num_hidden_layers
    head = 6 * logit_rows * cfg.hidden_size * cfg.vocab_size
    return 6 * dense * tokens + attention + head


def flat_and_tree_flops(model, tree, sequences):
    lengths = [len(s) for s in sequences]
    flat = step_flops(model, sum(lengths), sum(n * (n + 1) // 2 for n in lengths), sum(n - 1 for n in lengths))
    pairs = int((tree.subtree_end - torch.arange(tree.num_tokens)).sum())
    return flat, step_flops(model, tree.num_tokens, pairs, tree.num_tokens)


def flat_step(model, sequences, loss_fn, checkpointing=False):
    """Each sequence alone: forward, its loss term, backward (gradient accumulation)."""
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    head = model.get_output_embeddings()
    width = max(len(s) for s in sequences) - 1
    out = torch.zeros(len(sequences), width, device="cuda")
    try:
        for i, seq in enumerate(sequences):
            ids = torch.tensor(seq, device="cuda")[None]
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
            lp = rows_logprobs(hidden, head, torch.arange(len(seq) - 1, device="cuda"), ids[0, 1:])
            loss_fn(i, lp).backward()
            out[i, : lp.numel()] = lp.detach()
    finally:
        if checkpointing:
            model.gradient_checkpointing_disable()
    return out


def flat_kernel_step(model, sequences, loss_fn):
    """Each sequence alone, attention by the tree kernel on its chain: flat's numerics with our kernel."""
    width = max(len(s) for s in sequences) - 1
    out = torch.zeros(len(sequences), width, device="cuda")
    for i, seq in enumerate(sequences):
        lp = dta_fast.tree_logprobs(model, PrefixTree.from_sequences([seq]))[0]
        loss_fn(i, lp).backward()
        out[i, : lp.numel()] = lp.detach()
    return out


def packed_step(model, tree, mask):
    lp = dta_fast.tree_logprobs(model, tree)
    sft_loss(lp, mask.cuda()).backward()
    return lp.detach()


def timed_step(model, fn):
    """Wall seconds and peak GiB of one step from unset gradients, and its result."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, torch.cuda.max_memory_allocated() / 2**30, result


def model_grads(model):
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def run_method(model, fn, repeats):
    """Wall seconds (median of ``repeats`` after one warm-up; with 0, of one cold step) and peak GiB."""
    times, peak, result = [], 0.0, None
    for r in range(repeats + 1 if repeats else 1):
        seconds, step_peak, result = timed_step(model, fn)
        if r or not repeats:  # repeats=0: one cold step, nothing to warm up for
            times.append(seconds)
        peak = max(peak, step_peak)
    return median(times), peak, result, model_grads(model)


def median(values):
    return sorted(values)[len(values) // 2]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def tree_options(args, num_tokens):
    """label -> tree_backward keyword arguments of the hand-picked, budget and automatic rows."""
    options = {}
    for size in sorted({min(c, num_tokens) if c else num_tokens for c in args.chunks}):
        label = "tree_all" if size >= num_tokens else f"tree_{size}"
        if size >= num_tokens:
            options["tree_all"] = dict(max_chunk_tokens=num_tokens)  # one chunk
        else:
            for recompute in (True, False) if args.keep else (None,):
                options[label + ("_keep" if recompute is False else "")] = dict(max_chunk_tokens=size, recompute=recompute)
        if args.checkpoint:  # every layer checkpointed: keep mode (a chunk's graph is its layers' inputs)
            options[label + "_ckpt"] = dict(max_chunk_tokens=size, recompute=False, checkpoint_layers=True)
    for gib in args.budgets:  # the engine picks chunk size and recompute from an activation budget
        options[f"tree_{gib:g}GiB"] = dict(memory_budget_bytes=int(gib * 2**30))
    if args.auto:
        options["auto"] = {}  # no chunking options: the budget comes from the free memory
    return options


def describe_plan(model, tree, options):
    """The plan tree_backward will pick with ``options`` (call with the gradients unset, as in the step)."""
    plan = _choose_plan(model, tree, torch.device("cuda"), options.get("max_chunk_tokens"),
                        options.get("memory_budget_bytes"), None, options.get("recompute"),
                        options.get("checkpoint_layers"))  # fmt: skip
    memory = MemoryModel.of(model)
    return dict(chunk_tokens=plan.size, recompute=plan.recompute, chunks=plan.num_chunks,
                recomputed_tokens=plan.recomputed_tokens, logits_rows=plan.logits_rows or memory.logits_rows,
                checkpoint_layers=plan.checkpoint_layers, estimate_gib=memory.step_bytes(plan) / 2**30)  # fmt: skip


def speed(args):
    model = build_model(args.model)
    model.zero_grad(set_to_none=True)
    params_bytes = torch.cuda.memory_allocated()  # what a step starts from: the weights alone
    grads_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    rows = []
    for key in args.batches:
        name, make = BATCHES[key]
        sequences = make()
        tree = dta_fast.build_tree(sequences)
        mask = tree.logprob_mask
        flat_flops, tree_flops = flat_and_tree_flops(model, tree, sequences)
        loss_fn = SFTLoss(mask)
        methods = {
            "flat": lambda: flat_step(model, sequences, loss_fn),
            "flat_ckpt": lambda: flat_step(model, sequences, loss_fn, checkpointing=True),
            "flat_kernel": lambda: flat_kernel_step(model, sequences, loss_fn),
            "packed": lambda: packed_step(model, tree, mask),
        }
        options = tree_options(args, tree.num_tokens)
        methods.update({label: None for label in options})
        if args.skip:
            methods = {k: v for k, v in methods.items() if k == "flat" or k not in args.skip}
        row = dict(batch=name, model=args.model, sequences=tree.num_sequences, flat_tokens=tree.flat_tokens,
                   tree_tokens=tree.num_tokens, ideal_speedup=flat_flops / tree_flops, methods={})  # fmt: skip
        reference, fractions = None, {}  # budget rows: their total budget as a fraction of flat's peak
        timed = {}  # label -> (step, timed repeats)
        while methods:
            label, fn = next(iter(methods.items()))
            del methods[label]
            entry = {}
            if fn is None:  # a tree_backward row: note the plan it picks, then time it
                opts = options[label]
                model.zero_grad(set_to_none=True)
                try:
                    entry["plan"] = describe_plan(model, tree, opts)
                except ValueError as error:
                    row["methods"][label] = dict(error=str(error))
                    print(f"{name}: {label} {error}", flush=True)
                    continue
                if "memory_budget_bytes" in opts:
                    entry["budget_gib"] = opts["memory_budget_bytes"] / 2**30
                if label in fractions:
                    entry["flat_peak_fraction"] = fractions[label]
                fn = lambda o=opts: dta_fast.tree_backward(model, tree, loss_fn, **o)[0]  # noqa: E731
            repeats = args.flat_repeats if label == "flat" else args.repeats
            try:  # the warm-up step: its result, gradients and peak (its time only with --repeats 0)
                seconds, peak, lp = timed_step(model, fn)
                grads = model_grads(model)
            except torch.cuda.OutOfMemoryError:
                row["methods"][label] = dict(entry, oom=True)
                print(f"{name}: {label} out of memory", flush=True)
                seconds = None
            if seconds is None:  # outside the except block: the failed step's tensors are gone by now
                model.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()
                continue
            entry.update(seconds=seconds, peak_gib=peak, tokens_per_s=tree.flat_tokens / seconds)
            if repeats:
                timed[label] = (fn, repeats)
            if "plan" in entry:  # the estimate covers activations: add the weights and their gradients
                entry["estimate_total_gib"] = entry["plan"]["estimate_gib"] + (params_bytes + grads_bytes) / 2**30
                entry["estimate_over_peak"] = entry["estimate_total_gib"] / peak
            if label == "flat":
                reference = (lp.float().cpu(), grads.cpu())  # off the GPU: the tree rows' peaks are their own
                row["flat_peak_gib"] = peak
                budget_rows = {"tree_flatpeak": 1.0} if args.flatpeak else {}
                budget_rows.update({f"tree_budget_{x:g}x": x for x in args.sweep})
                for budget_label, x in budget_rows.items():
                    budget = x * peak * 2**30 - params_bytes - grads_bytes
                    if budget > 0:
                        options[budget_label] = dict(memory_budget_bytes=int(budget))
                        fractions[budget_label] = x
                        methods[budget_label] = None
                        if args.checkpoint:  # the same budget without checkpointed layers, for comparison
                            options[budget_label + "_no_ckpt"] = dict(memory_budget_bytes=int(budget), checkpoint_layers=False)
                            fractions[budget_label + "_no_ckpt"] = x
                            methods[budget_label + "_no_ckpt"] = None
            elif reference is not None:
                entry["logprob_max_abs_diff"] = (lp.float().cpu() - reference[0]).abs().max().item()
                entry["grad_rel_err"] = rel(grads.cpu(), reference[1])
                drift = row["methods"].get("flat_kernel", {}).get("grad_rel_err", 0.0)
                entry["gate_ok"] = entry["grad_rel_err"] < max(5e-2, 2 * drift) and entry["logprob_max_abs_diff"] < 0.25
            row["methods"][label] = entry
            del grads
            torch.cuda.empty_cache()
            print(f"{name}: {label} warm-up {seconds:.3f} s, {peak:.1f} GiB {entry.get('plan', '')}", flush=True)
        # The timed steps go round-robin over the methods: these steps are host-bound, and a host that
        # slows down during a run (by 10-20% here) would otherwise weigh most on the methods run last.
        times = {label: [] for label in timed}
        for r in range(max((repeats for _, repeats in timed.values()), default=0)):
            for label, (fn, repeats) in timed.items():
                if r < repeats:
                    seconds, peak, _ = timed_step(model, fn)
                    times[label].append(seconds)
                    entry = row["methods"][label]
                    entry["peak_gib"] = max(entry["peak_gib"], peak)
                    if "estimate_total_gib" in entry:
                        entry["estimate_over_peak"] = entry["estimate_total_gib"] / entry["peak_gib"]
        for label, values in times.items():
            entry = row["methods"][label]
            entry.update(seconds=median(values), step_seconds=values, tokens_per_s=tree.flat_tokens / median(values))
            print(f"{name}: {label} {entry['seconds']:.3f} s, {entry['peak_gib']:.1f} GiB", flush=True)
        model.zero_grad(set_to_none=True)
        base = row["methods"].get("flat", {}).get("seconds")
        for label, entry in row["methods"].items():
            if label == "flat_kernel":
                continue
            if base and "seconds" in entry and entry.get("gate_ok", label.startswith("flat")):
                entry["speedup"] = base / entry["seconds"]
                entry["fraction_of_ideal"] = entry["speedup"] / row["ideal_speedup"]
        hand = {k: e["seconds"] for k, e in row["methods"].items()
                if "max_chunk_tokens" in options.get(k, {}) and e.get("gate_ok")}  # fmt: skip
        if hand:
            row["best_hand_picked"] = min(hand, key=hand.get)
            for label in ("auto", "tree_flatpeak"):
                if row["methods"].get(label, {}).get("gate_ok"):
                    row[f"{label}_over_best"] = row["methods"][label]["seconds"] / hand[row["best_hand_picked"]]
        rows.append(row)
    print_speed(rows)
    return rows


def print_speed(rows):
    print(f"\n{'batch':<48} {'method':<24} {'s/step':>8} {'tok/s':>10} {'peak GiB':>9} {'est GiB':>8} {'speedup':>8} {'ideal':>6} {'of ideal':>8} {'gate':>5}  plan")
    for row in rows:
        for label, e in row["methods"].items():
            if e.get("oom") or e.get("error"):
                print(f"{row['batch']:<48} {label:<24} {'out of memory' if e.get('oom') else e['error'][:60]:>20}")
                continue
            gate = "" if "gate_ok" not in e else ("ok" if e["gate_ok"] else "FAIL")
            plan = e.get("plan")
            plan = (f"{plan['chunk_tokens']} {'recompute' if plan['recompute'] else 'keep'} x{plan['chunks']}, "
                    f"windows of {plan['logits_rows']} rows"
                    + (", checkpointed layers" if plan.get("checkpoint_layers") else "")) if plan else ""  # fmt: skip
            print(f"{row['batch']:<48} {label:<24} {e['seconds']:>8.3f} {e['tokens_per_s']:>10.0f} {e['peak_gib']:>9.1f} "
                  f"{e.get('estimate_total_gib', float('nan')):>8.1f} {e.get('speedup', float('nan')):>8.2f} {row['ideal_speedup']:>6.2f} "
                  f"{e.get('fraction_of_ideal', float('nan')):>8.2f} {gate:>5}  {plan}")  # fmt: skip
        for label in ("auto", "tree_flatpeak"):
            if f"{label}_over_best" in row:
                print(f"{row['batch']:<48} {label} / best hand-picked ({row['best_hand_picked']}): {row[f'{label}_over_best']:.3f}")


def memory(args):
    model = build_model(args.model)
    rows = []
    chunk = args.chunks[0] if args.chunks and args.chunks[0] else 8192
    forests = [(f"{t} tasks x 4 rollouts x 60 turns", dict(num_tasks=t)) for t in args.tasks]
    for name, kw in forests:
        sequences = agentic_batch(turns=60, rollouts_per_task=4, vocab_size=151936, every_turn=False, **kw)
        tree = PrefixTree.from_sequences(sequences)
        loss_fn = SFTLoss(tree.logprob_mask)
        row = dict(forest=name, model=args.model, tree_tokens=tree.num_tokens, flat_tokens=tree.flat_tokens,
                   longest_path=int(tree.lengths.max()), chunk_tokens=chunk)  # fmt: skip
        try:
            seconds, peak, _, grads = run_method(
                model, lambda: dta_fast.tree_backward(model, tree, loss_fn, max_chunk_tokens=chunk)[0], 0
            )
            del grads
            row.update(seconds=seconds, peak_gib=peak)
        except torch.cuda.OutOfMemoryError:
            row.update(oom=True)
        torch.cuda.empty_cache()
        print(row, flush=True)
        rows.append(row)
    # the longest single sequence, each alone, without and with activation checkpointing
    longest = agentic_batch(num_tasks=1, turns=60, rollouts_per_task=1, vocab_size=151936, every_turn=False)
    for label, ckpt in (("flat one 32K sequence", False), ("flat_ckpt one 32K sequence", True)):
        try:
            seconds, peak, _, grads = run_method(
                model, lambda c=ckpt: flat_step(model, longest, SFTLoss(torch.ones(1, len(longest[0]) - 1)), c), 0
            )
            del grads
            rows.append(dict(forest=label, model=args.model, seconds=seconds, peak_gib=peak))
        except torch.cuda.OutOfMemoryError:
            rows.append(dict(forest=label, model=args.model, oom=True))
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)
    print(f"\n{'forest':<36} {'tree tokens':>11} {'flat tokens':>11} {'path':>6} {'s/step':>8} {'peak GiB':>9}")
    for r in rows:
        peak = "OOM" if r.get("oom") else f"{r['peak_gib']:.1f}"
        secs = "-" if r.get("oom") else f"{r['seconds']:.2f}"
        print(f"{r['forest']:<36} {r.get('tree_tokens', '-'):>11} {r.get('flat_tokens', '-'):>11} {r.get('longest_path', '-'):>6} {secs:>8} {peak:>9}")
    return rows


def plan_timing(args):
    """CPU, one thread: planning a forest of ~1M unique tokens (the memory mode's largest)."""
    torch.set_num_threads(1)
    sequences = agentic_batch(num_tasks=10, rollouts_per_task=4, turns=60, vocab_size=151936, every_turn=False)
    tree = dta_fast.build_tree(sequences)
    model = build_model(args.model, device="meta")
    memory, forest = MemoryModel.of(model), _Forest.of(tree)

    def best_ms(fn, repeats=5):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3, result

    rows = [dict(what="forest arrays", ms=best_ms(lambda: _Forest.of(tree))[0])]
    for size in (1024, 4096, 8192, 16384):
        for recompute in (False, True):
            ms, plan = best_ms(lambda: plan_chunks(tree, size, recompute))
            rows.append(dict(what=f"plan, chunks of {size}, {'recompute' if recompute else 'keep'}", ms=ms,
                             chunks=plan.num_chunks))  # fmt: skip
    for gib in args.budgets or (20, 40, 60):
        for recompute in (False, True):
            try:
                ms, size = best_ms(lambda: chunk_tokens_for_budget(model, tree, int(gib * 2**30), recompute), 3)
            except ValueError:
                ms, size = best_ms(lambda: _raises(chunk_tokens_for_budget, model, tree, int(gib * 2**30), recompute), 3)
            rows.append(dict(what=f"chunk_tokens_for_budget {gib:g} GiB, {'recompute' if recompute else 'keep'}",
                             ms=ms, chunk_tokens=size))  # fmt: skip
        try:
            ms, plan = best_ms(lambda: _plan_for_budget(memory, forest, int(gib * 2**30), None, True), 3)
            chosen = dict(chunk_tokens=plan.size, recompute=plan.recompute, checkpoint_layers=plan.checkpoint_layers)
        except ValueError:
            ms, _ = best_ms(lambda: _raises(_plan_for_budget, memory, forest, int(gib * 2**30), None, True), 3)
            chosen = dict(chunk_tokens="too small")
        rows.append(dict(what=f"automatic choice at {gib:g} GiB", ms=ms, **chosen))
    print(f"\n{tree.num_tokens} unique tokens, longest path {int(tree.lengths.max())}, {args.model} shape, one thread")
    for r in rows:
        extra = {k: v for k, v in r.items() if k not in ("what", "ms")}
        print(f"{r['what']:<52} {r['ms']:>8.1f} ms  {extra or ''}")
    return rows


def _raises(fn, *args):
    try:
        fn(*args)
    except ValueError:
        return "too small"


def plot_budget(rows, path):
    """Step time against the memory budget (weights, gradients and activations), per-sequence marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if any("flat_peak_fraction" in e for e in r["methods"].values())]
    if not rows:
        return
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        flat = row["methods"]["flat"]
        for without, name in ((False, "tree_backward, memory_budget_bytes"), (True, "... with checkpoint_layers=False")):
            points = sorted((e["flat_peak_fraction"] * row["flat_peak_gib"], e["seconds"], e["peak_gib"])
                            for label, e in row["methods"].items()
                            if "flat_peak_fraction" in e and "seconds" in e and label.endswith("_no_ckpt") == without)  # fmt: skip
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], "x--" if without else "o-", label=name)
        ax.axhline(flat["seconds"], ls="--", color="gray", label=f"per sequence: {flat['seconds']:.2f} s")
        ax.axvline(flat["peak_gib"], ls=":", color="gray", label=f"per sequence peak: {flat['peak_gib']:.1f} GiB")
        auto = row["methods"].get("auto", {})
        if "seconds" in auto:
            ax.plot([auto["peak_gib"]], [auto["seconds"]], "s", label="automatic (at its measured peak)")
        ax.set_xlabel("budget: weights + gradients + activations (GiB)")
        ax.set_ylabel("seconds per step")
        ax.set_yscale("log")
        ax.set_title(row["batch"][:60], fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_memory(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if "tree_tokens" in r and not r.get("oom")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["tree_tokens"] / 1e3 for r in pts]
    a.plot(xs, [r["seconds"] for r in pts], "o-")
    a.set_xlabel("unique tokens in the forest (K)")
    a.set_ylabel("seconds per step")
    b.plot(xs, [r["peak_gib"] for r in pts], "o-")
    b.set_xlabel("unique tokens in the forest (K)")
    b.set_ylabel("peak GiB")
    b.set_ylim(bottom=0)
    fig.suptitle(f"tree_backward, {pts[0]['model'] if pts else ''}, paths up to 32K tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["speed", "memory", "plan"])
    parser.add_argument("--model", default=None, choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", default=["grpo", "agentic"], choices=list(BATCHES))
    parser.add_argument("--chunks", nargs="+", type=int, default=[0, 8192, 2048], help="0 means one chunk")
    parser.add_argument("--budgets", nargs="*", type=float, default=[], help="tree_backward memory budgets, GiB")
    parser.add_argument("--tasks", nargs="+", type=int, default=[1, 2, 4, 10])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="also run each chunk size with recompute=False")
    parser.add_argument("--auto", action="store_true", help="a row with no chunking options (budget from free memory)")
    parser.add_argument("--flatpeak", action="store_true", help="a row whose budget is per-sequence training's peak")
    parser.add_argument("--checkpoint", action="store_true",
                        help="rows with checkpointed layers at each chunk size, and each budget row without them")
    parser.add_argument("--sweep", nargs="*", type=float, default=[], help="budget rows at these fractions of flat's peak")
    parser.add_argument("--flat-repeats", type=int, default=None, help="repeats of flat (default: --repeats)")
    parser.add_argument("--skip", nargs="*", default=[], help="methods to leave out (flat always runs)")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    args.model = args.model or ("qwen3-1.7b" if args.mode == "memory" else "qwen2-0.5b")
    args.flat_repeats = args.repeats if args.flat_repeats is None else args.flat_repeats
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.mode == "plan":
        rows = plan_timing(args)
        (out / f"plan_timing_{args.model}.json").write_text(json.dumps(dict(rows=rows), indent=1))
        return
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, model=args.model)
    rows = speed(args) if args.mode == "speed" else memory(args)
    stem = f"training_{args.mode}_{args.model}_{gpu}"
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    if args.mode == "memory":
        plot_memory(rows, out / f"{stem}.png")
    elif args.sweep:
        plot_budget(rows, out / f"{stem}_budget.png")


if __name__ == "__main__":
    main()
