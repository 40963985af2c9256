"""One training step (forward + backward) of a Hugging Face model, per-sequence vs tree.

    python benchmarks/bench_training.py speed  [--model qwen2-0.5b] [--batches grpo agentic] [--critic]
    python benchmarks/bench_training.py score  [--model qwen2-0.5b] [--batches grpo agentic]
    python benchmarks/bench_training.py memory [--model qwen3-1.7b]
    python benchmarks/bench_training.py plan   [--model qwen2-0.5b]     # CPU

Models are shapes.MODELS built with random weights (bfloat16, SDPA attention; MoE experts as transformers
runs them by default; hybrids' linear-attention layers by flash-linear-attention where it is installed);
batches are shapes.ROLLOUTS (``--batches`` names: grpo, grpo2k, agentic, agentic1, irregular). The loss is the
token-mean SFT loss over every next-token logprob, the same for every method; with ``--critic`` the model
is a critic (a token classifier of one label) and the loss PPO's clipped value loss over every token's
value (``dta_ref.ValueLoss``, random returns). Methods:

  flat         each sequence alone, SDPA (causal), gradient accumulation
  flat_ckpt    the same with activation checkpointing
  flat_kernel  each sequence alone through the Triton tree kernel (a one-sequence tree): not a
               contender, it measures how far two exact bf16 implementations drift apart
  packed       dta_fast.tree_logprobs over the whole forest, one backward
  tree_B       dta_fast.tree_backward with chunks of B packed tokens (B=all: one chunk),
               recomputing each chunk's forward at its backward; tree_B_keep keeps the graphs
  tree_GGiB    dta_fast.tree_backward with memory_budget_bytes=G GiB (it picks the chunking)

Every tree_backward row plans inside its step (the per-call cost); ``plan`` times planning alone.

``score`` times the forward alone, as a trainer scores its old and reference policies (no gradient):
each sequence alone against ``dta_fast.tree_logprobs``, and for a hybrid with flash-linear-attention
installed also ``tree_per_segment`` (each unbranched segment one call instead of each level one
variable-length call); gated on logprobs against flat, median of ``--repeats``.

``speed`` runs one warm-up step of each method (its result, gradients and peak), then the timed
steps round-robin over the methods, so that a host that slows down during the run weighs on all of
them alike; a row's time is the median of its timed steps. Gate: every method's logprobs and
gradients against ``flat`` in the same run, within 5% relative L2 for gradients (or twice the drift
of ``flat_kernel`` from ``flat`` when that ran) and 0.25 max abs for logprobs; a row whose gate is red
gets no speedup. ``memory`` trains agentic forests of growing size at a fixed path length (31.7K
tokens) and records the peak; ``plan`` times planning a forest of ~1M unique tokens on one CPU
thread. Each writes results/training_<mode>_<GPU>.json (plan: _CPU), keeping the rows of earlier
runs with other models, batches or options, prints a table last, and draws a plot (``memory``; the
budget sweep of ``speed --sweep``).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import harness
import shapes
import torch

import dta_fast
from dta_fast.chunked import Forest, MemoryModel, checked_options, chunk_tokens_for_budget, plan_chunks, plan_for_budget
from dta_fast.chunked.budget import choose_plan
from dta_ref import PrefixTree, SFTLoss, ValueLoss, sft_loss, value_loss
from dta_ref.hf import linear_layers_of
from dta_ref.values import value_head_of

BATCHES = {  # --batches name -> shapes.ROLLOUTS key
    "grpo": "grpo_p8k_n16_r1k",
    "grpo2k": "grpo_p2k_n8_r1k",
    "agentic": "agentic_4x4x8",
    "agentic1": "agentic_1x4x8",
    "irregular": "agentic_irregular",
}
GRAD_TOLERANCE = 5e-2
LOGPROB_TOLERANCE = 0.25


def batch(name: str, vocab_size: int) -> tuple[str, list[list[int]]]:
    """(display name, sequences) of a ``--batches`` name at a model's vocabulary."""
    rollouts = shapes.ROLLOUTS[BATCHES[name]]
    return rollouts.name, rollouts.sequences(vocab_size)


