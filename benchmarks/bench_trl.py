"""TRL GRPO training steps: GRPOTrainer against TreeGRPOTrainer on the tensors TRL passes.

    python benchmarks/bench_trl.py [--groups P1K-G8-R1K P2K-G8-R1K P2K-G16-R1K] [--repeats 3] [--reentrant] [--out DIR]
    python benchmarks/bench_trl.py --full-step [--steps 12] [--train-seconds 150] [--prompts 2] [--group 8]
                                   [--prompt-pool N]

One micro-batch per prompt: the G completions of a shapes.ROLLOUTS GRPO set (up to R tokens, lengths
spread over [R/2, R], right-padded) after its prompt of P tokens, laid out as GRPOTrainer lays it out
(``prompt_ids``/``prompt_mask`` | ``completion_ids``/``completion_mask``, advantages, old logprobs).
Both trainers are built with the same GRPOConfig on the Qwen2-0.5B shape (shapes.MODELS, random
weights, bf16, a word-level tokenizer built in code) and each step is the trainer's own
``_compute_loss`` followed by ``backward``, with gradient checkpointing off and on (GRPOConfig's
default). Gate, before any timing: one step of each trainer and one of GRPOTrainer in float32 from
the same weights; the tree's loss and gradients are no farther from the float32 step than twice
GRPOTrainer's bf16 step is, plus 1e-3 (two bf16 steps differ by rounding: 4-5% in gradients on these
shapes); a red gate leaves the pair untimed. Timed with CUDA events (median of ``--repeats`` after the
gate's step), peak memory per step; the per-call cost of building the tree from the padded batch is
timed on its own. Writes results/trl_grpo_<GPU>.json and prints the table last.

``--full-step``: whole steps of ``trainer.train()`` (generation, rewards, scoring, training) on
bench_rollout.py's templated task, whose policy (``llama-24m``, pretrained for ``--train-seconds``)
converges, so completions repeat: GRPOTrainer (transformers' generate) against TreeGRPOTrainer with
``tree_generation`` (the tree cache drafts). The reward is the share of the template a completion
follows. The dataset holds ``--prompt-pool`` prompts (default: one step's), which the steps cycle
through: a prompt's earlier completions are in the cache from its second visit on. Gate, before
timing: the first steps of GRPOTrainer and of TreeGRPOTrainer generating the same way (generate, the
same seeds) log the same losses and entropies. The cached sampler draws other samples from the same
distribution, so the timed runs compare reward curves, not losses. Seconds per step are medians over
the steps after ``--warmup`` (the cache warm); peak memory over the run. Writes
results/trl_full_step_<GPU>.json and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import bench_rollout as task
import harness
import shapes
import torch

GROUPS = {"P1K-G8-R1K": "grpo_p1k_n8_r1k", "P2K-G8-R1K": "grpo_p2k_n8_r1k", "P2K-G16-R1K": "grpo_p2k_n16_r1k"}
MODEL = "qwen2-0.5b"
LOSS_TOLERANCE = 2e-2  # --full-step: the two trainers generating alike log these losses and entropies
GATE_FLOOR = 1e-3  # the step's gate: the tree within 2 x GRPOTrainer's bf16 distance from float32, plus this
ANSWER_TOKENS = len(task.make_answer(task.make_prompt(random.Random(0)), random.Random(0)))  # EOS included


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2, "a": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_trainer(
    trainer_cls, config_cls, model, group_size, completion_length, checkpointing, out_dir, bf16=True, reentrant=False
):  # fmt: skip
    import datasets

    args = config_cls(
        output_dir=out_dir,
        per_device_train_batch_size=group_size,
        num_generations=group_size,
        max_completion_length=completion_length,
        bf16=bf16,
        gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": reentrant},
        report_to="none",
        save_strategy="no",
    )
    trainer = trainer_cls(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["a"] * group_size}),
        processing_class=tokenizer(),
    )
    # set by the training loop, which this step skips
    trainer.current_gradient_accumulation_steps = 1
    if checkpointing:
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    else:
        trainer.model.gradient_checkpointing_disable()
    return trainer


def micro_batch(prompt_length, group_size, completion_length, vocab, seed=0, device="cuda"):
    """One prompt and its G completions, as GRPOTrainer hands them to _compute_loss."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (prompt_length,), generator=gen)
    lengths = torch.randint(completion_length // 2, completion_length + 1, (group_size,), generator=gen)
    completion_ids = torch.randint(3, vocab, (group_size, completion_length), generator=gen)
    completion_mask = (torch.arange(completion_length) < lengths[:, None]).long()
    completion_ids = completion_ids * completion_mask  # pad id 0
    advantages = torch.randn(group_size, generator=gen)
    inputs = dict(
        prompt_ids=prompt.expand(group_size, -1).clone(),
        prompt_mask=torch.ones(group_size, prompt_length).long(),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=advantages,
        num_items_in_batch=completion_mask.sum().float(),
    )
    return {k: v.to(device) for k, v in inputs.items()}


def ideal_speedup(model, prompt_length, lengths):
    """FLOPs of every sequence alone over the tree's.

    6 per dense parameter per token, attention per (query, key) pair, and the
    vocabulary projection of the scored (completion) tokens, the same in both.
    """
    cfg = model.config
    dense = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    per_pair = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    head = 6 * cfg.hidden_size * cfg.vocab_size * sum(lengths)
    flat_tokens = sum(prompt_length + n for n in lengths)
    flat_pairs = sum((prompt_length + n) * (prompt_length + n + 1) // 2 for n in lengths)
    tree_tokens = prompt_length + sum(lengths)
    tree_pairs = prompt_length * (prompt_length + 1) // 2 + sum(n * prompt_length + n * (n + 1) // 2 for n in lengths)
    return (6 * dense * flat_tokens + per_pair * flat_pairs + head) / (
        6 * dense * tree_tokens + per_pair * tree_pairs + head
    )


def behaviour_logprobs(trainer, inputs, spread=0.05):
    """The policy's own logprobs (GRPOTrainer's path) plus noise: old logprobs whose ratios sit near 1."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, inputs["completion_ids"].shape[1]
        )
    noise = torch.randn(logps.shape, generator=torch.Generator().manual_seed(1)).to(logps)
    return (logps.float() + spread * noise) * inputs["completion_mask"]


def step_result(trainer, inputs):
    """Peak GiB, loss, logprobs and gradients of one _compute_loss + backward from unset gradients."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    harness.reset_peak()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    harness.sync()
    peak = harness.peak_allocated_gib()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]).cpu()
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, inputs["completion_ids"].shape[1])
    return peak, float(loss), logps.float(), grads


