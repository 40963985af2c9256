"""The benchmarks' own machinery on small cases: the timings need a GPU, but the shape registry, the
harness's gate, every script's argument parser and the parts that gate and plan run anywhere (the kernels
under the Triton interpreter), so that a change to the library breaks here rather than on a GPU machine at
measuring time."""

from __future__ import annotations

import importlib
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
from argparse import Namespace
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS / "dev")]

import bench_attention  # noqa: E402
import harness  # noqa: E402
import shapes  # noqa: E402

import dta_fast  # noqa: E402
from dta_ref import PrefixTree, SFTLoss, grpo_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCRIPTS = [
    "bench_attention",
    "bench_training",
    "bench_vl",
    "bench_distributed",
    "bench_rollout",
    "bench_trl",
    "bench_verl",
    "bench_partition",
    "checkpoint_ab",
    "attention_timeline",
    "bench_cuda_graphs",
    "bench_power",
    "bench_schedule",
    "compare_attention",
    "host_cost",
    "bf16_drift",
    "memory_snapshot",
    "profile_step",
    "profile_trl",
    "profile_verl",
    "profile_rollout",
    "small_trees",
]
TINY_QWEN2 = shapes.ModelShape("qwen2", 32, 64, 2, 4, 2, 8, 300)


@pytest.fixture(scope="module")
def tiny_model():
    return TINY_QWEN2.build("cpu", dtype=torch.float32)


# ---------------------------------------------------------------- the registry


def test_every_rollout_set_builds_its_tree_once_named():
    names = [r.name for r in shapes.ROLLOUTS.values()]
    assert len(set(names)) == len(names)
    for key, rollouts in shapes.ROLLOUTS.items():
        tree = shapes.tree(rollouts)
        assert tree.num_sequences == len(rollouts.sequences()), key
        assert tree.num_tokens <= tree.flat_tokens, key


@pytest.mark.parametrize(
    ("key", "vocab", "unique", "flat"),
    [
        ("grpo_p2k_n8_r1k", shapes.VOCAB, 10240, 24576),
        ("agentic_4x4x8", shapes.VOCAB, 58400, 860800),
        ("agentic_irregular", 151936, 119726, 1138148),
        ("agentic_long_10x4", 151936, 1074800, 1268000),
        ("causal_16k", shapes.VOCAB, 16384, 16384),
    ],
)
def test_registry_trees_are_the_documented_ones(key, vocab, unique, flat):
    """The token counts docs/benchmarks.md gives for these trees."""
    tree = shapes.tree(key, vocab_size=vocab)
    assert (tree.num_tokens, tree.flat_tokens) == (unique, flat)


def test_attention_cases_name_registered_shapes():
    cases = [c for group in shapes.ATTENTION.values() for c in group]
    assert len({(c.rollouts, c.heads) for c in cases}) == len(cases)
    for case in cases:
        assert case.rollouts in shapes.ROLLOUTS and case.heads in shapes.HEADS
    assert shapes.HEADS["qwen2"] == shapes.MODELS["qwen2-0.5b"].heads
    assert shapes.HEADS["qwen3"] == shapes.MODELS["qwen3-1.7b"].heads


def test_model_shapes_build_on_the_meta_device():
    sizes = {
        name: sum(p.numel() for p in shapes.build_model(name, device="meta").parameters()) for name in shapes.MODELS
    }
    assert round(sizes["llama-24m"] / 1e6, 1) == 24.1  # bench_rollout.py's policy, as documented
    assert sizes["qwen2-0.5b"] < sizes["qwen3-1.7b"]


# ---------------------------------------------------------------- the harness


