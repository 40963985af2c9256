"""TreeGRPOTrainer against TRL's own GRPOTrainer: same losses and the same parameters after a few steps.

CPU, float32, a tiny Qwen2 model and a word-level tokenizer built in code (no
downloads). Both trainers start from the same weights and seed; generation
is GRPOTrainer's own in both, so the batches match and any difference comes
from how the logprobs and gradients are computed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from dta_fast.trl import TreeGRPOConfig, TreeGRPOTrainer  # noqa: E402
from tests.helpers import tiny_hf_model  # noqa: E402

WORDS = [f"w{i}" for i in range(58)]


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def prompts():
    # prompts of different lengths, so the prompt block is left-padded
    return datasets.Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9 w10", "w11"] * 4})


def reward_small_ids(completions, **kwargs):
    return [float(sum(int(w[1:]) < 20 for w in c.split() if w.startswith("w"))) for c in completions]


def config(cls, tmp_path, **overrides):
    options = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=3,
        learning_rate=0.5,
        # updates proportional to the gradients (Adam would turn rounding noise in a zero gradient into a full step)
        optim="sgd",
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=7,
        save_strategy="no",
        bf16=False,
        gradient_checkpointing=False,
        temperature=0.9,
        dataloader_num_workers=0,
    )
    options.update(overrides)
    return cls(**options)


def train(trainer_cls, config_cls, tmp_path, model, peft_config=None, loss_scale=None, **overrides):
    torch.manual_seed(0)
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward_small_ids,
        args=config(config_cls, tmp_path, **overrides),
        train_dataset=prompts(),
        processing_class=word_tokenizer(),
        peft_config=peft_config,
    )
    if loss_scale is not None:  # float16 training's GradScaler, which Accelerate makes on GPUs only
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale, growth_interval=1)
    trainable = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    initial = {n: p.detach().clone() for n, p in trainable.items()}
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    updates = {n: p.detach() - initial[n] for n, p in trainable.items()}
    return logs, initial, updates


def assert_same_training(base_logs, base_updates, tree_logs, tree_updates, steps=3):
    """TreeGRPOTrainer logged GRPOTrainer's losses and moved every parameter as it did."""
    assert len(base_logs) == len(tree_logs) == steps
    for base, tree in zip(base_logs, tree_logs, strict=True):
        assert tree["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-6)
    base_update = torch.cat([u.flatten() for u in base_updates.values()])
    tree_update = torch.cat([tree_updates[n].flatten() for n in base_updates])
    assert base_update.norm() > 0 and (tree_update - base_update).norm() <= 1e-4 * base_update.norm()


def lora():
    from peft import LoraConfig

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")


CASES = {
    "plain": dict(),
    "grad-ckpt-reentrant": dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}),
    "grad-ckpt": dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}),
    "kl-and-two-iterations": dict(beta=0.1, num_iterations=2),
    "lora": dict(peft=True),
    # the tree trainer runs the checkpointed layers reentrant (dta_fast.checkpointing): LoRA's frozen inputs
    "lora-grad-ckpt": dict(
        peft=True, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
    ),
    # depth-first chunks through tree_backward, GRPO's loss linearised at the logprobs
    "chunked": dict(tree_max_chunk_tokens=8, num_iterations=2, beta=0.1, temperature=0.7),
    "chunked-grad-ckpt": dict(tree_max_chunk_tokens=8, gradient_checkpointing=True),
    "memory-budget": dict(tree_memory_budget_bytes=4 * 2**30),
    "chunked-checkpointed-layers": dict(tree_max_chunk_tokens=8, tree_checkpoint_layers=True),
    # float16 training's loss scaling (a GradScaler, forced on the CPU): the chunked backward runs inside
    # _compute_loss, so it must scale what it backpropagates as GRPOTrainer's backward does. No clipping:
    # without float16 Accelerate would clip the scaled gradients to norm 1, whatever their scale
    "chunked-grad-scaler": dict(tree_max_chunk_tokens=8, loss_scale=2.0**12, max_grad_norm=0.0),
    "grad-scaler": dict(loss_scale=2.0**12, max_grad_norm=0.0),
    "grad-accum": dict(gradient_accumulation_steps=2, max_grad_norm=0.0),
    "grad-accum-grad-ckpt": dict(
        gradient_accumulation_steps=2,
        max_grad_norm=0.0,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    ),  # fmt: skip
    # old logprobs scored over a generation of two micro-batches, in TRL's batches of one micro-batch
    "grad-accum-two-iterations": dict(gradient_accumulation_steps=2, num_iterations=2, max_grad_norm=0.0),
    "chunked-grad-accum": dict(tree_max_chunk_tokens=8, gradient_accumulation_steps=2, max_grad_norm=0.0),
    # every micro-batch of an optimizer step as one forest (groups cut by the micro-batch boundary share again)
    "one-tree-per-step": dict(
        tree_scope="optimizer_step", gradient_accumulation_steps=2, per_device_train_batch_size=6
    ),
    "one-tree-per-step-chunked": dict(
        tree_scope="optimizer_step", tree_max_chunk_tokens=8, gradient_accumulation_steps=3, num_iterations=2
    ),
    "one-tree-per-step-dapo": dict(tree_scope="optimizer_step", gradient_accumulation_steps=2, loss_type="dapo"),
    "one-tree-per-step-bnpo": dict(tree_scope="optimizer_step", gradient_accumulation_steps=2, loss_type="bnpo"),
    # loss variants: every one is GRPOTrainer's own code on the tree's logprobs (and entropies)
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=2),
    "chunked-two-sided-clip": dict(
        tree_max_chunk_tokens=8, epsilon=0.05, epsilon_high=0.1, delta=1.02, num_iterations=2
    ),
    "dr-grpo-top-entropy": dict(
        loss_type="dr_grpo",
        top_entropy_quantile=0.5,
        mask_truncated_completions=True,
        max_completion_length=12,
        beta=0.05,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tree_grpo_trainer_matches_grpo_trainer(case, tmp_path, monkeypatch):
    import dta_fast.trl as tree_trl

    scored, trained = [], []  # rows of each scored block; the options of each chunked backward
    score, backward = tree_trl.block_logprobs_and_entropy, tree_trl.tree_backward

    def scoring(model, input_ids, *args, **kwargs):
        scored.append(len(input_ids))
        return score(model, input_ids, *args, **kwargs)

    def training(*args, **options):
        trained.append(options)
        return backward(*args, **options)

    monkeypatch.setattr(tree_trl, "block_logprobs_and_entropy", scoring)
    monkeypatch.setattr(tree_trl, "tree_backward", training)
    overrides = dict(CASES[case])
    peft = lora() if overrides.pop("peft", False) else None
    tree_options = ("tree_memory_budget_bytes", "tree_max_chunk_tokens", "tree_checkpoint_layers", "tree_scope")
    chunking = {k: overrides.pop(k) for k in tree_options if k in overrides}
    model = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=3)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.save_pretrained(tmp_path / "model")  # both trainers (and their reference models) load it from disk
    path = str(tmp_path / "model")
    base_logs, base_start, base_updates = train(GRPOTrainer, GRPOConfig, tmp_path / "base", path, peft, **overrides)
    tree_logs, tree_start, tree_updates = train(
        TreeGRPOTrainer, TreeGRPOConfig, tmp_path / "tree", path, peft, **chunking, **overrides
    )
    assert len(base_logs) == len(tree_logs) == 3
    for base, tree in zip(base_logs, tree_logs, strict=True):
        assert tree["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-6)
        assert tree["tree/compression_ratio"] > 1.0  # the 4 generations of each prompt share their prompt
    assert base_start.keys() == tree_start.keys()
    for name in base_start:
        assert torch.equal(base_start[name], tree_start[name]), name
        base, tree = base_start[name] + base_updates[name], tree_start[name] + tree_updates[name]
        assert torch.allclose(tree, base, rtol=1e-5, atol=1e-6), f"{name}: max diff {(tree - base).abs().max():.3e}"
    base_update = torch.cat([u.flatten() for u in base_updates.values()])
    tree_update = torch.cat([tree_updates[n].flatten() for n in base_updates])
    assert base_update.norm() > 0  # training moved the parameters, so the comparison means something
    assert (tree_update - base_update).norm() <= 1e-4 * base_update.norm()
    # the options reach the engine; each tree is one micro-batch (TRL's batch_size), or one optimizer step's
    micro_batch = overrides.get("per_device_train_batch_size", 8)
    whole_step = chunking.pop("tree_scope", None) == "optimizer_step"
    assert scored and max(scored) == (micro_batch * overrides["gradient_accumulation_steps"] if whole_step else 8)
    if chunking or whole_step:
        assert trained and all(k.get("max_chunk_tokens") == chunking.get("tree_max_chunk_tokens") for k in trained)
        assert all(k.get("checkpoint_layers") == chunking.get("tree_checkpoint_layers") for k in trained)
        assert all(k.get("memory_budget_bytes") == chunking.get("tree_memory_budget_bytes") for k in trained)
    else:
        assert not trained
    if whole_step:  # one backward per optimizer step
        assert len(trained) == 3


@pytest.mark.parametrize(
    "precision",
    [
        "bf16",
        pytest.param(
            "fp16",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available(),
                    reason="float16 loss scaling: Accelerate makes its GradScaler on GPUs",
                ),
            ],
        ),
    ],
)
@pytest.mark.parametrize("chunking", [{}, {"tree_max_chunk_tokens": 8}], ids=["packed", "chunked"])
def test_tree_grpo_trainer_under_mixed_precision(precision, chunking, tmp_path):
    """GRPOConfig's bf16=True runs a float32 model under bfloat16 autocast (here on the CPU); fp16=True on
    a GPU, under float16 autocast with Accelerate's own GradScaler (scale 2**16: an unscaled backward
    would make the update 2**16 times too small). One step's loss is GRPOTrainer's, and its update is as
    close to the float32 update as GRPOTrainer's own."""
    model = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=3)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.save_pretrained(tmp_path / "model")
    path = str(tmp_path / "model")
    device = dict(use_cpu=False, max_grad_norm=0.0) if precision == "fp16" else {}  # no clipping: the scale shows

    def step(trainer_cls, config_cls, name, **options):
        logs, _, updates = train(trainer_cls, config_cls, tmp_path / name, path, max_steps=1, **device, **options)
        return logs[0]["loss"], torch.cat([updates[n].flatten() for n in sorted(updates)])

    _, exact = step(GRPOTrainer, GRPOConfig, "exact")
    base_loss, base = step(GRPOTrainer, GRPOConfig, "base", **{precision: True})
    tree_loss, tree = step(TreeGRPOTrainer, TreeGRPOConfig, "tree", **{precision: True}, **chunking)
    assert tree_loss == pytest.approx(base_loss, rel=1e-3, abs=1e-5)
    base_error, error = (base - exact).norm() / exact.norm(), (tree - exact).norm() / exact.norm()
    assert 0 < base_error < 0.1 and error <= 1.5 * base_error + 1e-3, (float(base_error), float(error))