def step_seconds(trainer, inputs, repeats):
    """Median seconds (CUDA events) and peak GiB of ``repeats`` steps of _compute_loss + backward."""
    model = trainer.model

    def step():
        model.zero_grad(set_to_none=True)
        trainer._compute_loss(model, inputs).backward()

    harness.reset_peak()
    times = harness.event_times(step, n=repeats)
    return harness.median(times) / 1e3, harness.peak_allocated_gib()


def trl_gate(name, base, tree, truth, mask) -> tuple[harness.Gate, float]:
    """TreeGRPOTrainer's bf16 step against GRPOTrainer's, each (peak, loss, logprobs, grads): the tree's loss
    and gradients no farther from ``truth`` (GRPOTrainer in float32 from the same weights) than twice
    GRPOTrainer's own bf16 step is, plus GATE_FLOOR (two bf16 steps differ by their rounding, which no
    fixed tolerance bounds); and the logprobs' largest difference from GRPOTrainer's (recorded)."""

    def distances(step):
        loss = abs(step[1] - truth[1]) / max(abs(truth[1]), 1e-12)
        return dict(loss=loss, grad=harness.relative_error(step[3], truth[3]))

    errors, allowed = distances(tree), distances(base)
    check = harness.Gate(name, errors, {k: 2 * v + GATE_FLOOR for k, v in allowed.items()})
    return check, float((tree[2] - base[2])[mask].abs().max())


