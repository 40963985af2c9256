"""verl's policy update: verl's FSDP2 engine against the tree engine, inside verl's own TrainingWorker.

    python benchmarks/bench_verl.py [--models qwen2-0.5b qwen3-1.7b] [--prompts 4] [--group 8]
                                    [--prompt-len 1024] [--response 1024] [--repeats 3] [--gate-prompts N]
                                    [--fused-backend torch] [--out DIR]

Runs in verl's pinned environment (``pip install -e ".[verl]"``) on one GPU, one rank. A mini-batch as
verl's trainer hands it to ``update_policy``: ``--prompts`` prompts of ``--prompt-len`` tokens, ``--group``
responses each of R/2 to R tokens, left-padded prompts and right-padded responses in verl's no-padding
layout, random advantages and old log-probabilities; verl's PPO loss (token-mean), SGD, float32 weights,
micro-batches of one group. A step is ``TrainingWorker.train_mini_batch`` (every micro-batch's forward,
loss and backward, then the optimizer step). verl's engine runs with padding removal on and off (SDPA
either way) and with verl's fused log-probability kernels (``use_fused_kernels``; ``--fused-backend``,
verl's default ``torch`` or its Triton kernel: without them and without flash-attn, verl takes a
log-softmax per token in a Python loop), and the faster layout is the baseline; the tree engine removes
padding and computes its log-probabilities chunked, as always.

Gates, before timing, each from the same weights, on a mini-batch of ``--gate-prompts`` prompts (by
default the timed one; a smaller one runs the same micro-batches of one group, in less float32 time):
(1) exactness, in float32 compute: the tree engine's update is no farther from each of verl's two
float32 updates than twice their distance from each other, plus 1e-3 (verl's two layouts, both exact,
land about 5e-3 apart on a 24-layer model on an H200); (2) bf16 compute, the timed setting: the tree's
update is no farther from verl's float32 update than twice verl's own bf16 update is, plus 1e-3 (two
bf16 updates differ by rounding alone: 10-20% on random weights, so they cannot gate each other).
Median of ``--repeats`` bf16 steps after a warm-up, peak memory. Each float32 update's Triton compiles
(count and seconds, ``float32_triton_compiles``; on a bare machine the autotuner's float32
configurations compile for minutes: ``DTA_AUTOTUNE=0`` keeps one each) are recorded. Models are
shapes.MODELS with random weights, saved with a tokenizer built in code. Writes
results/verl_update_<GPU>.json and prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import tempfile
import time

import harness
import shapes
import torch

EXACT_FLOOR = 1e-3  # float32: tree's distance from verl's updates <= 2 x theirs from each other + this
DRIFT_FLOOR = 1e-3  # bf16: tree's distance from float32 <= 2 x verl's own + this


def checkpoint(model: str, directory: str, **overrides) -> str:
    """shapes.MODELS[model] with random weights (float32) and a word-level tokenizer, saved for verl."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    # drawn on the GPU where there is one, where initialising billions of float32 weights is fast
    net = shapes.MODELS[model].build("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.float32, **overrides)
    vocab = net.config.vocab_size
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1")
    net.config.pad_token_id, net.config.eos_token_id = 0, 1
    net.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del net
    harness.empty_cache()
    return directory


def mini_batch(prompts: int, group: int, prompt_len: int, response: int, vocab: int, seed: int = 0):
    """The mini-batch verl's trainer hands ``update_policy``, in verl's no-padding layout with its flags;
    also its tokens and its unique tokens (each prompt once)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    n = prompts * group
    prompt_ids = torch.randint(2, vocab, (prompts, prompt_len), generator=g).repeat_interleave(group, 0)
    lengths = torch.randint(response // 2, response + 1, (n,), generator=g)
    response_mask = (torch.arange(response) < lengths[:, None]).long()
    ids = torch.cat([prompt_ids, torch.randint(2, vocab, (n, response), generator=g) * response_mask], 1)
    mask = torch.cat([torch.ones(n, prompt_len, dtype=torch.long), response_mask], 1)
    batch = {
        "input_ids": ids, "attention_mask": mask, "position_ids": torch.clip(mask.cumsum(-1) - 1, min=0),
        "prompts": ids[:, :prompt_len], "responses": ids[:, prompt_len:], "response_mask": response_mask,
        "old_log_probs": (-4.0 + 0.3 * torch.randn(response_mask.shape, generator=g)) * response_mask,
        "advantages": torch.randn(n, 1, generator=g).expand_as(response_mask) * response_mask,
    }  # fmt: skip
    td = left_right_2_no_padding(tu.get_tensordict(batch))
    flags = dict(calculate_entropy=False, global_batch_size=n, mini_batch_size=n, epochs=1, seed=1,
                 dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=1.0)  # fmt: skip
    tu.assign_non_tensor(td, global_token_num=mask.sum(-1).tolist(), **flags)
    return td, int(mask.sum()), prompts * prompt_len + int(lengths.sum())


@contextlib.contextmanager
def as_fsdp2_engine(engine):
    """``engine`` registered as verl's FSDP2 language-model engine while a worker is built."""
    from verl.workers.engine.base import EngineRegistry

    by_device = EngineRegistry._engines["language_model"]["fsdp2"]
    device = "cuda" if "cuda" in by_device else next(iter(by_device))
    before = by_device[device]
    by_device[device] = engine
    try:
        yield
    finally:
        by_device[device] = before


@contextlib.contextmanager
def own_forward_kept(path: str):
    """verl's fused kernels replace the forward of the model's class, for every later model of that class
    in the process: the class gets its own back once a run's workers are done."""
    import transformers

    cls = getattr(transformers, transformers.AutoConfig.from_pretrained(path).architectures[0])
    forward = cls.forward
    try:
        yield
    finally:
        cls.forward = forward


def worker(
    path: str, tree: bool, group: int, prompts: int, param_dtype: str = "bf16", remove_padding: bool = True,
    fused_backend: str | None = "torch",
):  # fmt: skip
    """verl's TrainingWorker on ``path`` with verl's FSDP2 engine or the tree engine: PPO's loss, SGD."""
    from functools import partial

    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        FSDPActorConfig,
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    import dta_fast.verl.engine as tree_engines

    # fused_backend None: verl's log-probabilities from full logits; the tree engine computes its own either way
    fused = dict(use_fused_kernels=fused_backend is not None, fused_kernel_options={"impl_backend": fused_backend})
    model = HFModelConfig(path=path, override_config={"attn_implementation": "sdpa"}, use_remove_padding=remove_padding,
                          **fused)  # fmt: skip
    engine = FSDPEngineConfig(
        strategy="fsdp2", model_dtype="fp32", mixed_precision={"param_dtype": param_dtype}, use_torch_compile=False,
        use_dynamic_bsz=False, micro_batch_size_per_gpu=group, infer_micro_batch_size_per_gpu=group,
    )  # fmt: skip
    optimizer = FSDPOptimizerConfig(lr=1e-3, optimizer="SGD", weight_decay=0.0, clip_grad=1e9)
    chosen = tree_engines.TreeFSDPEngineWithLMHead if tree else FSDPEngineWithLMHead
    config = TrainingWorkerConfig(model_type="language_model", model_config=model, engine_config=engine,
                                  optimizer_config=optimizer, checkpoint_config=CheckpointConfig())  # fmt: skip
    with as_fsdp2_engine(chosen):
        out = TrainingWorker(config)
    if type(out.engine) is not chosen:
        raise RuntimeError(f"verl built {type(out.engine).__name__}, not {chosen.__name__}")
    out.reset()
    actor = FSDPActorConfig(
        strategy="fsdp2", rollout_n=group, ppo_mini_batch_size=prompts, ppo_micro_batch_size_per_gpu=group,
        use_torch_compile=False, loss_agg_mode="token-mean",
    )  # fmt: skip
    out.set_loss_fn(partial(ppo_loss, config=actor))
    return out


def parameters(w) -> torch.Tensor:
    return torch.cat([p.full_tensor().detach().float().flatten().cpu() for p in w.engine.module.parameters()])


def timed(w, td) -> tuple[float, float]:
    """Wall seconds and peak GiB of one ``train_mini_batch``."""
    harness.reset_peak()
    seconds, _ = harness.wall_seconds(lambda: w.train_mini_batch(td.clone()))
    return seconds, harness.peak_allocated_gib()


def update(w, td) -> torch.Tensor:
    """The parameters' change in one ``train_mini_batch`` (SGD: the learning rate times the gradient)."""
    before = parameters(w)
    w.train_mini_batch(td.clone())
    return parameters(w) - before


# the timed engines: verl's with padding removal on and off, and the tree engine
ENGINES = {"verl": (False, True), "verl_padded": (False, False), "tree": (True, True)}


def run(model: str, args, directory: str, **overrides) -> dict:
    """One model's row: the float32 gate, then each engine's bf16 gate step and timed steps."""
    # verl keeps the tracebacks of its optional imports; imported first inside worker(), their frames
    # would keep that call's worker, and its GPU memory, alive for the rest of the run
    import verl.workers.engine_workers  # noqa: F401

    path = checkpoint(model, os.path.join(directory, model), **overrides)
    with own_forward_kept(path):
        return _row(model, path, args, overrides)


def _row(model: str, path: str, args, overrides) -> dict:
    vocab = overrides.get("vocab_size", shapes.MODELS[model].vocab_size)
    td, tokens, unique = mini_batch(args.prompts, args.group, args.prompt_len, args.response, vocab)
    gate_prompts = args.gate_prompts or args.prompts
    if not 1 <= gate_prompts <= args.prompts:
        raise ValueError(f"--gate-prompts must be between 1 and --prompts ({args.prompts}), got {gate_prompts}")
    # micro-batches are one group each, so a smaller gate batch runs the same per-micro-batch computation
    gate_td = (
        td
        if gate_prompts == args.prompts
        else mini_batch(gate_prompts, args.group, args.prompt_len, args.response, vocab, seed=1)[0]
    )
    row = dict(model=model, prompts=args.prompts, gate_prompts=gate_prompts, group=args.group,
               prompt_len=args.prompt_len, response=args.response, tokens=tokens, unique_tokens=unique,
               param_dtype=args.param_dtype, verl_fused_backend=args.fused_backend, engines={})  # fmt: skip
    clock = time.perf_counter()

    def progress(what: str) -> None:  # where a long run's minutes go, printed as it goes
        print(f"{model}: {what} at {time.perf_counter() - clock:.0f} s", flush=True)

    exact = {}
    for name, (tree, remove_padding) in ENGINES.items():  # the exactness gate, float32 compute
        w = worker(path, tree, args.group, gate_prompts, "fp32", remove_padding, args.fused_backend)
        progress(f"{name} float32 worker built")
        with harness.TritonCompiles() as compiles:
            exact[name] = update(w, gate_td)
        row.setdefault("float32_triton_compiles", {})[name] = [compiles.count, round(compiles.seconds, 1)]
        progress(f"{name} float32 update ({compiles.count} Triton compiles, {compiles.seconds:.0f} s)")
        del w
        gc.collect()  # a worker's modules hold reference cycles: its GPU memory goes only once they do
        harness.empty_cache()
    truth = exact["verl"]
    row["verl_layouts_rel_diff"] = harness.relative_error(exact["verl_padded"], truth)
    row["exact_rel_diff"] = max(harness.relative_error(exact["tree"], exact[name]) for name in ("verl", "verl_padded"))
    drift = {}
    for name, (tree, remove_padding) in ENGINES.items():
        w = worker(path, tree, args.group, args.prompts, args.param_dtype, remove_padding, args.fused_backend)
        harness.reset_peak()
        with harness.TritonCompiles() as compiles:
            seconds, step = harness.wall_seconds(lambda w=w: update(w, gate_td))  # the drift gate's step
        progress(f"{name} {args.param_dtype} gate step ({compiles.count} Triton compiles, {compiles.seconds:.0f} s)")
        drift[name] = harness.relative_error(step, truth)
        if gate_td is not td:  # the warm-up at the timed batch's sizes
            seconds = harness.wall_seconds(lambda w=w: w.train_mini_batch(td.clone()))[0]
        times = [timed(w, td) for _ in range(args.repeats)]
        progress(f"{name} {args.param_dtype} steps")
        row["engines"][name] = dict(
            remove_padding=remove_padding,
            warmup_seconds=seconds,
            step_seconds=[t for t, _ in times],
            seconds=harness.median([t for t, _ in times] or [seconds]),
            peak_gib=max([harness.peak_allocated_gib()] + [p for _, p in times]),
            rel_diff_from_float32=drift[name],
        )
        del w
        gc.collect()  # a worker's modules hold reference cycles: its GPU memory goes only once they do
        harness.empty_cache()
    allowed = 2 * min(drift["verl"], drift["verl_padded"]) + DRIFT_FLOOR
    exact_ok = row["exact_rel_diff"] <= 2 * row["verl_layouts_rel_diff"] + EXACT_FLOOR
    row["gate_ok"] = bool(truth.norm() > 0 and exact_ok and drift["tree"] <= allowed)
    if row["gate_ok"]:
        row["baseline"] = min(("verl", "verl_padded"), key=lambda name: row["engines"][name]["seconds"])
        row["speedup"] = row["engines"][row["baseline"]]["seconds"] / row["engines"]["tree"]["seconds"]
    else:  # a red gate: no speed figure
        for entry in row["engines"].values():
            entry.pop("seconds")
    print(f"{model}: {row}", flush=True)
    return row


def print_table(rows) -> None:
    table = []
    for r in rows:
        v, vp, t = (r["engines"][name] for name in ENGINES)
        table.append([
            r["model"], harness.cell(v.get("seconds"), ".3f"), f"{v['peak_gib']:.1f}",
            harness.cell(vp.get("seconds"), ".3f"), f"{vp['peak_gib']:.1f}",
            harness.cell(t.get("seconds"), ".3f"), f"{t['peak_gib']:.1f}", harness.cell(r.get("speedup")),
            f"{r['exact_rel_diff']:.1e} / {r['verl_layouts_rel_diff']:.1e}",
            f"{t['rel_diff_from_float32']:.3f} / {v['rel_diff_from_float32']:.3f}",
            "ok" if r["gate_ok"] else "FAIL",
        ])  # fmt: skip
    harness.print_table(
        ["model", "verl s", "GiB", "verl padded s", "GiB", "tree s", "GiB", "speedup", "fp32: tree / verl's two",
         "bf16 from fp32: tree / verl", "gate"],
        table,
        title=f"{harness.device_name()}; train_mini_batch of {rows[0]['prompts']} prompts x G={rows[0]['group']}; "
        "speedup against the faster verl layout",
    )  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen2-0.5b", "qwen3-1.7b"], choices=list(shapes.MODELS))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--response", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--gate-prompts",
        type=int,
        default=None,
        help="prompts of the gates' mini-batch (default: --prompts); micro-batches are one group",
    )
    p.add_argument("--param-dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--fused-backend", default="torch", choices=["torch", "triton"], help="verl's fused kernels")
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29573", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    for k, v in env.items():
        os.environ.setdefault(k, v)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for model in args.models:  # written after each model: a run cut short keeps its finished rows
            rows.append(run(model, args, directory))
            harness.write_results("verl_update", rows, args.out, key=lambda r: r["model"])
    print_table(rows)


if __name__ == "__main__":
    main()