def step_flops(model, tokens, pairs, logit_rows):
    """Training FLOPs: 6 per parameter a token meets (embeddings excluded; of the routed experts, the
    share a token is routed to), softmax attention over its layers, the vocabulary projection."""
    cfg = model.config
    routed = getattr(cfg, "num_experts_per_tok", 1) / getattr(cfg, "num_experts", 1)
    dense = sum(
        p.numel() * (routed if ".experts." in n else 1)
        for n, p in model.named_parameters()
        if "embed" not in n and "lm_head" not in n
    )
    layers = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    attention_layers = sum(t != "linear_attention" for t in layers)
    attention = 12 * pairs * cfg.head_dim * cfg.num_attention_heads * attention_layers
    head = 6 * logit_rows * cfg.hidden_size * cfg.vocab_size if model.get_output_embeddings() is not None else 0
    return 6 * dense * tokens + attention + head


def flat_and_tree_flops(model, tree, sequences):
    lengths = [len(s) for s in sequences]
    flat = step_flops(model, sum(lengths), sum(n * (n + 1) // 2 for n in lengths), sum(n - 1 for n in lengths))
    pairs = int((tree.subtree_end - torch.arange(tree.num_tokens)).sum())
    return flat, step_flops(model, tree.num_tokens, pairs, tree.num_tokens)


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def is_critic(model) -> bool:
    return model.get_output_embeddings() is None


def flat_step(model, chains, loss_fn, checkpointing=False):
    """Each sequence alone: forward, its loss term, backward (gradient accumulation). ``chains``: each
    sequence as a one-sequence tree (built once, outside the step)."""
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    head = model.get_output_embeddings()
    width = max(c.num_tokens for c in chains) - (0 if is_critic(model) else 1)
    out = torch.zeros(len(chains), width, device=device_of(model))
    try:
        for i, chain in enumerate(chains):
            if is_critic(model):  # one value per token
                lp = model(input_ids=chain.tokens[None], use_cache=False).logits[0, :, 0]
            else:
                hidden = model.model(input_ids=chain.tokens[None], use_cache=False).last_hidden_state[0]
                lp = dta_fast.gather_logprobs_chunked(hidden, head, chain)[0]
            loss_fn(i, lp).backward()
            out[i, : lp.numel()] = lp.detach()
    finally:
        if checkpointing:
            model.gradient_checkpointing_disable()
    return out


def flat_kernel_step(model, chains, loss_fn):
    """Each sequence alone, attention by the tree kernel on its chain: flat's numerics with our kernel."""
    width = max(c.num_tokens for c in chains) - (0 if is_critic(model) else 1)
    out = torch.zeros(len(chains), width, device=device_of(model))
    for i, chain in enumerate(chains):
        lp = (dta_fast.tree_values if is_critic(model) else dta_fast.tree_logprobs)(model, chain)[0]
        loss_fn(i, lp).backward()
        out[i, : lp.numel()] = lp.detach()
    return out


def packed_step(model, tree, packed_loss):
    lp = (dta_fast.tree_values if is_critic(model) else dta_fast.tree_logprobs)(model, tree)
    packed_loss(lp).backward()
    return lp.detach()


def losses(tree: PrefixTree, critic: bool):
    """(``loss_fn(i, outputs_i)``, the same loss on the batch's [N, L] outputs) of every method: the SFT
    loss, or for a critic PPO's clipped value loss on every token with seeded random returns."""
    if not critic:
        mask = tree.logprob_mask
        return SFTLoss(mask), lambda lp: sft_loss(lp, mask.to(lp.device))
    g = torch.Generator().manual_seed(0)
    mask = tree.seq_index >= 0
    returns, old = torch.randn(mask.shape, generator=g), 0.3 * torch.randn(mask.shape, generator=g)
    clip = 0.2
    return ValueLoss(old, returns, mask, clip=clip), lambda v: value_loss(
        v, old.to(v.device), returns.to(v.device), mask.to(v.device), clip=clip
    )


def timed_step(model, fn):
    """Wall seconds and peak GiB of one step from unset gradients, and its result."""
    model.zero_grad(set_to_none=True)
    harness.reset_peak()
    seconds, result = harness.wall_seconds(fn)
    return seconds, harness.peak_allocated_gib(), result


def model_grads(model):
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def tree_options(args, num_tokens):
    """label -> tree_backward keyword arguments of the hand-picked, budget and automatic rows."""
    options = {}
    for size in sorted({min(c, num_tokens) if c else num_tokens for c in args.chunks}):
        label = "tree_all" if size >= num_tokens else f"tree_{size}"
        if size >= num_tokens:
            options["tree_all"] = dict(max_chunk_tokens=num_tokens)  # one chunk
        else:
            for recompute in (True, False) if args.keep else (None,):
                options[label + ("_keep" if recompute is False else "")] = dict(
                    max_chunk_tokens=size, recompute=recompute
                )
        if args.checkpoint:  # every layer checkpointed: keep mode (a chunk's graph is its layers' inputs)
            options[label + "_ckpt"] = dict(max_chunk_tokens=size, recompute=False, checkpoint_layers=True)
    for gib in args.budgets:  # the engine picks chunk size and recompute from an activation budget
        options[f"tree_{gib:g}GiB"] = dict(memory_budget_bytes=int(gib * 2**30))
    if args.auto:
        options["auto"] = {}  # no chunking options: the budget comes from the free memory
    return options


def describe_plan(model, tree, options):
    """The plan tree_backward will pick with ``options`` (call with the gradients unset, as in the step)."""
    head = value_head_of(model) if is_critic(model) else None
    plan = choose_plan(model, tree, device_of(model), checked_options(**options), head=head)
    memory = MemoryModel.of(model, head)
    return dict(
        chunk_tokens=plan.size,
        recompute=plan.recompute,
        chunks=plan.num_chunks,
        recomputed_tokens=plan.recomputed_tokens,
        logits_rows=plan.logits_rows or memory.logits_rows,
        checkpoint_layers=plan.checkpoint_layers,
        estimate_gib=memory.step_bytes(plan) / 2**30,
    )


def gate_entry(label: str, entry: dict, lp, grads, reference, drift: float) -> None:
    """The row's logprobs and gradients against flat's (``reference``), into ``entry``."""
    check = harness.Gate(
        label,
        dict(
            grad=harness.relative_error(grads.cpu(), reference[1]),
            logprob_max_abs=(lp.float().cpu() - reference[0]).abs().max().item(),
        ),
        dict(grad=max(GRAD_TOLERANCE, 2 * drift), logprob_max_abs=LOGPROB_TOLERANCE),
    )
    entry.update(
        grad_rel_err=check.errors["grad"], logprob_max_abs_diff=check.errors["logprob_max_abs"], gate_ok=check.ok
    )
    if not check.ok:
        print(f"gate {check}", flush=True)


def speed(model, model_name: str, batches: dict, args) -> list[dict]:
    """Rows of the speed table; ``batches``: key -> (display name, sequences)."""
    model.zero_grad(set_to_none=True)
    weights = harness.allocated_bytes()  # what a step starts from: the weights alone
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return [
        speed_row(model, model_name, key, name, sequences, args, weights + grads)
        for key, (name, sequences) in batches.items()
    ]


def speed_row(model, model_name: str, key: str, name: str, sequences, args, fixed_bytes: int) -> dict:
    """One batch's row: every method's warm-up step (result, gradients, peak; the gate against flat),
    then the timed steps round-robin. ``fixed_bytes``: the weights and their gradients."""
    tree = dta_fast.build_tree(sequences)
    chains = [PrefixTree.from_sequences([s]).to(device_of(model)) for s in sequences]
    flat_flops, tree_flops = flat_and_tree_flops(model, tree, sequences)
    loss_fn, packed_loss = losses(tree, is_critic(model))
    methods = {
        "flat": lambda: flat_step(model, chains, loss_fn),
        "flat_ckpt": lambda: flat_step(model, chains, loss_fn, checkpointing=True),
        "flat_kernel": lambda: flat_kernel_step(model, chains, loss_fn),
        "packed": lambda: packed_step(model, tree, packed_loss),
    }
    options = tree_options(args, tree.num_tokens)
    methods.update({label: None for label in options})
    if args.skip:
        methods = {k: v for k, v in methods.items() if k == "flat" or k not in args.skip}
    row = dict(
        batch=name,
        rollouts=BATCHES.get(key, key),
        model=model_name + (" critic" if is_critic(model) else ""),
        sequences=tree.num_sequences,
        flat_tokens=tree.flat_tokens,
        tree_tokens=tree.num_tokens,
        ideal_speedup=flat_flops / tree_flops,
        options=run_options(args),
        methods={},
    )
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
            harness.empty_cache()
            continue
        entry.update(seconds=seconds, peak_gib=peak, tokens_per_s=tree.flat_tokens / seconds)
        if repeats:
            timed[label] = (fn, repeats)
        if "plan" in entry:  # the estimate covers activations: add the weights and their gradients
            entry["estimate_total_gib"] = entry["plan"]["estimate_gib"] + fixed_bytes / 2**30
            entry["estimate_over_peak"] = entry["estimate_total_gib"] / peak if peak else None
        if label == "flat":
            reference = (lp.float().cpu(), grads.cpu())  # off the GPU: the tree rows' peaks are their own
            row["flat_peak_gib"] = peak
            budget_rows = {"tree_flatpeak": 1.0} if args.flatpeak else {}
            budget_rows.update({f"tree_budget_{x:g}x": x for x in args.sweep})
            for budget_label, x in budget_rows.items():
                budget = x * peak * 2**30 - fixed_bytes
                if budget > 0:
                    options[budget_label] = dict(memory_budget_bytes=int(budget))
                    fractions[budget_label] = x
                    methods[budget_label] = None
                    if args.checkpoint:  # the same budget without checkpointed layers, for comparison
                        options[budget_label + "_no_ckpt"] = dict(
                            memory_budget_bytes=int(budget), checkpoint_layers=False
                        )
                        fractions[budget_label + "_no_ckpt"] = x
                        methods[budget_label + "_no_ckpt"] = None
        elif reference is not None:
            drift = row["methods"].get("flat_kernel", {}).get("grad_rel_err", 0.0)
            gate_entry(f"{name}: {label}", entry, lp, grads, reference, drift)
        row["methods"][label] = entry
        del grads
        harness.empty_cache()
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
                if "estimate_total_gib" in entry and entry["peak_gib"]:
                    entry["estimate_over_peak"] = entry["estimate_total_gib"] / entry["peak_gib"]
    for label, values in times.items():
        entry = row["methods"][label]
        entry.update(
            seconds=harness.median(values), step_seconds=values, tokens_per_s=tree.flat_tokens / harness.median(values)
        )
        print(f"{name}: {label} {entry['seconds']:.3f} s, {entry['peak_gib']:.1f} GiB", flush=True)
    model.zero_grad(set_to_none=True)
    add_speedups(row, options)
    return row


def add_speedups(row: dict, options: dict) -> None:
    """Speedup over flat and fraction of the ideal for every row whose gate is green."""
    base = row["methods"].get("flat", {}).get("seconds")
    for label, entry in row["methods"].items():
        if label == "flat_kernel":
            continue
        if base and "seconds" in entry and entry.get("gate_ok", label.startswith("flat")):
            entry["speedup"] = base / entry["seconds"]
            entry["fraction_of_ideal"] = entry["speedup"] / row["ideal_speedup"]
    hand = {
        k: e["seconds"]
        for k, e in row["methods"].items()
        if "max_chunk_tokens" in options.get(k, {}) and e.get("gate_ok") and "seconds" in e
    }
    if hand:
        row["best_hand_picked"] = min(hand, key=hand.get)
        for label in ("auto", "tree_flatpeak"):
            if row["methods"].get(label, {}).get("gate_ok"):
                row[f"{label}_over_best"] = row["methods"][label]["seconds"] / hand[row["best_hand_picked"]]


def run_options(args) -> dict:
    """The options that decide a speed row's methods (rows of other options are kept beside it)."""
    return {
        k: getattr(args, k)
        for k in (
            "chunks",
            "budgets",
            "keep",
            "auto",
            "flatpeak",
            "checkpoint",
            "sweep",
            "skip",
            "repeats",
            "flat_repeats",
        )
    }


def print_speed(rows):
    table = []
    for row in rows:
        for label, e in row["methods"].items():
            if e.get("oom") or e.get("error"):
                table.append([row["batch"], label, "out of memory" if e.get("oom") else e["error"][:60]])
                continue
            plan = e.get("plan")
            plan = (
                (
                    f"{plan['chunk_tokens']} {'recompute' if plan['recompute'] else 'keep'} x{plan['chunks']}, "
                    f"windows of {plan['logits_rows']} rows"
                    + (", checkpointed layers" if plan.get("checkpoint_layers") else "")
                )
                if plan
                else ""
            )
            gate = "" if "gate_ok" not in e else ("ok" if e["gate_ok"] else "FAIL")
            table.append(
                [
                    row["batch"][:48],
                    label,
                    f"{e['seconds']:.3f}",
                    f"{e['tokens_per_s']:.0f}",
                    f"{e['peak_gib']:.1f}",
                    harness.cell(e.get("estimate_total_gib"), ".1f"),
                    harness.cell(e.get("speedup")),
                    f"{row['ideal_speedup']:.2f}",
                    harness.cell(e.get("fraction_of_ideal")),
                    gate,
                    plan,
                ]
            )
    harness.print_table(
        ["batch", "method", "s/step", "tok/s", "peak GiB", "est GiB", "speedup", "ideal", "of ideal", "gate", "plan"],
        table,
    )
    for row in rows:
        for label in ("auto", "tree_flatpeak"):
            if f"{label}_over_best" in row:
                best, ratio = row["best_hand_picked"], row[f"{label}_over_best"]
                print(f"{row['batch']}: {label} / best hand-picked ({best}): {ratio:.3f}")


def score(model, model_name: str, batches: dict, args) -> list[dict]:
    """Rows of the forward-only table (``score`` mode)."""
    return [score_row(model, model_name, key, name, sequences, args) for key, (name, sequences) in batches.items()]


def flat_scores(model, chains) -> list[torch.Tensor]:
    """Each sequence alone through the model's own forward: its logprobs."""
    head, out = model.get_output_embeddings(), []
    for chain in chains:
        hidden = model.model(input_ids=chain.tokens[None], use_cache=False).last_hidden_state[0]
        out.append(dta_fast.gather_logprobs_chunked(hidden, head, chain)[0])
    return out


def per_segment_scores(model, tree):
    """``tree_logprobs`` with each unbranched segment of a linear-attention layer one kernel call."""
    import dta_fast.linear_attention as linear

    installed = linear.fla_available
    linear.fla_available = lambda: False
    try:
        return dta_fast.tree_logprobs(model, tree)
    finally:
        linear.fla_available = installed


def score_row(model, model_name: str, key: str, name: str, sequences, args) -> dict:
    from dta_fast.linear_attention import fla_available

    tree = dta_fast.build_tree(sequences)
    chains = [PrefixTree.from_sequences([s]).to(device_of(model)) for s in sequences]
    flat_flops, tree_flops = flat_and_tree_flops(model, tree, sequences)
    methods = dict(flat=lambda: flat_scores(model, chains), tree=lambda: dta_fast.tree_logprobs(model, tree))
    if linear_layers_of(model) and fla_available():
        methods["tree_per_segment"] = lambda: per_segment_scores(model, tree)
    row = dict(batch=name, rollouts=BATCHES.get(key, key), model=model_name, flat_tokens=tree.flat_tokens,
               tree_tokens=tree.num_tokens, ideal_speedup=flat_flops / tree_flops, methods={})  # fmt: skip
    reference = None
    for label, fn in methods.items():
        with torch.no_grad():
            seconds, peak, lp = timed_step(model, fn)  # warm-up: the result and peak
            times = [timed_step(model, fn)[0] for _ in range(args.repeats)] or [seconds]
        entry = dict(seconds=harness.median(times), peak_gib=peak, step_seconds=times)
        if reference is None:
            reference = [x.float() for x in lp]
        else:
            error = max(float((lp[i, : x.numel()].float() - x).abs().max()) for i, x in enumerate(reference))
            entry.update(logprob_max_abs=error, gate_ok=error < LOGPROB_TOLERANCE)
        row["methods"][label] = entry
        print(f"{name}: {label} {entry['seconds']:.3f} s, {peak:.1f} GiB", flush=True)
    base = row["methods"]["flat"]["seconds"]
    for entry in row["methods"].values():
        if entry.get("gate_ok"):
            entry["speedup"] = base / entry["seconds"]
    return row


def print_score(rows):
    table = [
        [row["batch"][:48], label, f"{e['seconds']:.3f}", f"{e['peak_gib']:.1f}", harness.cell(e.get("speedup")),
         f"{row['ideal_speedup']:.2f}", "" if "gate_ok" not in e else ("ok" if e["gate_ok"] else "FAIL")]
        for row in rows
        for label, e in row["methods"].items()
    ]  # fmt: skip
    harness.print_table(["batch", "method", "s/forward", "peak GiB", "speedup", "ideal", "gate"], table)


def memory(model, model_name: str, args) -> list[dict]:
    rows = []
    chunk = args.chunks[0] if args.chunks and args.chunks[0] else 8192
    vocab = model.config.vocab_size
    for tasks in args.tasks:
        rollouts = shapes.long_paths(tasks)
        tree = PrefixTree.from_sequences(rollouts.sequences(vocab))
        loss_fn = SFTLoss(tree.logprob_mask)
        row = dict(
            forest=rollouts.name,
            model=model_name,
            tree_tokens=tree.num_tokens,
            flat_tokens=tree.flat_tokens,
            longest_path=int(tree.lengths.max()),
            chunk_tokens=chunk,
        )
        try:
            step = lambda t=tree, f=loss_fn: dta_fast.tree_backward(model, t, f, max_chunk_tokens=chunk)  # noqa: E731
            seconds, peak, _ = timed_step(model, step)
            row.update(seconds=seconds, peak_gib=peak)
        except torch.cuda.OutOfMemoryError:
            row.update(oom=True)
        model.zero_grad(set_to_none=True)
        harness.empty_cache()
        print(row, flush=True)
        rows.append(row)
    # the longest single sequence, alone, without and with activation checkpointing
    longest = shapes.ROLLOUTS["agentic_long_1x1"].sequences(vocab)
    chains = [PrefixTree.from_sequences(longest).to(device_of(model))]
    loss_fn = SFTLoss(torch.ones(1, len(longest[0]) - 1))
    for label, ckpt in (("flat one 32K sequence", False), ("flat_ckpt one 32K sequence", True)):
        try:
            seconds, peak, _ = timed_step(model, lambda c=ckpt: flat_step(model, chains, loss_fn, c))
            rows.append(dict(forest=label, model=model_name, seconds=seconds, peak_gib=peak))
        except torch.cuda.OutOfMemoryError:
            rows.append(dict(forest=label, model=model_name, oom=True))
        model.zero_grad(set_to_none=True)
        harness.empty_cache()
        print(rows[-1], flush=True)
    return rows


def print_memory(rows):
    table = [
        [
            r["forest"],
            r.get("tree_tokens", "-"),
            r.get("flat_tokens", "-"),
            r.get("longest_path", "-"),
            r.get("chunk_tokens", "-"),
            "-" if r.get("oom") else f"{r['seconds']:.2f}",
            "OOM" if r.get("oom") else f"{r['peak_gib']:.1f}",
        ]
        for r in rows
    ]
    harness.print_table(["forest", "tree tokens", "flat tokens", "path", "chunks of", "s/step", "peak GiB"], table)


def plan_rows(model, tree, budgets) -> list[dict]:
    """Planning times, ms (best of 5, of 3 for the searches): the forest arrays, plan_chunks at several
    sizes, chunk_tokens_for_budget and the automatic choice (plan_for_budget) at ``budgets`` GiB."""
    memory, forest = MemoryModel.of(model), Forest.of(tree)

    def best_ms(fn, repeats=5):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            try:
                result = fn()
            except ValueError:  # a budget nothing fits
                result = None
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3, result

    rows = [dict(what="forest arrays", ms=best_ms(lambda: Forest.of(tree))[0])]
    for size in (1024, 4096, 8192, 16384):
        for recompute in (False, True):
            ms, plan = best_ms(lambda size=size, recompute=recompute: plan_chunks(tree, size, recompute))
            rows.append(
                dict(
                    what=f"plan, chunks of {size}, {'recompute' if recompute else 'keep'}",
                    ms=ms,
                    chunks=plan.num_chunks,
                )
            )
    for gib in budgets:
        budget = int(gib * 2**30)
        for recompute in (False, True):
            ms, size = best_ms(lambda b=budget, r=recompute: chunk_tokens_for_budget(model, tree, b, recompute=r), 3)
            rows.append(
                dict(
                    what=f"chunk_tokens_for_budget {gib:g} GiB, {'recompute' if recompute else 'keep'}",
                    ms=ms,
                    chunk_tokens=size or "too small",
                )
            )
        ms, plan = best_ms(lambda b=budget: plan_for_budget(memory, forest, b), 3)
        chosen = (
            dict(chunk_tokens=plan.size, recompute=plan.recompute, checkpoint_layers=plan.checkpoint_layers)
            if plan is not None
            else dict(chunk_tokens="too small")
        )
        rows.append(dict(what=f"automatic choice at {gib:g} GiB", ms=ms, **chosen))
    return rows


def print_plan(rows, tree, model_name):
    print(f"\n{tree.num_tokens} unique tokens, longest path {int(tree.lengths.max())}, {model_name} shape, one thread")
    harness.print_table(
        ["what", "ms", "result"],
        [[r["what"], f"{r['ms']:.1f}", {k: v for k, v in r.items() if k not in ("what", "ms", "model")}] for r in rows],
    )


def plot_budget(rows, path):
    """Step time against the memory budget (weights, gradients and activations), per-sequence marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in rows if any("flat_peak_fraction" in e for e in r["methods"].values())]
    if not rows:
        return
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        flat = row["methods"]["flat"]
        for without, name in (
            (False, "tree_backward, memory_budget_bytes"),
            (True, "... with checkpoint_layers=False"),
        ):
            points = sorted(
                (e["flat_peak_fraction"] * row["flat_peak_gib"], e["seconds"], e["peak_gib"])
                for label, e in row["methods"].items()
                if "flat_peak_fraction" in e and "seconds" in e and label.endswith("_no_ckpt") == without
            )
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
        ax.set_title(f"{row['model']}, {row['batch'][:50]}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_memory(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    pts = sorted((r for r in rows if "tree_tokens" in r and not r.get("oom")), key=lambda r: r["tree_tokens"])
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
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["speed", "score", "memory", "plan"])
    p.add_argument("--model", default=None, choices=[m for m in shapes.MODELS if m != "llama-24m"])
    p.add_argument("--batches", nargs="+", default=["grpo", "agentic"], choices=list(BATCHES))
    p.add_argument("--chunks", nargs="+", type=int, default=[0, 8192, 2048], help="0 means one chunk")
    p.add_argument("--budgets", nargs="*", type=float, default=[], help="tree_backward memory budgets, GiB")
    p.add_argument("--tasks", nargs="+", type=int, default=[1, 2, 4, 10])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="also run each chunk size with recompute=False")
    p.add_argument("--auto", action="store_true", help="a row with no chunking options (budget from free memory)")
    p.add_argument("--flatpeak", action="store_true", help="a row whose budget is per-sequence training's peak")
    p.add_argument(
        "--checkpoint",
        action="store_true",
        help="rows with checkpointed layers at each chunk size, and each budget row without them",
    )
    p.add_argument("--sweep", nargs="*", type=float, default=[], help="budget rows at these fractions of flat's peak")
    p.add_argument("--flat-repeats", type=int, default=None, help="repeats of flat (default: --repeats)")
    p.add_argument("--skip", nargs="*", default=[], help="methods to leave out (flat always runs)")
    p.add_argument("--critic", action="store_true", help="train the model as a critic: value head, value loss")
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    args.model = args.model or ("qwen3-1.7b" if args.mode == "memory" else "qwen2-0.5b")
    args.flat_repeats = args.repeats if args.flat_repeats is None else args.flat_repeats
    if args.mode == "plan":
        torch.set_num_threads(1)
        model = shapes.build_model(args.model, device="meta")
        tree = dta_fast.build_tree(shapes.ROLLOUTS["agentic_long_10x4"].sequences(model.config.vocab_size))
        rows = [dict(r, model=args.model) for r in plan_rows(model, tree, args.budgets or (20, 40, 60))]
        harness.write_results(
            "training_plan", rows, args.out, gpu="CPU", key=lambda r: (r["model"], r["what"]), threads=1
        )
        print_plan(rows, tree, args.model)
        return
    model = shapes.build_model(args.model, head="value" if args.critic else "lm")
    if args.mode == "speed":
        batches = {key: batch(key, model.config.vocab_size) for key in args.batches}
        rows = speed(model, args.model, batches, args)
        path = harness.write_results(
            "training_speed", rows, args.out, key=lambda r: (r["model"], r["batch"], r.get("options"))
        )
        if args.sweep:
            plot_budget(rows, path.with_name(f"{path.stem}_budget_{args.model}.png"))
        print_speed(rows)
    elif args.mode == "score":
        batches = {key: batch(key, model.config.vocab_size) for key in args.batches}
        rows = score(model, args.model, batches, args)
        harness.write_results("training_score", rows, args.out, key=lambda r: (r["model"], r["batch"]))
        print_score(rows)
    else:
        rows = memory(model, args.model, args)
        path = harness.write_results(
            "training_memory", rows, args.out, key=lambda r: (r["model"], r["forest"], r.get("chunk_tokens"))
        )
        plot_memory(rows, path.with_suffix(".png"))
        print_memory(rows)


if __name__ == "__main__":
    main()