def float32_step(trainer_cls, config_cls, weights32, state, group_size, completion_length, out_dir, inputs):
    """``step_result`` of a float32 trainer (no autocast) on float32 weights loaded from ``state``, under
    gradient checkpointing (what fits): the gate's truth. The trainer puts the weights on its device; they
    go back to the CPU after."""
    weights32.load_state_dict(state)
    trainer = build_trainer(
        trainer_cls, config_cls, weights32, group_size, completion_length, True, out_dir, bf16=False
    )  # fmt: skip
    result = step_result(trainer, inputs)
    weights32.zero_grad(set_to_none=True)
    weights32.to("cpu")
    del trainer
    harness.empty_cache()
    return result


def tree_build_ms(inputs, repeats=5):
    from dta_fast import build_tree
    from dta_ref import PaddedLayout

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        layout = PaddedLayout.of(mask)
        build_tree(layout.sequences(ids))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


# ------------------------------------------------------------------ --full-step


def vocab_tokenizer(size: int):
    """A word-level tokenizer of ``size`` tokens "t0".."t{size-1}" (t0 pads, bench_rollout's EOS ends)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = f"t{task.EOS}"
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token=eos, unk_token="t0")


def template_share(prompt: list[int], completion: list[int]) -> float:
    """The share of bench_rollout's answer template (any choices) that ``completion`` follows from its start."""
    keys, pos = prompt[1:9], 0
    for j in range(task.BLOCKS):
        head = [100 + j] + keys + task.PHRASES[j % 4]
        choice = completion[pos + len(head)] if pos + len(head) < len(completion) else None
        block = head + ([choice] + task.FILLERS[choice] + keys[::-1] if choice in task.CHOICES else [None])
        for token in block:
            if pos >= len(completion) or completion[pos] != token:
                return pos / ANSWER_TOKENS
            pos += 1
    return (pos + (completion[pos:] == [task.EOS])) / ANSWER_TOKENS


class StepClock:
    """A trainer callback: the wall seconds of each optimizer step (generation included), synced, of
    its part inside the trainer's method that ``watch`` wraps (generation, rewards and scoring), and
    the Triton compiles in it (count and seconds, while ``compiles`` is entered)."""

    def __init__(self):
        self.seconds, self.generation_seconds, self._start, self._inside = [], [], None, 0.0
        self.compiles, self._compiled = harness.TritonCompiles(), None
        self.compile_counts, self.compile_seconds = [], []

    def watch(self, trainer, method: str = "_generate_and_score_completions"):
        inner = getattr(trainer, method)

        def timed(*args, **kwargs):
            harness.sync()
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            harness.sync()
            self._inside += time.perf_counter() - start
            return out

        setattr(trainer, method, timed)

    def on_step_begin(self, args, state, control, **kwargs):
        harness.sync()
        self._start, self._inside = time.perf_counter(), 0.0
        self._compiled = self.compiles.count, self.compiles.seconds

    def on_step_end(self, args, state, control, **kwargs):
        harness.sync()
        self.seconds.append(time.perf_counter() - self._start)
        self.generation_seconds.append(self._inside)
        self.compile_counts.append(self.compiles.count - self._compiled[0])
        self.compile_seconds.append(self.compiles.seconds - self._compiled[1])

    def __getattr__(self, name):  # the other TrainerCallback events: nothing to do
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