@pytest.mark.parametrize("chunking", [{}, {"tree_max_chunk_tokens": 8}], ids=["packed", "chunked"])
def test_tree_grpo_trainer_evaluates(chunking, tmp_path):
    """evaluate() (GRPOTrainer's prediction_step: its loss under no_grad) gives GRPOTrainer's eval loss
    and leaves the parameters and their gradients alone, with the chunked options too."""
    model = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=3)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.save_pretrained(tmp_path / "model")

    def evaluate(trainer_cls, config_cls, name, **options):
        torch.manual_seed(0)
        trainer = trainer_cls(
            model=str(tmp_path / "model"),
            reward_funcs=reward_small_ids,
            args=config(config_cls, tmp_path / name, per_device_eval_batch_size=8, **options),
            train_dataset=prompts(),
            eval_dataset=prompts(),
            processing_class=word_tokenizer(),
        )
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        metrics = trainer.evaluate()
        for n, p in trainer.model.named_parameters():
            assert torch.equal(p, before[n]) and p.grad is None, n
        return metrics

    base = evaluate(GRPOTrainer, GRPOConfig, "base")
    tree = evaluate(TreeGRPOTrainer, TreeGRPOConfig, "tree", **chunking)
    assert tree["eval_loss"] == pytest.approx(base["eval_loss"], rel=1e-5, abs=1e-6)
    assert tree["eval_reward"] == base["eval_reward"]  # the same generations were scored