def test_the_gate_fails_on_a_wrong_result_and_refuses_its_timing():
    g = torch.Generator().manual_seed(0)
    want = dict(out=torch.randn(64, 8, generator=g), dq=torch.randn(64, 8, generator=g))
    assert harness.gate("same", {k: v.clone() for k, v in want.items()}, want).ok
    wrong = dict(want, dq=want["dq"] * 1.1)
    check = harness.gate("wrong", wrong, want)
    assert not check.ok and check.errors["dq"] == pytest.approx(0.1, rel=1e-4)
    assert not harness.gate("nan", dict(want, out=want["out"] * math.nan), want).ok
    assert not harness.gate("missing", dict(out=want["out"]), want).ok
    calls = []
    with pytest.raises(harness.GateFailed):
        harness.measure(lambda: calls.append(1), gate=check)
    with pytest.raises(harness.GateFailed):
        harness.measure_per_call(
            lambda: calls.append(1), lambda: calls.append(2), gate=harness.gate("ok", want, want), per_call_gate=check
        )
    assert calls == []  # nothing ran: no timing exists for a red gate


def test_gate_tolerance_per_output_and_error_over_pieces():
    check = harness.Gate("g", dict(grad=0.04, logprob=0.3), dict(grad=5e-2, logprob=0.25))
    assert not check.ok and check.limit("grad") == 5e-2
    pieces = [torch.randn(3, 5), torch.randn(7, 5)]
    other = [p + 0.01 * torch.randn_like(p) for p in pieces]
    assert harness.relative_error(other, pieces) == pytest.approx(
        harness.relative_error(torch.cat(other), torch.cat(pieces)), rel=1e-5
    )


@pytest.mark.parametrize(
    ("name", "count", "short"),
    [
        ("NVIDIA H100 80GB HBM3", 1, "H100"),
        ("NVIDIA H200", 4, "H200x4"),
        ("NVIDIA A100-SXM4-80GB", 1, "A100"),
        ("NVIDIA GeForce RTX 4090", 1, "RTX4090"),
        ("CPU", 1, "CPU"),
    ],
)
def test_result_files_are_named_by_the_gpus_short_name(name, count, short):
    assert harness.short_name(name, count) == short
    assert harness.result_path("attention", "/r", short).name == f"attention_{short}.json"


def test_results_keep_one_row_per_key_over_runs(tmp_path):
    def key(r):
        return r["case"]

    harness.write_results("demo", [dict(case="a", ms=1.0), dict(case="b", ms=2.0)], tmp_path, key=key)
    path = harness.write_results("demo", [dict(case="b", ms=3.0)], tmp_path, key=key)
    meta, rows = harness.read_results(path)
    assert path.name == f"demo_{harness.short_name()}.json" and meta["gpu"] == harness.device_name()
    assert [(r["case"], r["ms"]) for r in rows] == [("a", 1.0), ("b", 3.0)]
    assert "command" in rows[-1]["run"]


def test_table_and_plot(tmp_path, capsys):
    harness.print_table(["case", "ms"], [["a", "1.00"], ["b", "-"]], title="demo")
    assert "demo" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    path = harness.plot_bars(
        tmp_path / "p.png", ["a", "b"], {"x": [1.0, None], "y": [2.0, 3.0]}, ylabel="ms", title="t"
    )
    assert path.stat().st_size > 0


# ---------------------------------------------------------------- the scripts


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_imports_and_parses_its_defaults(script):
    module = importlib.import_module(script)
    args = {"bench_training": ["speed"], "compare_attention": ["--base", "HEAD"]}.get(script, [])
    assert isinstance(module.parser().parse_args(args), Namespace)


def test_committed_results_read_back(tmp_path, capsys):
    """Every file of benchmarks/results has the harness's layout; the attention table and plot draw from it."""
    for path in (BENCHMARKS / "results").glob("*.json"):
        meta, rows = harness.read_results(path)
        assert path.stem.rsplit("_", 1)[1] == harness.short_name(meta["gpu"], int(meta.get("gpus", 1))), path
        assert rows, path
    bench_attention.main(["--plot", str(BENCHMARKS / "results" / "attention_H100.json"), "--out", str(tmp_path)])
    assert "GRPO P=2K N=8 R=1K, 32/32 heads, D=128" in capsys.readouterr().out


def small_problem():
    tree = PrefixTree.from_sequences(grpo_batch(1, 40, 3, 20))
    return bench_attention.problem("tiny", tree, shapes.Heads(4, 2, 16), DEVICE)