def full_step_run(trainer_cls, config_cls, model_dir, prompts, args, out_dir, **options):
    """One ``trainer.train()`` of ``args.steps`` steps: (its StepClock, peak GiB, log history)."""
    import datasets

    device_kw = {} if torch.cuda.is_available() else dict(use_cpu=True)
    config = config_cls(
        output_dir=out_dir, per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        max_completion_length=args.max_completion, max_steps=args.steps, learning_rate=args.lr, beta=0.0,
        temperature=1.0, logging_steps=1, report_to="none", save_strategy="no", seed=0,
        bf16=torch.cuda.is_available(), dataloader_num_workers=0, **device_kw, **options,
    )  # fmt: skip
    rows = [{"prompt": " ".join(f"t{t}" for t in p), "prompt_tokens": p} for p in prompts]

    def reward(completion_ids, prompt_tokens, **kwargs):
        return [template_share(p, c) for p, c in zip(prompt_tokens, completion_ids, strict=True)]

    clock = StepClock()
    torch.manual_seed(0)
    trainer = trainer_cls(
        model=model_dir, reward_funcs=reward, args=config, train_dataset=datasets.Dataset.from_list(rows),
        processing_class=vocab_tokenizer(task.VOCAB), callbacks=[clock],
    )  # fmt: skip
    clock.watch(trainer)
    harness.empty_cache()
    harness.reset_peak()
    with clock.compiles:
        trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return clock, harness.peak_allocated_gib(), logs


def full_step(args) -> dict:
    """The --full-step row: the gate, then both trainers' timed runs."""
    from trl import GRPOConfig, GRPOTrainer

    from dta_fast.trl import TreeGRPOConfig, TreeGRPOTrainer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = task.build_model(device)
    pretraining = task.train(model, args.train_seconds, 16, device, print)
    rng = random.Random(7)
    # the dataset: --prompt-pool prompts, revisited as the steps cycle through it (by default one step's
    # worth, so every step is a new epoch over the same prompts and the cache has their earlier completions)
    prompts = [task.make_prompt(rng) for _ in range(args.prompt_pool or args.prompts)]
    row = dict(model=task.MODEL, pretraining=pretraining, prompts_per_step=args.prompts, prompt_pool=len(prompts),
               group=args.group, max_completion=args.max_completion, steps=args.steps, warmup=args.warmup,
               runs={})  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(f"{tmp}/policy")
        del model
        gate_args = argparse.Namespace(**{**vars(args), "steps": args.gate_steps})
        _, _, base = full_step_run(GRPOTrainer, GRPOConfig, f"{tmp}/policy", prompts, gate_args, f"{tmp}/g0")
        _, _, tree = full_step_run(TreeGRPOTrainer, TreeGRPOConfig, f"{tmp}/policy", prompts, gate_args, f"{tmp}/g1")
        # the loss, and the entropy (the scoring's, nonzero whatever the rewards), step by step
        errors = {
            key: max(abs(t[key] - b[key]) / max(abs(b[key]), 1e-3) for b, t in zip(base, tree, strict=True))
            for key in ("loss", "entropy")
        }
        row["gate"] = dict(rel_diff=errors, ok=len(base) == len(tree) > 0 and max(errors.values()) <= LOSS_TOLERANCE)
        print(f"gate: {errors}", flush=True)
        if not row["gate"]["ok"]:
            return row
        runs = {
            "GRPOTrainer": (GRPOTrainer, GRPOConfig, {}),
            "TreeGRPOTrainer": (TreeGRPOTrainer, TreeGRPOConfig, dict(tree_generation=True)),
        }
        for name, (trainer_cls, config_cls, options) in runs.items():
            clock, peak, logs = full_step_run(
                trainer_cls, config_cls, f"{tmp}/policy", prompts, args, f"{tmp}/{name}", **options
            )  # fmt: skip
            seconds = clock.seconds
            row["runs"][name] = dict(
                step_seconds=seconds,
                generation_seconds=clock.generation_seconds,  # generation, rewards and scoring in each step
                triton_compiles=clock.compile_counts,  # a step's first calls at new kernel specialisations
                triton_compile_seconds=clock.compile_seconds,
                seconds=harness.median(seconds[args.warmup :] or seconds),
                peak_gib=peak,
                reward=[e.get("reward") for e in logs],
                accepted_draft_tokens=[e.get("tree/accepted_draft_tokens") for e in logs],
            )
            print(f"{name}: {row['runs'][name]['seconds']:.3f} s/step, {peak:.2f} GiB", flush=True)
    base, tree = row["runs"]["GRPOTrainer"], row["runs"]["TreeGRPOTrainer"]
    row["speedup"] = base["seconds"] / tree["seconds"]
    return row