def test_tree_grpo_trainer_casts_the_head_to_float32(tmp_path):
    """cast_lm_head_to_fp32 under bf16 autocast: the vocabulary projection in float32, as GRPOTrainer's
    fused head runs it. A model with no decoder layer makes the hidden states the same in both paths, so
    the logprobs and entropies are bitwise GRPOTrainer's, with the option and without."""
    import transformers

    config_ = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=3).config
    config_.num_hidden_layers, config_.layer_types = 0, []
    config_.pad_token_id, config_.eos_token_id = 0, 1
    transformers.Qwen2ForCausalLM(config_).save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 61, (8, 12), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:2, :3] = 0  # left-padded prompts, a right-padded completion
    attention_mask[3, -2:] = 0

    def score(trainer_cls, config_cls, cast):
        torch.manual_seed(0)
        trainer = trainer_cls(
            model=str(tmp_path / "model"),
            reward_funcs=reward_small_ids,
            args=config(config_cls, tmp_path / "out", bf16=True, cast_lm_head_to_fp32=cast),
            train_dataset=prompts(),
            processing_class=word_tokenizer(),
        )
        with torch.no_grad():
            logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, 6, compute_entropy=True
            )
        valid = attention_mask[:, -6:].bool()
        return logps[valid], entropies[valid]

    scores = {}
    for cast in (False, True):
        scores[cast] = score(TreeGRPOTrainer, TreeGRPOConfig, cast)
        for got, want in zip(scores[cast], score(GRPOTrainer, GRPOConfig, cast)):
            assert torch.equal(got, want), (cast, float((got - want).abs().max()))
    assert not torch.equal(scores[True][0], scores[False][0])  # the option changes the numbers