def test_attention_reference_over_query_slices_is_the_whole_reference():
    p = small_problem()
    whole, sliced = bench_attention.reference(p), bench_attention.reference(p, budget=1)  # slices of 16 queries
    for name in whole:
        torch.testing.assert_close(sliced[name], whole[name], rtol=1e-5, atol=1e-6)


@pytest.mark.kernel
def test_attention_benchmark_gates_every_method():
    """bench_attention.py's gate on a small tree: the tree kernel (schedule prebuilt and per call), the
    dense mask and SDPA on each sequence alone, all against dta_ref."""
    tree = PrefixTree.from_sequences(grpo_batch(1, 40, 3, 20))
    row = bench_attention.bench_case(
        "tiny",
        tree,
        shapes.Heads(4, 2, 16),
        device=DEVICE,
        timing=False,
        methods=("tree", "tree_call", "dense", "sdpa", "tree_fwd"),
    )
    assert row["gate_ok"] and {"tree", "tree_call", "dense", "sdpa", "tree_fwd"} <= set(row["gate"])
    assert all(g["ok"] for g in row["gate"].values()), row["gate"]


@pytest.mark.kernel
def test_attention_benchmark_gates_windows_and_sinks():
    """The variant rows' gate: the tree kernel with a window and sinks, the dense mask with a window and SDPA
    on each sequence alone with both (sinks as a biased extra key), against dta_ref."""
    tree = PrefixTree.from_sequences(grpo_batch(1, 40, 3, 20))
    for variant in (dict(window=7), dict(window=5, sinks=True)):
        row = bench_attention.bench_case(
            "tiny", tree, shapes.Heads(4, 2, 16), device=DEVICE, timing=False,
            methods=("tree", "tree_call", "dense", "sdpa"), variant=variant,
        )  # fmt: skip
        assert row["gate_ok"] and all(g["ok"] for g in row["gate"].values()), row["gate"]
        assert ("dsinks" in row["gate"]["tree"]["rel_err"]) == ("sinks" in variant)
        assert ("dense" in row["gate"]) == ("sinks" not in variant)


@pytest.mark.kernel
def test_attention_benchmark_gives_no_figure_for_a_red_gate(monkeypatch):
    wrong = lambda p, flex=None, dense=True: {"tree": lambda q, k, v: 1.1 * dta_fast.tree_attention(q, k, v, p.end)}  # noqa: E731
    monkeypatch.setattr(bench_attention, "tree_methods", wrong)
    tree = PrefixTree.from_sequences(grpo_batch(1, 40, 3, 20))
    row = bench_attention.bench_case(
        "tiny", tree, shapes.Heads(2, 2, 16), device=DEVICE, timing=True, methods=("tree",)
    )
    assert not row["gate_ok"] and "tree" not in row and not any(k.startswith("speedup") for k in row)


def tiny_speed_args(*extra):
    import bench_training

    args = bench_training.parser().parse_args(["speed", "--repeats", "0", *extra])
    args.flat_repeats = 0
    return args


def test_training_benchmark_runs_and_gates_on_the_cpu(tiny_model):
    import bench_training

    args = tiny_speed_args("--chunks", "0", "64", "--auto", "--flatpeak", "--skip", "flat_ckpt", "flat_kernel")
    batches = {"tiny": ("tiny GRPO", grpo_batch(1, 40, 3, 20, vocab_size=300))}
    (row,) = bench_training.speed(tiny_model, "tiny", batches, args)
    methods = row["methods"]
    assert {"flat", "packed", "tree_64", "tree_all", "auto"} <= set(methods)
    for label in ("packed", "tree_64", "tree_all", "auto"):
        assert methods[label]["gate_ok"] and "speedup" in methods[label], label
    assert methods["tree_64"]["plan"]["chunks"] == 2
    bench_training.print_speed([row])


TINY_SHAPES = {  # the model kinds bench_training.py measures beside the dense policy
    "critic": (TINY_QWEN2, "value"),
    "moe": (shapes.ModelShape("qwen3_moe", 32, 64, 2, 4, 2, 8, 300, extra=dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)), "lm"),
    "hybrid": (shapes.ModelShape("qwen3_5_text", 32, 64, 2, 4, 2, 8, 300, extra=dict(
        layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8)), "lm"),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(TINY_SHAPES))