def print_full_step(row) -> None:
    runs = row["runs"]
    table = [
        [
            name,
            f"{r['seconds']:.3f}",
            f"{harness.median(r['generation_seconds'][row['warmup'] :] or r['generation_seconds']):.3f}",
            f"{r['peak_gib']:.2f}",
            " ".join(f"{x:.2f}" for x in r["reward"] if x is not None),
        ]
        for name, r in runs.items()
    ]
    harness.print_table(
        ["trainer", "s/step", "of it generating", "peak GiB", "reward per step"],
        table,
        title=f"{harness.device_name()}; trainer.train() steps after {row['warmup']}; speedup "
        f"{harness.cell(row.get('speedup'))}; gate {'ok' if row['gate']['ok'] else 'FAIL'}",
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--reentrant", action="store_true",
        help="checkpoint both trainers' layers with use_reentrant=True (TRL's default: False)",
    )  # fmt: skip
    p.add_argument("--full-step", action="store_true", help="whole trainer.train() steps on a converging task")
    p.add_argument("--steps", type=int, default=12, help="--full-step: optimizer steps per trainer")
    p.add_argument("--warmup", type=int, default=4, help="--full-step: steps left out of the median")
    p.add_argument("--gate-steps", type=int, default=2, help="--full-step: steps of the gate's runs")
    p.add_argument("--train-seconds", type=float, default=150, help="--full-step: the policy's pretraining")
    p.add_argument("--prompts", type=int, default=2, help="--full-step: prompts per step")
    p.add_argument("--group", type=int, default=8, help="--full-step: completions per prompt")
    p.add_argument(
        "--prompt-pool",
        type=int,
        default=None,
        help="--full-step: distinct prompts in the dataset, which the steps cycle through (default: "
        "--prompts, the same prompts every step)",
    )
    p.add_argument("--max-completion", type=int, default=1200, help="--full-step: max_completion_length")
    p.add_argument("--lr", type=float, default=1e-6, help="--full-step: learning rate")
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.full_step:
        row = full_step(args)
        harness.write_results("trl_full_step", [row], args.out)
        print_full_step(row) if row["runs"] else print(f"gate FAILED: {row['gate']}")
        return
    from trl import GRPOConfig, GRPOTrainer

    from dta_fast.trl import TreeGRPOConfig, TreeGRPOTrainer

    weights = shapes.build_model(MODEL)
    state = {k: v.clone() for k, v in weights.state_dict().items()}
    # the gate's float32 step, of the same weights; kept on the CPU between steps (the peaks stay the trainers')
    weights32 = shapes.build_model(MODEL, device="cpu", dtype=torch.float32)
    trainers = (("GRPOTrainer", GRPOTrainer, GRPOConfig), ("TreeGRPOTrainer", TreeGRPOTrainer, TreeGRPOConfig))
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for key in args.groups:
            grpo = shapes.ROLLOUTS[GROUPS[key]]
            P, G, R = grpo.prompt, grpo.responses, grpo.response
            inputs = micro_batch(P, G, R, weights.config.vocab_size)
            lengths = inputs["completion_mask"].sum(1).tolist()
            row = dict(
                group=key,
                rollouts=GROUPS[key],
                prompt=P,
                completions=G,
                completion_length=R,
                completion_tokens=sum(lengths),
                ideal_speedup=ideal_speedup(weights, P, lengths),
                tree_build_ms=tree_build_ms(inputs),
                use_reentrant=args.reentrant,
                runs={},
            )
            truth = None  # GRPOTrainer's step in float32 from the same weights: what both bf16 steps approximate
            for checkpointing in (False, True):
                built, results = {}, {}
                for name, trainer_cls, config_cls in trainers:  # the gate's step of each, first
                    weights.load_state_dict(state)
                    built[name] = build_trainer(
                        trainer_cls, config_cls, weights, G, R, checkpointing, out_dir, reentrant=args.reentrant
                    )  # fmt: skip
                    if "old_per_token_logps" not in inputs:  # near the policy, so the loss depends on the logprobs
                        inputs["old_per_token_logps"] = behaviour_logprobs(built[name], inputs)
                    try:
                        results[name] = step_result(built[name], inputs)
                    except torch.OutOfMemoryError:
                        results[name] = None
                    harness.empty_cache()
                base, tree = results["GRPOTrainer"], results["TreeGRPOTrainer"]
                truth = truth or float32_step(GRPOTrainer, GRPOConfig, weights32, state, G, R, out_dir, inputs)
                run = {}
                if base and tree:
                    check, logprob_diff = trl_gate(
                        f"{key}, checkpointing {checkpointing}", base, tree, truth, inputs["completion_mask"].bool()
                    )
                    run.update(
                        loss_rel_diff=check.errors["loss"],  # the tree's bf16 step from the float32 one
                        grad_rel_diff=check.errors["grad"],
                        allowed=check.tolerance,
                        logprob_max_abs_diff=logprob_diff,
                        gate=check.ok,
                    )
                    if not check.ok:
                        print(f"gate {check}", flush=True)
                for name, res in results.items():  # a trainer is timed alone only where the other ran out
                    if res is None or (base and tree and not run["gate"]):
                        run[name] = None if res is None else dict(loss=res[1])
                        continue
                    seconds, peak = step_seconds(built[name], inputs, args.repeats)
                    run[name] = dict(step_s=seconds, peak_gib=max(peak, res[0]), loss=res[1])
                if run.get("gate") and run["GRPOTrainer"] and run["TreeGRPOTrainer"]:
                    run["speedup"] = run["GRPOTrainer"]["step_s"] / run["TreeGRPOTrainer"]["step_s"]
                    run["fraction_of_ideal"] = run["speedup"] / row["ideal_speedup"]
                del built, results
                harness.empty_cache()
                row["runs"]["ckpt" if checkpointing else "no_ckpt"] = run
                print(json.dumps({key: {"ckpt" if checkpointing else "no_ckpt": run}}), flush=True)
            rows.append(row)
            harness.write_results(
                "trl_grpo",
                rows,
                args.out,
                key=lambda r: (r["group"], r.get("use_reentrant", False)),
                model=f"{MODEL} shape, bf16, sdpa",
            )
    print_table(rows)