@pytest.mark.parametrize("chunking", [{}, {"tree_max_chunk_tokens": 8}], ids=["packed", "chunked"])
def test_bfloat16_model_with_its_head_cast_to_float32(chunking, tmp_path):
    """A bfloat16 model (the usual way to load one) with cast_lm_head_to_fp32 (TRL replaces the head's
    forward by a float32 one): the chunked pass runs that forward, not the bfloat16 hidden states against
    the float32 weight. One step's loss is GRPOTrainer's, its update as close to the float32 model's."""
    model = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=3)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.save_pretrained(tmp_path / "model")
    path = str(tmp_path / "model")

    def step(trainer_cls, config_cls, name, **options):
        logs, _, updates = train(trainer_cls, config_cls, tmp_path / name, path, max_steps=1, **options)
        return logs[0]["loss"], torch.cat([updates[n].float().flatten() for n in sorted(updates)])

    bf16 = dict(model_init_kwargs={"dtype": "bfloat16"}, cast_lm_head_to_fp32=True)
    _, exact = step(GRPOTrainer, GRPOConfig, "exact")
    base_loss, base = step(GRPOTrainer, GRPOConfig, "base", **bf16)
    tree_loss, tree = step(TreeGRPOTrainer, TreeGRPOConfig, "tree", **bf16, **chunking)
    assert tree_loss == pytest.approx(base_loss, rel=1e-3, abs=1e-5)
    base_error, error = (base - exact).norm() / exact.norm(), (tree - exact).norm() / exact.norm()
    assert 0 < base_error < 0.3 and error <= 1.5 * base_error + 1e-3, (float(base_error), float(error))


def test_attention_dropout_is_refused_at_construction(tmp_path):
    """TRL's disable_dropout zeroes dropout modules, not an attention module's rate, which the tree path
    refuses: before any generation, not at the first step."""
    model = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=3)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention dropout is not supported on the tree path"):
        TreeGRPOTrainer(
            model=model,
            reward_funcs=reward_small_ids,
            args=config(TreeGRPOConfig, tmp_path),
            train_dataset=prompts(),
            processing_class=word_tokenizer(),
        )


@pytest.mark.parametrize(
    "options, exc, match",
    [
        (dict(tree_max_chunk_tokens=0), ValueError, "tree_max_chunk_tokens must be >= 1"),
        (dict(tree_max_chunk_tokens=2.5), TypeError, "tree_max_chunk_tokens must be an int"),
        (dict(tree_memory_budget_bytes=-1), ValueError, "tree_memory_budget_bytes must be"),
        (dict(tree_max_chunk_tokens=8, tree_memory_budget_bytes=2**30), ValueError, "not both"),
        (dict(tree_checkpoint_layers=True), ValueError, "applies to chunks"),
        (dict(tree_max_chunk_tokens=8, tree_checkpoint_layers="yes"), TypeError, "tree_checkpoint_layers must be"),
    ],
)
def test_tree_options_are_checked_with_the_config(options, exc, match, tmp_path):
    """Before any generation: a bad option is an error when the config is made, not at the first step."""
    with pytest.raises(exc, match=match):
        config(TreeGRPOConfig, tmp_path, **options)