def test_training_benchmark_runs_critics_moe_and_hybrids_on_the_cpu(kind):
    import bench_training

    shape, head = TINY_SHAPES[kind]
    model = shape.build("cpu", dtype=torch.float32, head=head)
    args = tiny_speed_args("--chunks", "0", "64", "--skip", "flat_ckpt", "flat_kernel")
    batches = {"tiny": ("tiny GRPO", grpo_batch(1, 40, 3, 20, vocab_size=300))}
    (row,) = bench_training.speed(model, "tiny", batches, args)
    for label in ("packed", "tree_64", "tree_all"):
        assert row["methods"][label]["gate_ok"] and "speedup" in row["methods"][label], (kind, label)
        assert row["methods"][label]["grad_rel_err"] < 1e-4, (kind, label)
    assert row["model"].endswith("critic") == (head == "value")
    assert 1 < row["ideal_speedup"] < row["flat_tokens"] / row["tree_tokens"]


@pytest.mark.parametrize("kind", ["moe", "hybrid"])
def test_scoring_benchmark_gates_the_forward(kind, monkeypatch, capsys):
    """``score`` mode: the tree's forward passes the gate against each sequence alone; a wrong forward fails."""
    import bench_training

    model = TINY_SHAPES[kind][0].build("cpu", dtype=torch.float32)
    args = bench_training.parser().parse_args(["score", "--repeats", "1"])
    batches = {"tiny": ("tiny GRPO", grpo_batch(1, 40, 3, 20, vocab_size=300))}
    (row,) = bench_training.score(model, "tiny", batches, args)
    assert row["methods"]["tree"]["gate_ok"] and row["methods"]["tree"]["logprob_max_abs"] < 1e-4
    assert "speedup" in row["methods"]["tree"] and row["ideal_speedup"] > 1
    bench_training.print_score([row])
    assert "s/forward" in capsys.readouterr().out
    right = bench_training.dta_fast.tree_logprobs
    monkeypatch.setattr(bench_training.dta_fast, "tree_logprobs", lambda m, t: right(m, t) + 1)
    (row,) = bench_training.score(model, "tiny", batches, args)
    assert not row["methods"]["tree"]["gate_ok"] and "speedup" not in row["methods"]["tree"]


def test_vl_benchmark_runs_and_gates_on_the_cpu():
    """bench_vl.py on a tiny Qwen2.5-VL in float32: the packed tree (each image once) passes the gate."""
    import bench_vl

    from tests.helpers import tiny_vl_model

    model = tiny_vl_model("qwen2.5-vl", torch.float32).train()
    args = bench_vl.parser().parse_args(["--prompts", "2", "--group", "3", "--response", "5", "--image", "8"])
    args.repeats, args.model = 1, "tiny"
    row = bench_vl.run(model, args)
    assert row["methods"]["tree"]["gate_ok"] and row["methods"]["tree"]["grad_rel_err"] < 1e-4
    assert row["tree_tokens"] < row["flat_tokens"] and "speedup" in row["methods"]["tree"]
    bench_vl.print_row(row)


def test_training_benchmark_plans_on_the_meta_device():
    import bench_training

    model = TINY_QWEN2.build("meta")
    tree = shapes.tree(shapes.Grpo(64, 4, 32), vocab_size=300)
    rows = bench_training.plan_rows(model, tree, [0.001, 1e-9])
    assert rows[0]["what"] == "forest arrays" and all(r["ms"] >= 0 for r in rows)
    assert rows[-1]["chunk_tokens"] == "too small"  # a budget nothing fits


