"""TRL GRPO training steps: GRPOTrainer against TreeGRPOTrainer on the tensors TRL passes.

One micro-batch per prompt: G completions of up to R tokens (lengths spread
over [R/2, R], right-padded) after a prompt of P tokens, laid out as
GRPOTrainer lays it out (``prompt_ids``/``prompt_mask`` | ``completion_ids``/
``completion_mask``, advantages, old logprobs). Both trainers are built
with the same GRPOConfig on a Qwen2-0.5B-shaped model (random weights, bf16,
a word-level tokenizer built in code) and each step is the trainer's own
``_compute_loss`` followed by ``backward``, with gradient checkpointing off
and on (GRPOConfig's default). Timed with CUDA events (median after
warm-up), peak memory per step; the per-call cost of building the tree from
the padded batch is timed on its own. Gate: the two trainers' losses,
per-token logprobs and gradients agree within bf16 rounding.

    python benchmarks/bench_trl.py                      # writes benchmarks/results/trl_grpo_<GPU>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

GROUPS = {"P1K-G8-R1K": (1024, 8, 1024), "P2K-G8-R1K": (2048, 8, 1024), "P2K-G16-R1K": (2048, 16, 1024)}
QWEN2_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, head_dim=64, rope_theta=1e6, max_position_embeddings=32768, attention_dropout=0.0,
    tie_word_embeddings=True,
)  # fmt: skip


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2, "a": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_trainer(trainer_cls, config_cls, model, group_size, completion_length, checkpointing, out_dir):
    import datasets

    args = config_cls(
        output_dir=out_dir, per_device_train_batch_size=group_size, num_generations=group_size,
        max_completion_length=completion_length, bf16=True, gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, report_to="none", save_strategy="no",
    )  # fmt: skip
    trainer = trainer_cls(
        model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["a"] * group_size}), processing_class=tokenizer(),
    )  # fmt: skip
    # set by the training loop, which this step skips
    trainer.current_gradient_accumulation_steps = 1
    if checkpointing:
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    else:
        trainer.model.gradient_checkpointing_disable()
    return trainer


def micro_batch(prompt_length, group_size, completion_length, vocab, seed=0):
    """One prompt and its G completions, as GRPOTrainer hands them to _compute_loss."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (prompt_length,), generator=gen)
    lengths = torch.randint(completion_length // 2, completion_length + 1, (group_size,), generator=gen)
    completion_ids = torch.randint(3, vocab, (group_size, completion_length), generator=gen)
    completion_mask = (torch.arange(completion_length) < lengths[:, None]).long()
    completion_ids = completion_ids * completion_mask  # pad id 0
    advantages = torch.randn(group_size, generator=gen)
    inputs = dict(
        prompt_ids=prompt.expand(group_size, -1).clone(), prompt_mask=torch.ones(group_size, prompt_length).long(),
        completion_ids=completion_ids, completion_mask=completion_mask, advantages=advantages,
        num_items_in_batch=completion_mask.sum().float(),
    )  # fmt: skip
    return {k: v.cuda() for k, v in inputs.items()}


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
    return (6 * dense * flat_tokens + per_pair * flat_pairs + head) / (6 * dense * tree_tokens + per_pair * tree_pairs + head)


def behaviour_logprobs(trainer, inputs, spread=0.05):
    """The policy's own logprobs (GRPOTrainer's path) plus noise: old logprobs whose ratios sit near 1."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, inputs["completion_ids"].shape[1])
    noise = torch.randn(logps.shape, generator=torch.Generator().manual_seed(1)).to(logps)
    return (logps.float() + spread * noise) * inputs["completion_mask"]


def timed_step(trainer, inputs, repeats):
    """Median step (CUDA events), peak GiB, loss, logprobs and gradients of _compute_loss + backward."""
    model = trainer.model
    times, peak = [], 0.0
    for r in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        if r:
            times.append(start.elapsed_time(end) / 1e3)
        peak = max(peak, torch.cuda.max_memory_allocated() / 2**30)
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, inputs["completion_ids"].shape[1])
    return statistics.median(times), peak, float(loss), logps.float(), grads


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from dta_fast.trl import TreeGRPOConfig, TreeGRPOTrainer

    config = transformers.Qwen2Config(**QWEN2_05B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        weights = transformers.Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    state = {k: v.clone() for k, v in weights.state_dict().items()}
    gpu = torch.cuda.get_device_name()
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for key in args.groups:
            P, G, R = GROUPS[key]
            inputs = micro_batch(P, G, R, config.vocab_size)
            lengths = inputs["completion_mask"].sum(1).tolist()
            row = dict(group=key, prompt=P, completions=G, completion_length=R, completion_tokens=sum(lengths),
                       ideal_speedup=ideal_speedup(weights, P, lengths), tree_build_ms=tree_build_ms(inputs), runs={})  # fmt: skip
            for checkpointing in (False, True):
                results = {}
                for name, trainer_cls, config_cls in (
                    ("GRPOTrainer", GRPOTrainer, GRPOConfig), ("TreeGRPOTrainer", TreeGRPOTrainer, TreeGRPOConfig)
                ):  # fmt: skip
                    weights.load_state_dict(state)
                    trainer = build_trainer(trainer_cls, config_cls, weights, G, R, checkpointing, out_dir)
                    if "old_per_token_logps" not in inputs:  # near the policy, so the loss depends on the logprobs
                        inputs["old_per_token_logps"] = behaviour_logprobs(trainer, inputs)
                    try:
                        results[name] = timed_step(trainer, inputs, args.repeats)
                    except torch.OutOfMemoryError:
                        results[name] = None
                    del trainer
                    torch.cuda.empty_cache()
                base, tree = results["GRPOTrainer"], results["TreeGRPOTrainer"]
                run = {}
                for name, res in results.items():
                    run[name] = None if res is None else dict(step_s=res[0], peak_gib=res[1], loss=res[2])
                if base and tree:
                    mask = inputs["completion_mask"].bool()
                    run["loss_rel_diff"] = abs(tree[2] - base[2]) / max(abs(base[2]), 1e-12)
                    run["logprob_max_abs_diff"] = float((tree[3] - base[3])[mask].abs().max())
                    run["grad_rel_diff"] = float((tree[4] - base[4]).norm() / base[4].norm())
                    run["gate"] = run["loss_rel_diff"] < 2e-2 and run["grad_rel_diff"] < 5e-2
                    run["speedup"] = base[0] / tree[0]
                    run["fraction_of_ideal"] = run["speedup"] / row["ideal_speedup"]
                row["runs"]["ckpt" if checkpointing else "no_ckpt"] = run
                print(json.dumps({key: {"ckpt" if checkpointing else "no_ckpt": run}}), flush=True)
            rows.append(row)

    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"trl_grpo_{gpu.split()[-1]}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(gpu=gpu, torch=torch.__version__, model="qwen2-0.5b shape, bf16, sdpa", rows=rows), f, indent=1)
    print(f"\n{gpu}; _compute_loss + backward per micro-batch (one prompt, G completions); CUDA-event medians")
    print(f"{'group':<13} {'ckpt':<5} {'GRPOTrainer s':>13} {'GiB':>6} {'Tree s':>8} {'GiB':>6} {'speedup':>8} "
          f"{'ideal':>6} {'of ideal':>8} {'build ms':>8} {'gate':>5}")  # fmt: skip
    for row in rows:
        for mode, run in row["runs"].items():
            b, t = run["GRPOTrainer"], run["TreeGRPOTrainer"]
            fmt = lambda r, k: f"{r[k]:.3f}" if r else "OOM"  # noqa: E731
            print(f"{row['group']:<13} {mode == 'ckpt'!s:<5} {fmt(b, 'step_s'):>13} {fmt(b, 'peak_gib'):>6} "
                  f"{fmt(t, 'step_s'):>8} {fmt(t, 'peak_gib'):>6} {run.get('speedup', float('nan')):>8.2f} "
                  f"{row['ideal_speedup']:>6.2f} {run.get('fraction_of_ideal', float('nan')):>8.2f} "
                  f"{row['tree_build_ms']:>8.1f} {'ok' if run.get('gate') else 'FAIL':>5}")  # fmt: skip


if __name__ == "__main__":
    main()
