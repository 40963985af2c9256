"""Rollout throughput: speculative sampling from a tree cache vs plain sampling vs Hugging Face generate.

A policy whose rollouts repeat as a converging policy's do: a small
Llama-style model (about 25M parameters) is trained for ``--train-seconds`` on
a synthetic task with a templated answer (a prompt of 8 key tokens; an answer
of 16 blocks, each repeating the keys, a fixed phrase, a free choice among 3
tokens, a filler that depends on the choice, the keys reversed). Then the same
prompts are sampled at temperature 1 for several epochs, the cache carried
across epochs, ``--samples`` samples per prompt. The same is done with the
random-weights model, where there is nothing to reuse (without EOS unless
``--random-eos``: its random completion lengths would decide the throughput).

The policy is shapes.MODELS["llama-24m"]. Speed figures are gated on
correctness checks in the same run, before any timing (float32 copies):
greedy dta_fast.sample == dta_ref.sample, greedy speculative with right,
wrong and empty caches == plain greedy, and sampled speculative logprobs ==
teacher-forced logprobs; a red gate stops the run with no speed figure.
Writes results/rollout_<GPU>.json and its plot, prints a table last.

    python benchmarks/bench_rollout.py [--train-seconds 150] [--prompts 4] [--samples 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import time

import harness
import shapes
import torch

import dta_fast
import dta_ref

BOS, SEP, EOS = 1, 2, 3
VOCAB = 512
KEYS = range(16, 80)
CHOICES = (80, 81, 82)
BLOCKS = 16


def task_tables(seed=1234):
    rng = random.Random(seed)
    phrases = [[rng.randrange(300, 500) for _ in range(40)] for _ in range(4)]
    fillers = {c: [rng.randrange(200, 300) for _ in range(16)] for c in CHOICES}
    return phrases, fillers


PHRASES, FILLERS = task_tables()


def make_prompt(rng):
    return [BOS] + [rng.choice(KEYS) for _ in range(8)] + [SEP]


def make_answer(prompt, rng):
    keys = prompt[1:9]
    out = []
    for j in range(BLOCKS):
        c = rng.choice(CHOICES)
        out += [100 + j] + keys + PHRASES[j % 4] + [c] + FILLERS[c] + keys[::-1]
    return out + [EOS]


def is_templated(prompt, completion):
    """Whether a completion is a well-formed answer (any choices) to its prompt."""
    keys = prompt[1:9]
    pos = 0
    for j in range(BLOCKS):
        head = [100 + j] + keys + PHRASES[j % 4]
        if completion[pos : pos + len(head)] != head:
            return False
        pos += len(head)
        c = completion[pos] if pos < len(completion) else None
        if c not in CHOICES or completion[pos + 1 : pos + 17 + 8] != FILLERS[c] + keys[::-1]:
            return False
        pos += 1 + 16 + 8
    return completion[pos:] == [EOS]


MODEL = "llama-24m"


def build_model(device, seed=0, shape: shapes.ModelShape | None = None):
    """The policy (shapes.MODELS[MODEL], or ``shape``) in float32, with this task's special tokens."""
    shape = shape or shapes.MODELS[MODEL]
    # drawn on the CPU, then moved: the weights of the measured runs
    model = shape.build("cpu", dtype=torch.float32, seed=seed, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0)
    return model.to(device)