def test_distributed_benchmark_plans_and_tables(tiny_model, capsys):
    import bench_distributed

    sequences = bench_distributed.make_batch("agentic", tasks=2, vocab_size=300)
    assert sorted(map(len, sequences)) == sorted(map(len, shapes.agentic(2).sequences(300)))
    costs = bench_distributed.cost_model(tiny_model)
    for plan in bench_distributed.PLANS:
        shards = bench_distributed.plan_for(plan, sequences, 2, costs).shards
        assert sorted(i for s in shards for i in s) == list(range(len(sequences))), plan
    rows = [
        dict(
            batch="b",
            world_size=w,
            plan="balanced",
            step_seconds=s,
            measured_balance=1.0,
            predicted_balance=1.0,
            gate=None if w == 1 else dict(ok=True),
        )
        for w, s in ((1, 4.0), (2, 2.5))
    ]
    bench_distributed.add_efficiency(rows)
    assert rows[1]["efficiency"] == pytest.approx(0.8)
    bench_distributed.summarize(rows)
    assert "0.800" in capsys.readouterr().out


def test_partition_benchmark_gates_the_shards(capsys):
    import bench_partition

    rows = bench_partition.run(["grpo_p512_n4_r256", "agentic_8x4x8"], [2, 4])
    assert all(r["gate"]["ok"] and r["balance"] >= 1.0 for r in rows)
    assert not bench_partition.shards_cover([[0, 1], [1]], 3).ok
    bench_partition.print_table(rows)


def test_rollout_benchmark_gate_and_task():
    import bench_rollout

    rng = random.Random(0)
    prompt = bench_rollout.make_prompt(rng)
    answer = bench_rollout.make_answer(prompt, rng)
    assert bench_rollout.is_templated(prompt, answer) and not bench_rollout.is_templated(prompt, answer[1:])
    tiny = shapes.ModelShape("llama", 32, 64, 1, 2, 1, 16, bench_rollout.VOCAB, tie_word_embeddings=False)
    model = bench_rollout.build_model("cpu", shape=tiny)
    checks, _ = bench_rollout.gate(model, "cpu", lambda msg: None, length=12, reference_length=6)
    assert all(checks.values()), checks


def test_trl_benchmark_batch_and_gate(tiny_model):
    import bench_trl

    inputs = bench_trl.micro_batch(16, 4, 8, 300, device="cpu")
    lengths = inputs["completion_mask"].sum(1)
    assert inputs["prompt_ids"].shape == (4, 16) and lengths.min() >= 4 and lengths.max() <= 8
    assert bench_trl.ideal_speedup(tiny_model, 16, lengths.tolist()) > 1
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(100, generator=gen)
    truth = (0.0, 1.0, torch.zeros(4, 8), grads)
    mask = inputs["completion_mask"].bool()

    def step(loss, g):
        return (0.0, loss, torch.zeros(4, 8), g)

    base = step(1.0 + 2e-3, grads + 0.05 * torch.randn(100, generator=gen))  # bf16 rounding's distance
    near = step(1.0 - 2e-3, grads + 0.05 * torch.randn(100, generator=gen))
    assert bench_trl.trl_gate("as near", base, near, truth, mask)[0].ok
    assert not bench_trl.trl_gate("wrong", base, step(1.0, -grads), truth, mask)[0].ok
    far = step(1.0, grads + 0.15 * torch.randn(100, generator=gen))  # three times GRPOTrainer's distance
    assert not bench_trl.trl_gate("farther", base, far, truth, mask)[0].ok
    assert not bench_trl.trl_gate("loss off", base, step(1.01, near[3]), truth, mask)[0].ok