def test_memory_budget_refuses_an_entropy_bonus(tmp_path):
    model = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=3)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    with pytest.raises(ValueError, match="entropy bonus"):
        train(TreeGRPOTrainer, TreeGRPOConfig, tmp_path, model, None, tree_max_chunk_tokens=8, entropy_coef=0.01)


def test_chunked_training_refuses_dropout(tmp_path):
    """The chunked path scores GRPO's loss in one forward and trains in another: with dropout their
    masks would differ, so it refuses at construction; the packed path (one forward, its loss and
    gradient on the same masks) trains."""
    from peft import LoraConfig

    def model():
        m = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=3)
        m.config.pad_token_id, m.config.eos_token_id = 0, 1
        return m

    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1, task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match=r"dropout in .*lora_dropout.* \(p=0.1\).*lora_dropout=0.0"):
        train(
            TreeGRPOTrainer, TreeGRPOConfig, tmp_path / "chunked", model(), peft, tree_max_chunk_tokens=8, max_steps=1
        )
    logs, _, updates = train(TreeGRPOTrainer, TreeGRPOConfig, tmp_path / "packed", model(), peft, max_steps=1)
    assert len(logs) == 1 and any(u.norm() > 0 for u in updates.values())


def test_moe_router_aux_loss_as_grpo_trainer(tmp_path):
    """A Qwen3-MoE policy with the router's auxiliary loss in GRPO's loss: TreeGRPOTrainer computes it over
    the tree, each packed token counted once per row that holds it, and logs and trains as GRPOTrainer
    (SGD, 3 steps); with the tree_ chunking options it is refused by name."""
    from tests.helpers import tiny_family_model

    model = tiny_family_model("qwen3-moe", torch.float32, "sdpa", seed=3)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.save_pretrained(tmp_path / "model")
    path = str(tmp_path / "model")
    options = dict(router_aux_loss_coef=0.5)
    base_logs, base_start, base_updates = train(GRPOTrainer, GRPOConfig, tmp_path / "base", path, **options)
    tree_logs, tree_start, tree_updates = train(TreeGRPOTrainer, TreeGRPOConfig, tmp_path / "tree", path, **options)
    assert_same_training(base_logs, base_updates, tree_logs, tree_updates)
    for base, tree in zip(base_logs, tree_logs, strict=True):
        assert base["aux_loss"] > 0 and tree["aux_loss"] == pytest.approx(base["aux_loss"], rel=1e-5)
    with pytest.raises(ValueError, match="router's auxiliary loss"):
        train(TreeGRPOTrainer, TreeGRPOConfig, tmp_path / "chunked", path, tree_max_chunk_tokens=8, **options)


def test_hybrid_linear_attention_policy_as_grpo_trainer(tmp_path):
    """A Qwen3.5 policy (a Gated DeltaNet layer before an attention layer): TreeGRPOTrainer's losses and
    parameters are GRPOTrainer's (SGD, 3 steps), packed and in chunks of 4 tokens (recurrent states read
    across chunks), also with TRL's gradient checkpointing on (non-reentrant)."""
    from tests.helpers import tiny_family_model

    model = tiny_family_model("qwen3.5", torch.float32, "sdpa", seed=3)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.save_pretrained(tmp_path / "model")
    path = str(tmp_path / "model")
    base_logs, _, base_updates = train(GRPOTrainer, GRPOConfig, tmp_path / "base", path)
    tree_logs, _, tree_updates = train(TreeGRPOTrainer, TreeGRPOConfig, tmp_path / "tree", path)
    assert_same_training(base_logs, base_updates, tree_logs, tree_updates)
    chunked_logs, _, chunked_updates = train(
        TreeGRPOTrainer, TreeGRPOConfig, tmp_path / "chunked", path, tree_max_chunk_tokens=4
    )
    assert_same_training(base_logs, base_updates, chunked_logs, chunked_updates)
    checkpointed_logs, _, checkpointed_updates = train(
        TreeGRPOTrainer, TreeGRPOConfig, tmp_path / "checkpointed", path, tree_max_chunk_tokens=4,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
    )  # fmt: skip
    assert_same_training(base_logs, base_updates, checkpointed_logs, checkpointed_updates)