def train(model, seconds, batch, device, log):
    rng = random.Random(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    start, step, losses = time.time(), 0, []
    while time.time() - start < seconds:
        seqs = []
        for _ in range(batch):
            p = make_prompt(rng)
            seqs.append(p + make_answer(p, rng))
        ids = torch.tensor(seqs, device=device)
        labels = ids.clone()
        labels[:, :10] = -100  # train on the answer only
        lr = 1e-3 * min(1.0, (step + 1) / 100)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 100 == 0:
            losses.append((step, round(time.time() - start, 1), loss.item()))
            log(f"  train step {step}  {time.time() - start:.0f}s  loss {losses[-1][2]:.4f}")
    model.eval()
    return {"steps": step, "seconds": time.time() - start, "batch": batch, "losses": losses}


# ------------------------------------------------------------------ correctness gate


def gate(model, device, log, length=160, reference_length=24):
    """Float32 checks that every timed path samples what the reference samples."""
    m = copy.deepcopy(model).float().eval()
    rng = random.Random(7)
    prompts = [make_prompt(rng) for _ in range(3)]
    checks = {}
    ref = dta_ref.sample(m, prompts[:2], reference_length, temperature=0)
    fast = dta_fast.sample(m, prompts[:2], reference_length, temperature=0)
    checks["greedy fast.sample == ref.sample"] = fast.completions == ref.completions
    plain = dta_fast.sample(m, prompts, length, temperature=0)
    right = dta_ref.RolloutCache()
    wrong = dta_ref.RolloutCache()
    for p, c in zip(prompts, plain.completions):
        right.add(p, c)
        wrong.add(p, c[: length // 4] + [(t + 1) % VOCAB for t in c[length // 4 :]])
    for name, cache in (("right", right), ("wrong", wrong), ("empty", dta_ref.RolloutCache())):
        spec = dta_fast.speculative_sample(m, prompts, length, cache=cache, temperature=0)
        checks[f"greedy speculative ({name} cache) == plain"] = spec.completions == plain.completions
    g = torch.Generator(device=device).manual_seed(3)
    spec = dta_fast.speculative_sample(m, prompts * 2, length, cache=right, generator=g, eos_token_id=EOS)
    with torch.no_grad():
        flat = dta_ref.flat_logprobs(m, [p + c for p, c in zip(prompts * 2, spec.completions)])
    err = 0.0
    for i, (p, c) in enumerate(zip(prompts * 2, spec.completions)):
        got = spec.logprobs[i].to(flat.device)
        err = max(err, float((got - flat[i, len(p) - 1 : len(p) - 1 + len(c)]).abs().max()))
    checks["sampled speculative logprobs == teacher-forced (max abs err < 2e-3)"] = err < 2e-3
    for k, v in checks.items():
        log(f"  gate: {k}: {'ok' if v else 'FAILED'}")
    log(f"  gate: the sampled check accepted {spec.stats['accepted_tokens']} draft tokens")
    return checks, err


# ------------------------------------------------------------------ timing


DEVICE = "cuda"


def timed(fn):
    seconds, out = harness.wall_seconds(fn)
    return out, seconds


def hf_generate(model, prompts, max_new_tokens, seed, eos=EOS):
    ids = torch.tensor(prompts, device=DEVICE)  # prompts share one length: no padding
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
        min_new_tokens=max_new_tokens if eos is None else 0,
    )
    gen = out[:, ids.shape[1] :].tolist()
    completions = []
    for g in gen:
        completions.append(g[: g.index(EOS) + 1] if eos is not None and EOS in g else g)
    return completions


def row(name, epoch, completions, seconds, stats, prompts):
    tokens = sum(map(len, completions))
    r = {
        "method": name,
        "epoch": epoch,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
    }
    if stats and "accepted_tokens" in stats:
        r["accepted_per_sequence_step"] = round(stats["accepted_tokens"] / max(1, stats["sequence_steps"]), 2)
        r["tokens_per_sequence_step"] = round(stats["generated_tokens"] / max(1, stats["sequence_steps"]), 2)
        r["accepted_per_verify_step"] = round(stats["accepted_tokens"] / max(1, stats["verify_steps"]), 1)
        r["drafted_tokens"] = stats["drafted_tokens"]
        r["verify_steps"] = stats["verify_steps"]
    if stats and "verify_steps" in stats:
        r["verify_steps"] = stats["verify_steps"]
        r["ms_per_verify_step"] = round(1e3 * seconds / max(1, stats["verify_steps"]), 2)
    r["templated"] = round(sum(is_templated(p, c) for p, c in zip(prompts, completions)) / len(completions), 3)
    r["mean_length"] = round(tokens / len(completions), 1)
    return r


def throughput(model, label, prompts, args, log):
    """Plain runs interleaved with the speculative epochs; speculative rows are compared with the plain median.

    A model this small is bound by the host launching its kernels, so a run's
    time moves with the machine (10-40% between identical runs, the first
    full-length run slowest): one full-length warm-up run is discarded, and
    the plain engine runs ``--repeats`` times between the speculative epochs.
    """
    rows = []
    gen = lambda s: torch.Generator(device=DEVICE).manual_seed(s)  # noqa: E731
    kw = dict(temperature=1.0, eos_token_id=None if args.no_eos else EOS)
    # warm-up: Triton compiles the kernel's variants (one query per row; padded draft trees), and one
    # full-length run sizes the allocator's blocks
    warm = dta_fast.sample(model, prompts[:4], 48, generator=gen(0), **kw)
    primed = dta_ref.RolloutCache()
    for p, c in zip(prompts[:4], warm.completions):
        primed.add(p, c)
    dta_fast.speculative_sample(model, prompts[:4], 48, cache=primed, generator=gen(0), **kw)
    dta_fast.sample(model, prompts, args.max_new_tokens, generator=gen(0), **kw)

    def plain(repeat):
        out, s = timed(lambda: dta_fast.sample(model, prompts, args.max_new_tokens, generator=gen(1 + repeat), **kw))
        rows.append(row(f"{label}: dta_fast.sample", repeat, out.completions, s, out.stats, prompts))
        log(f"  {rows[-1]}")

    cache = dta_ref.RolloutCache()

    def speculative(epoch):
        out, s = timed(
            lambda: dta_fast.speculative_sample(
                model,
                prompts,
                args.max_new_tokens,
                cache=cache,
                generator=gen(10 + epoch),
                max_draft_tokens=args.max_draft_tokens,
                **kw,
            )
        )
        rows.append(row(f"{label}: speculative", epoch, out.completions, s, out.stats, prompts))
        log(f"  {rows[-1]}")

    for epoch in range(max(args.epochs, args.repeats)):
        # the order alternates, so that a drift of the machine's speed falls on both alike
        runs = [(plain, epoch < args.repeats), (speculative, epoch < args.epochs)]
        for run, due in runs[:: 1 if epoch % 2 == 0 else -1]:
            if due:
                run(epoch)
    if args.hf:
        eos = None if args.no_eos else EOS
        hf_generate(model, prompts[:4], 16, 0, eos)
        comps, s = timed(lambda: hf_generate(model, prompts, args.max_new_tokens, 2, eos))
        rows.append(row(f"{label}: HF generate", 0, comps, s, None, prompts))
        log(f"  {rows[-1]}")
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-seconds", type=float, default=150)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=1536)
    ap.add_argument("--random-max-new-tokens", type=int, default=512)
    ap.add_argument("--max-draft-tokens", type=int, default=32)
    ap.add_argument("--no-hf", dest="hf", action="store_false")
    ap.add_argument("--repeats", type=int, default=3, help="plain runs, interleaved with the speculative epochs")
    ap.add_argument(
        "--random-repeats",
        type=int,
        default=5,
        help="random-weights runs of each engine, interleaved (run-to-run noise is ~10%%: a model this "
        "small is bound by the host)",
    )
    ap.add_argument(
        "--random-eos",
        action="store_true",
        help="random-weights rows with EOS (by default none: every run then generates the same number "
        "of tokens, where with EOS the runs' random lengths decide their throughput)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    device = torch.device("cuda")

    def log(msg):
        print(msg, flush=True)

    gpu = harness.device_name()
    log(f"{gpu}, torch {torch.__version__}")
    rng = random.Random(99)
    task_prompts = [make_prompt(rng) for _ in range(args.prompts)]
    prompts = [p for p in task_prompts for _ in range(args.samples)]  # a group's samples side by side
    meta = {"args": vars(args)}

    random_model = build_model(device, seed=1).to(torch.bfloat16).eval()
    nparams = sum(p.numel() for p in random_model.parameters())
    meta["parameters"] = nparams
    log(f"model: Llama, {nparams / 1e6:.1f}M parameters, vocab {VOCAB}")

    model = build_model(device, seed=0)
    log("training")
    meta["training"] = train(model, args.train_seconds, args.batch, device, log)
    checks, err = gate(model, device, log)
    meta["gate"] = {"checks": checks, "logprob_max_abs_err": err, "passed": all(checks.values())}
    if not meta["gate"]["passed"]:
        harness.write_results("rollout", [], args.out, **meta)
        raise SystemExit("correctness gate FAILED: no speed figures")
    model = model.to(torch.bfloat16).eval()

    log("trained policy")
    args.no_eos = False
    rows = throughput(model, "trained", prompts, args, log)
    log("random weights")
    rargs = copy.copy(args)
    rargs.max_new_tokens, rargs.no_eos = args.random_max_new_tokens, not args.random_eos
    rargs.epochs = rargs.repeats = args.random_repeats
    rows += throughput(random_model, "random", prompts, rargs, log)
    meta["summary"] = summarize(rows, args)
    path = harness.write_results("rollout", rows, args.out, **meta)
    plot(
        rows,
        path.with_suffix(".png"),
        f"rollout throughput, {gpu}, {args.prompts} prompts x {args.samples} samples, temperature 1",
    )
    print_table(rows, meta["summary"])


def summarize(rows, args) -> dict:
    """Every row against the plain engine's median run (``vs_plain_median``, in place), and the ratios."""

    def speed(label, method, epoch=0):
        return next(r["tokens_per_s"] for r in rows if r["method"] == f"{label}: {method}" and r["epoch"] == epoch)

    def plain_median(label):
        return harness.median([r["tokens_per_s"] for r in rows if r["method"] == f"{label}: dta_fast.sample"])

    for r in rows:
        r["vs_plain_median"] = round(r["tokens_per_s"] / plain_median(r["method"].split(":")[0]), 3)
    summary = {
        "trained: speculative / plain, by epoch": [
            round(speed("trained", "speculative", e) / plain_median("trained"), 2) for e in range(args.epochs)
        ],
        "random: speculative / plain, by epoch": [
            round(speed("random", "speculative", e) / plain_median("random"), 3) for e in range(args.random_repeats)
        ],
        "random: median speculative / median plain": round(
            harness.median([speed("random", "speculative", e) for e in range(args.random_repeats)])
            / plain_median("random"),
            3,
        ),
    }
    if args.hf:
        summary["trained: plain / HF generate"] = round(plain_median("trained") / speed("trained", "HF generate"), 2)
        summary["trained: speculative (last epoch) / HF generate"] = round(
            speed("trained", "speculative", args.epochs - 1) / speed("trained", "HF generate"), 2
        )
    return summary


def plot(rows, path, title):
    labels = [r["method"] + (f" e{r['epoch']}" if "speculative" in r["method"] else "") for r in rows]
    return harness.plot_bars(
        path,
        labels,
        {"tokens/s": [r["tokens_per_s"] for r in rows]},
        ylabel="generated tokens / s",
        title=title,
        horizontal=True,
    )


def print_table(rows, summary):
    table = [
        [
            r["method"],
            r["epoch"],
            f"{r['tokens_per_s']:.0f}",
            f"{r['vs_plain_median']:.2f}x",
            r.get("ms_per_verify_step", "-"),
            r.get("tokens_per_sequence_step", 1.0),
            r.get("accepted_per_sequence_step", "-"),
            r.get("accepted_per_verify_step", "-"),
            r["templated"],
            r["mean_length"],
        ]
        for r in rows
    ]
    harness.print_table(
        [
            "method",
            "epoch / run",
            "tokens/s",
            "vs plain median",
            "ms per verify step",
            "tokens per seq-step",
            "accepted per seq-step",
            "accepted per verify step",
            "templated",
            "mean len",
        ],
        table,
    )
    for k, v in summary.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