def test_trl_full_step_gates_then_times_both_trainers(tmp_path, monkeypatch):
    """bench_trl.py --full-step on a tiny policy: the gate (GRPOTrainer and TreeGRPOTrainer generating
    alike log the same losses and entropies) passes, both trainers' trainer.train() steps are timed with
    their rewards; a tree path that scored other entropies fails the gate and times nothing."""
    pytest.importorskip("trl")
    import bench_rollout
    import bench_trl

    import dta_fast.trl as tree_trl

    tiny = shapes.ModelShape("llama", 32, 64, 1, 2, 1, 16, bench_rollout.VOCAB, tie_word_embeddings=False)
    build = bench_rollout.build_model
    monkeypatch.setattr(bench_rollout, "build_model", lambda device: build(device, shape=tiny))
    args = bench_trl.parser().parse_args(
        ["--full-step", "--steps", "2", "--warmup", "1", "--gate-steps", "1", "--train-seconds", "0",
         "--prompts", "2", "--group", "2", "--max-completion", "8", "--out", str(tmp_path)]
    )  # fmt: skip
    row = bench_trl.full_step(args)
    assert row["gate"]["ok"] and set(row["runs"]) == {"GRPOTrainer", "TreeGRPOTrainer"}
    assert all(len(r["step_seconds"]) == 2 and len(r["reward"]) == 2 for r in row["runs"].values())
    for r in row["runs"].values():  # each step generated once, inside the step
        assert all(0 < g < t for g, t in zip(r["generation_seconds"], r["step_seconds"], strict=True))
        assert len(r["triton_compiles"]) == len(r["triton_compile_seconds"]) == 2  # none on the CPU
    assert row["speedup"] > 0
    bench_trl.print_full_step(row)
    right = tree_trl.block_logprobs_and_entropy
    monkeypatch.setattr(
        tree_trl, "block_logprobs_and_entropy", lambda *a, **k: (lambda r: (r[0], 1.5 * r[1], *r[2:]))(right(*a, **k))
    )
    row = bench_trl.full_step(args)
    assert not row["gate"]["ok"] and not row["runs"]


def test_triton_compiles_are_counted_through_the_jit_hooks():
    """harness.TritonCompiles counts what Triton's JIT reports, chains the hooks installed before it (one
    that skips a compile skips the count) and puts them back on exit."""
    knobs = pytest.importorskip("triton.knobs")
    runtime = knobs.runtime
    saved, seen = (runtime.jit_cache_hook, runtime.jit_post_compile_hook), []
    runtime.jit_cache_hook = lambda **kw: kw["key"] == "cached"  # a hook before it: skips "cached"
    runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["key"])
    before = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    try:
        with harness.TritonCompiles() as compiles:  # the calls Triton makes around each compile
            for key in ("a", "cached", "b"):
                if not runtime.jit_cache_hook(key=key, is_manual_warmup=False):
                    runtime.jit_post_compile_hook(key=key, is_manual_warmup=False)
        assert compiles.count == 2 and compiles.seconds >= 0 and seen == ["a", "b"]
        assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == before
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def test_template_share_counts_the_followed_template():
    import bench_rollout
    import bench_trl

    rng = random.Random(3)
    prompt = bench_rollout.make_prompt(rng)
    answer = bench_rollout.make_answer(prompt, rng)
    assert bench_trl.template_share(prompt, answer) == 1.0 and bench_trl.template_share(prompt, []) == 0.0
    assert bench_trl.template_share(prompt, answer[:600]) == 600 / len(answer)
    assert bench_trl.template_share(prompt, answer[:10] + [0] + answer[11:]) == 10 / len(answer)


# ---------------------------------------------------------------- the maintainers' scripts (benchmarks/dev)


@pytest.mark.kernel
@pytest.mark.parametrize("head_dim", [64, 128])
def test_schedule_benchmark_builds_and_gates(head_dim):
    """bench_schedule.py's build (the three kernels' lists at a head dim's blocks) and its gate, the
    block lists against a dense reference; a wrong list fails it."""
    import bench_schedule

    end = PrefixTree.from_sequences(grpo_batch(1, 40, 3, 20)).subtree_end.to(DEVICE)
    schedule = bench_schedule.build(end, end.numel(), True, head_dim)
    assert bench_schedule.lists_gate(schedule, end, head_dim).ok
    other = PrefixTree.from_sequences(grpo_batch(1, 200, 6, 50)).subtree_end.to(DEVICE)  # more query blocks
    assert not bench_schedule.lists_gate(schedule, other, head_dim).ok