def print_table(rows):
    def fmt(r, k):
        return f"{r[k]:.3f}" if r and k in r else ("OOM" if r is None else "-")

    table = []
    for row in rows:
        for mode, run in row["runs"].items():
            b, t = run.get("GRPOTrainer"), run.get("TreeGRPOTrainer")
            gate = "-" if "gate" not in run else ("ok" if run["gate"] else "FAIL")
            table.append(
                [
                    row["group"],
                    ("reentrant" if row.get("use_reentrant") else "on") if mode == "ckpt" else "off",
                    fmt(b, "step_s"),
                    fmt(b, "peak_gib"),
                    fmt(t, "step_s"),
                    fmt(t, "peak_gib"),
                    harness.cell(run.get("speedup")),
                    f"{row['ideal_speedup']:.2f}",
                    harness.cell(run.get("fraction_of_ideal")),
                    f"{row['tree_build_ms']:.1f}",
                    gate,
                ]
            )
    harness.print_table(
        ["group", "ckpt", "GRPOTrainer s", "GiB", "Tree s", "GiB", "speedup", "ideal", "of ideal", "build ms", "gate"],
        table,
        title=f"{harness.device_name()}; _compute_loss + backward per micro-batch (one prompt, G "
        "completions); CUDA-event medians",
    )


if __name__ == "__main__":
    main()