@pytest.mark.parametrize(
    "family,sampled", [("qwen2", False), ("qwen2", True), ("qwen3.5", False)], ids=["greedy", "sampled", "hybrid"]
)
def test_generation_from_the_tree_cache(family, sampled, tmp_path, monkeypatch):
    """tree_generation: completions drawn by dta_fast.speculative_sample, earlier completions of each prompt
    drafting for it. Greedy, they are transformers' generate's, step by step (a hybrid's too: its draft
    tokens fork recurrent states); sampled, the run trains and its cache fills and drafts. (That the draws
    follow the plain sampling distribution is tests/test_rollout.py's test_distribution_is_exact.)"""
    from tests.helpers import tiny_family_model

    model = (
        tiny_hf_model("qwen2", torch.float32, "sdpa", seed=3)
        if family == "qwen2"
        else tiny_family_model(family, torch.float32, "sdpa", seed=3)
    )
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.save_pretrained(tmp_path / "model")
    path = str(tmp_path / "model")
    completions = {}

    def recording(cls):
        original = cls._generate_single_turn

        def generate(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            completions.setdefault(cls.__name__, []).append(out[0])
            return out

        monkeypatch.setattr(cls, "_generate_single_turn", generate)

    recording(GRPOTrainer)
    recording(TreeGRPOTrainer)
    options = dict(max_completion_length=8, beta=0.0)
    if not sampled:
        options["generation_kwargs"] = {"do_sample": False}
        train(GRPOTrainer, GRPOConfig, tmp_path / "base", path, **options)
    logs, _, updates = train(TreeGRPOTrainer, TreeGRPOConfig, tmp_path / "tree", path, tree_generation=True, **options)
    tree_completions = completions["TreeGRPOTrainer"]
    assert len(tree_completions) == 3 and all(len(c) == 8 for c in tree_completions)  # 2 prompts x 4
    assert all(0 < len(c) <= 8 and max(c) < 64 for step in tree_completions for c in step)
    if not sampled:
        assert tree_completions == completions["GRPOTrainer"]
    else:
        assert all(torch.isfinite(torch.tensor(entry["loss"])) for entry in logs)
        assert torch.cat([u.flatten() for u in updates.values()]).norm() > 0
        assert any(entry.get("tree/accepted_draft_tokens", 0) > 0 for entry in logs)


def test_generation_from_the_tree_cache_gives_its_logprobs_as_the_old_ones(tmp_path, monkeypatch):
    """With generation out of step with the optimizer (steps_per_generation 2, no accumulation), GRPOTrainer
    scores the new completions with the policy that drew them (its old logprobs): tree_generation hands it
    the sampler's own logprobs instead of a forward. The same old logprobs, losses and parameters as that
    forward's (SGD, 3 steps); with top-k sampling (another distribution than GRPOTrainer's logprobs) the
    forward runs."""
    import dta_fast.trl as tree_trl

    model = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=3)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.save_pretrained(tmp_path / "model")
    path = str(tmp_path / "model")
    scored, olds = [], []
    original_score, original_loss = tree_trl.block_logprobs_and_entropy, TreeGRPOTrainer._compute_loss

    def score(*args, **kwargs):
        scored.append(torch.is_grad_enabled())
        return original_score(*args, **kwargs)

    def loss(self, model, inputs):
        olds.append(inputs.get("old_per_token_logps") * inputs["completion_mask"])
        return original_loss(self, model, inputs)

    reuse = dict(on=True)
    wanted = TreeGRPOTrainer._behaviour_wanted
    monkeypatch.setattr(tree_trl, "block_logprobs_and_entropy", score)
    monkeypatch.setattr(TreeGRPOTrainer, "_compute_loss", loss)
    monkeypatch.setattr(TreeGRPOTrainer, "_behaviour_wanted", lambda self: reuse["on"] and wanted(self))
    options = dict(tree_generation=True, steps_per_generation=2, max_completion_length=8, beta=0.0)
    runs = {}
    for name, on, extra in [("reused", True, {}), ("forward", False, {}), ("top-k", True, dict(top_k=5))]:
        scored.clear(), olds.clear()
        reuse["on"] = on
        logs, _, updates = train(TreeGRPOTrainer, TreeGRPOConfig, tmp_path / name, path, **options, **extra)
        runs[name] = (logs, updates, [x.clone() for x in olds], scored.count(False))
    # two generations (steps 0 and 2) of 16 rows, scored in micro-batches of 8 without a graph, or not at all
    assert runs["forward"][3] == 4 and runs["reused"][3] == 0 and runs["top-k"][3] == 4
    assert len(runs["reused"][2]) == 3 and all(x.abs().sum() > 0 for x in runs["reused"][2])
    for got, want in zip(runs["reused"][2], runs["forward"][2], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_same_training(runs["forward"][0], runs["forward"][1], runs["reused"][0], runs["reused"][1])


def image_prompts():
    """Conversational prompts with one small random image each (8 x 8: 4 placeholders; 16 x 8: 8)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    rows = []
    for k, (h, w) in enumerate([(8, 8), (8, 16), (16, 8), (8, 8)]):
        picture = Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8), mode="RGB")
        content = [{"type": "image"}, {"type": "text", "text": f"w{5 + k} w{6 + k}"}]
        rows.append({"prompt": [{"role": "user", "content": content}], "image": picture})
    return datasets.Dataset.from_list(rows * 2)


def test_image_prompts_as_grpo_trainer(tmp_path):
    """A Qwen2.5-VL policy on image prompts: TreeGRPOTrainer scores each micro-batch's rows as one tree, each
    distinct image through the vision tower once, and logs and trains as GRPOTrainer (SGD, 3 steps: the
    same losses and parameters, the vision tower's included); so does the chunked path (chunks of 8, and
    a whole optimizer step of two micro-batches as one tree), the tower encoding each step's images once."""
    from tests.helpers import image_processor_in_code, tiny_vl_model

    def run(trainer_cls, config_cls, out, **overrides):
        torch.manual_seed(0)
        trainer = trainer_cls(
            model=tiny_vl_model("qwen2.5-vl", torch.float32, seed=3),
            reward_funcs=lambda completions, **kw: [float(len(str(c))) % 3 for c in completions],
            args=config(
                config_cls, out, per_device_train_batch_size=4, num_generations=2, max_completion_length=4, **overrides
            ),  # fmt: skip
            train_dataset=image_prompts(),
            processing_class=image_processor_in_code(),
        )
        initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        encoded = []
        visual = trainer.model.model.visual
        forward = visual.forward
        visual.forward = lambda x, **kw: encoded.append(len(x)) or forward(x, **kw)
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        updates = {n: p.detach() - initial[n] for n, p in trainer.model.named_parameters()}
        return logs, updates, encoded, trainer

    base_logs, base_updates, base_encoded, _ = run(GRPOTrainer, GRPOConfig, tmp_path / "base")
    tree_logs, tree_updates, encoded, trainer = run(TreeGRPOTrainer, TreeGRPOConfig, tmp_path / "tree")
    assert_same_training(base_logs, base_updates, tree_logs, tree_updates)
    vision = torch.cat([u.flatten() for n, u in tree_updates.items() if ".visual." in n])
    assert vision.norm() > 0  # the vision tower trains through the tree
    # a micro-batch's 4 rows hold 2 distinct images (a prompt's 2 generations share theirs): the tree encodes
    # each once, where GRPOTrainer encodes every row's (generation encodes every row's in both)
    assert sum(encoded) < sum(base_encoded)
    assert all(entry["tree/compression_ratio"] > 1 for entry in tree_logs)
    for name, options in {
        "chunked": dict(tree_max_chunk_tokens=8),
        "step": dict(tree_max_chunk_tokens=8, tree_scope="optimizer_step", gradient_accumulation_steps=2),
    }.items():
        if "gradient_accumulation_steps" in options:
            base_logs, base_updates, _, _ = run(
                GRPOTrainer, GRPOConfig, tmp_path / f"base_{name}", gradient_accumulation_steps=2
            )
        logs, updates, _, _ = run(TreeGRPOTrainer, TreeGRPOConfig, tmp_path / name, **options)
        assert_same_training(base_logs, base_updates, logs, updates)