def test_attention_timeline_counts_each_kernels_products():
    """attention_timeline.py's useful TFLOP/s: 2, 4 and 3 products per visible pair for the forward,
    dK/dV and dQ kernels by their names (the Triton and the Hopper twins), none for the passes around
    them."""
    import attention_timeline

    from dta_fast.attention import hopper, kernels

    def name(kernel):
        while hasattr(kernel, "fn"):  # an autotuner wraps a JIT function, which wraps the Python one
            kernel = kernel.fn
        return kernel.__name__

    products = {
        kernels.tree_attention_fwd_kernel: 2,
        kernels.tree_attention_bwd_dkdv_kernel: 4,
        kernels.tree_attention_bwd_dq_kernel: 3,
        kernels.tree_attention_bwd_preprocess_kernel: None,
        kernels.finite_rows_kernel: None,
        kernels.queries_seeing_kernel: None,
    }
    if hopper.HAVE_GLUON:
        products.update(
            {
                hopper.tree_attention_fwd_hopper_kernel: 2,
                hopper.tree_attention_bwd_dkdv_hopper_kernel: 4,
                hopper.tree_attention_bwd_dq_hopper_kernel: 3,
            }
        )
    for kernel, n in products.items():
        assert attention_timeline._products(name(kernel)) == n, name(kernel)


@pytest.mark.kernel
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.slow
def test_compare_attention_runs_each_version_from_its_own_tree():
    """compare_attention.py's A/B: the base revision in a git worktree, each version in a subprocess
    importing dta_fast from its own tree; this checkout gated against dta_ref, the base against it."""
    import compare_attention

    inside = subprocess.run(
        ["git", "-C", str(compare_attention.REPO), "rev-parse", "--is-inside-work-tree"], capture_output=True, text=True
    )
    if inside.returncode:
        pytest.skip("not a git checkout")
    with tempfile.TemporaryDirectory() as tmp, compare_attention.worktree("HEAD") as base:
        tmp = Path(tmp)
        (tmp / "now").mkdir()
        torch.save(PrefixTree.from_sequences(grpo_batch(1, 24, 2, 12)).subtree_end, tmp / "end.pt")
        spec = tmp / "cases.json"
        spec.write_text(json.dumps([dict(name="tiny", end=str(tmp / "end.pt"), H=2, Hkv=1, D=16)]))
        kw = dict(timing=False, device=DEVICE)
        (now,) = compare_attention.run_version(
            compare_attention.REPO, spec, tmp / "now.json", reference=True, save=tmp / "now", **kw
        )
        (other,) = compare_attention.run_version(
            base, spec, tmp / "base.json", reference=False, against=tmp / "now", **kw
        )
        assert (base / "dta_fast").is_dir()
    assert now["gate"]["ok"] and other["gate"]["ok"] and "max_abs_diff" in other
    assert not base.exists()


def test_power_benchmark_sample_window():
    """bench_power.py's sampler window: the samples inside it, or the first after its start when it is
    shorter than a sample; the clock-limit reasons seen, by name."""
    import bench_power

    sampler = bench_power.Sampler.__new__(bench_power.Sampler)  # no nvidia-smi: samples set by hand
    sampler.samples = [(1.0, 1980.0, 120.0, 0x1), (2.0, 1700.0, 690.0, 0x4), (3.0, 1600.0, 700.0, 0x4)]
    w = sampler.window(1.5, 3.0)
    assert (w["samples"], w["mhz"], w["watts"], w["reasons"]) == (2, 1650.0, 695.0, ["power cap"])
    assert sampler.window(2.2, 2.4)["mhz"] == 1600.0
    assert sampler.window(0.0, 1.0)["reasons"] == ["idle"]
    assert sampler.window(4.0, 5.0) == dict(samples=0)


def test_memory_snapshot_marks_each_forward_and_close(tiny_model):
    """memory_snapshot.py's marks: the chunk engine's forwards and closes, in the plan's order, and the
    engine as it was after."""
    import memory_snapshot

    from dta_fast.chunked.engine import ChunkEngine

    forward = ChunkEngine.forward
    tree = PrefixTree.from_sequences(grpo_batch(1, 30, 3, 20, vocab_size=300))
    with memory_snapshot.StepMarks(device="cpu") as marks:
        dta_fast.tree_backward(tiny_model, tree, SFTLoss(tree.logprob_mask), max_chunk_tokens=32, recompute=False)
    tiny_model.zero_grad(set_to_none=True)
    forwards = sorted(int(label[1:]) for label in marks.labels if label[0] == "F")
    closes = sorted(int(label[1:]) for label in marks.labels if label[0] == "B")
    assert forwards == closes == list(range(len(forwards))) and len(forwards) > 1
    assert marks.labels[0] == "F0" and marks.labels[-1] == "B0"
    assert ChunkEngine.forward is forward


def test_rollout_profile_runs_both_samplers_on_the_cpu(tmp_path, monkeypatch, capsys):
    import bench_rollout
    import profile_rollout

    monkeypatch.setattr(bench_rollout, "DEVICE", "cpu")
    args = ["--rows", "2", "--prompt", "8", "--new-tokens", "4", "--profiled-steps", "4", "--out", str(tmp_path)]
    profile_rollout.main(args)
    _, rows = harness.read_results(next(tmp_path.iterdir()))
    assert [r["method"] for r in rows] == ["dta_fast.sample", "generate"]
    assert all(r["ms_per_step"] > 0 and r["top_host"] for r in rows)
    assert [r["replayed_steps"] for r in rows] == [0, None]  # no CUDA graphs off CUDA; generate has none
    assert "launches/step" in capsys.readouterr().out


def test_only_gpu_entries_add_up_to_the_gpu_time():
    from types import SimpleNamespace

    kinds = torch.autograd.DeviceType

    def entry(device, annotation=False):
        return SimpleNamespace(device_type=device, is_user_annotation=annotation)

    # a kernel counts; the operator that launched it and a marked range also carry its time, and do not
    assert harness.on_gpu(entry(kinds.CUDA))
    assert not harness.on_gpu(entry(kinds.CPU)) and not harness.on_gpu(entry(kinds.CUDA, annotation=True))


def test_profile_step_sorts_kernels_into_categories():
    import profile_step

    assert profile_step.category("tree_attention_bwd_dkdv_kernel") == "attention"
    assert profile_step.category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert profile_step.category("some_unknown_kernel") == "other"


def test_small_trees_per_path_decomposition_is_tree_attention():
    """small_trees.py's per-path method: each sequence's tokens that no earlier one holds, attending its
    whole path causally (aligned at the path's end, as varlen FlashAttention aligns it), are the tree's
    attention; here with dta_ref's attention per path in place of FlashAttention."""
    import small_trees

    from dta_ref import tree_attention as reference

    tree = PrefixTree.from_sequences(
        [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7], [1, 2, 3, 4, 8], [9, 10], [1, 2, 3]]
    )  # fmt: skip
    paths = small_trees.owned_paths(tree)
    owned = torch.cat([q for q, _ in paths])
    assert sorted(owned.tolist()) == list(range(tree.num_tokens))  # every token a query once
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, tree.num_tokens, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    want = reference(q, k, v, tree.subtree_end)
    got = torch.zeros_like(want)
    for queries, path in paths:
        chain = torch.full((len(path),), len(path))  # a chain: every later token sees each one
        out = reference(q[:, :, queries], k[:, :, path], v[:, :, path], chain)
        got[:, :, queries] = out
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_cuda_graph_cases_are_registered():
    import bench_cuda_graphs

    for case in bench_cuda_graphs.CASES:
        assert case.rollouts in shapes.ROLLOUTS and case.heads in shapes.HEADS


def test_bf16_drift_measures_each_method_against_float32():
    """bf16_drift.py on a tiny Qwen3-Next: the float32 tree sits at rounding distance from the float32
    truth, the bf16 runs measurably further; a tree that computed something else would show."""
    import bf16_drift

    shape = shapes.ModelShape("qwen3_next", 32, 64, 4, 4, 2, 8, 300, tie_word_embeddings=False, extra=dict(
        layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16))  # fmt: skip
    sequences = grpo_batch(1, 40, 3, 20, vocab_size=300)
    errors = bf16_drift.run(shape, sequences)
    assert set(errors) == set(bf16_drift.METHODS) - {"each alone, float32, sdpa"}
    assert errors["tree, float32"]["grad_rel_err"] < 1e-5
    assert errors["each alone, bfloat16, sdpa"]["grad_rel_err"] > 10 * errors["tree, float32"]["grad_rel_err"]
