"""The tree engines inside verl's own TrainingWorker, against verl's FSDP2 engines on the same batch.

Runs where verl is installed (the pinned environment `.ci/run` builds). verl's FSDP engines need an
accelerator; on a CPU machine these tests give verl a CPU platform (gloo, no memory statistics) and run
the real worker, engine, FSDP2 sharding, loss and optimizer step, verl's engine and the tree engine
from the same checkpoint and batch. The batch is built as verl's trainer builds it: left-padded
prompts, right-padded responses, ``left_right_2_no_padding``, the trainer's flags.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref

import pytest
import torch

verl = pytest.importorskip("verl")

from verl.plugin.platform import platform_manager  # noqa: E402
from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

import dta_fast.verl.engine as tree_engines  # noqa: E402

PAD, VOCAB, PROMPT_WIDTH, RESPONSE_WIDTH = 0, 64, 6, 6
# two prompts, four responses each: siblings share their prompt and some share a first response token
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]
RESPONSES = [[20, 21, 22], [20, 21, 23, 24, 25], [30], [20, 40, 41, 42, 43, 44],
             [50, 51], [50, 52, 53], [54], [50, 51, 55, 56]]  # fmt: skip
GROUP = 4


class _CpuDevice:
    """torch.cpu with what verl reads of an accelerator's memory (nothing to report: 0)."""

    def __getattr__(self, name):
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name == "get_device_name":
            return lambda *args: "CPU"
        if name == "mem_get_info":
            return lambda *args: (0, 0)
        if "memory" in name:
            return lambda *args: 0
        raise AttributeError(name)


class _CpuPlatform(PlatformBase):
    """verl's platform interface on the CPU: gloo collectives, no device to select."""

    device_name, vendor_name, device_module = "cpu", "cpu", _CpuDevice()

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CPU_VISIBLE_DEVICES"

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def get_device_capability(self, device_index=0):
        return None, None

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def set_device(self, *args): ...
    def synchronize(self, *args): ...
    def set_allocator_settings(self, *args): ...
    def empty_cache(self): ...
    def profiler_start(self): ...
    def profiler_stop(self): ...
    def is_ipc_supported(self): ...
    def cudart(self): ...


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    """A one-rank gloo group and verl on the CPU; verl's engines are looked up under "cuda"."""
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               VERL_ENGINE_DEVICE="cuda")  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if torch.cuda.is_available():
        pytest.skip("these tests put verl on the CPU; on a GPU machine verl runs as it is")
    platform_manager.set_platform(_CpuPlatform())
    started = not torch.distributed.is_initialized()
    if started:
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    yield
    if started:
        torch.distributed.destroy_process_group()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny Qwen2 policy and a tiny Qwen2 token-classifier critic, saved with a tokenizer built in code."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1")
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False, pad_token_id=PAD, eos_token_id=1)  # fmt: skip
    paths = {}
    for name, make in (
        ("policy", lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))),
        ("critic", lambda: transformers.Qwen2ForTokenClassification(
            transformers.Qwen2Config(**config, num_labels=1, classifier_dropout=0.0))),
    ):  # fmt: skip
        torch.manual_seed(0)
        paths[name] = tmp_path_factory.mktemp(name)
        make().save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


@contextlib.contextmanager
def registered(model_type: str, engine):
    """``engine`` as verl's FSDP2 engine for ``model_type`` while a worker is built."""
    by_device = EngineRegistry._engines[model_type]["fsdp2"]
    before = by_device["cuda"]
    by_device["cuda"] = engine
    try:
        yield
    finally:
        by_device["cuda"] = before


def worker(path, model_type: str, tree: bool, *, remove_padding=True, dynamic_bsz=False, micro_batch=GROUP,
           checkpointing=False, lora_rank=0, loss_config=None, param_dtype="fp32", max_tokens=24):  # fmt: skip
    """verl's TrainingWorker on ``path`` with verl's FSDP2 engine or the tree engine, SGD, computing in
    ``param_dtype`` (float32 unless asked)."""
    from functools import partial

    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss, value_loss

    model = HFModelConfig(
        path=str(path), override_config={"attn_implementation": "sdpa"}, use_remove_padding=remove_padding,
        enable_gradient_checkpointing=checkpointing, lora_rank=lora_rank, lora_alpha=16,
    )  # fmt: skip
    engine = FSDPEngineConfig(
        strategy="fsdp2", model_dtype="fp32", mixed_precision={"param_dtype": param_dtype}, use_torch_compile=False,
        use_dynamic_bsz=dynamic_bsz, micro_batch_size_per_gpu=micro_batch, infer_micro_batch_size_per_gpu=micro_batch,
        max_token_len_per_gpu=max_tokens, infer_max_token_len_per_gpu=max_tokens,
    )  # fmt: skip
    optimizer = FSDPOptimizerConfig(lr=0.5, optimizer="SGD", weight_decay=0.0, clip_grad=1e9)
    base = FSDPEngineWithLMHead if model_type == "language_model" else FSDPEngineWithValueHead
    chosen = {FSDPEngineWithLMHead: tree_engines.TreeFSDPEngineWithLMHead,
              FSDPEngineWithValueHead: tree_engines.TreeFSDPEngineWithValueHead}[base] if tree else base  # fmt: skip
    config = TrainingWorkerConfig(model_type=model_type, model_config=model, engine_config=engine,
                                  optimizer_config=optimizer, checkpoint_config=CheckpointConfig())  # fmt: skip
    torch.manual_seed(0)  # LoRA's initial A matrices
    with registered(model_type, chosen):
        out = TrainingWorker(config)
    assert type(out.engine) is chosen
    out.reset()
    if loss_config is not None:
        out.set_loss_fn(partial(ppo_loss if model_type == "language_model" else value_loss, config=loss_config))
    return out


def rollout_batch(seed=0, **flags):
    """The batch verl's trainer hands its workers: left-padded prompts, right-padded responses, and what
    the advantage and old-policy steps add, in verl's no-padding layout, with the trainer's flags."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = [], []
    for i, response in enumerate(RESPONSES):
        prompt = PROMPTS[i // GROUP]
        ids.append([PAD] * (PROMPT_WIDTH - len(prompt)) + prompt + response + [PAD] * (RESPONSE_WIDTH - len(response)))
        mask.append([0] * (PROMPT_WIDTH - len(prompt)) + [1] * (len(prompt) + len(response))
                    + [0] * (RESPONSE_WIDTH - len(response)))  # fmt: skip
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    response_mask = mask[:, PROMPT_WIDTH:]
    batch = {
        "input_ids": ids, "attention_mask": mask, "position_ids": torch.clip(mask.cumsum(-1) - 1, min=0),
        "prompts": ids[:, :PROMPT_WIDTH], "responses": ids[:, PROMPT_WIDTH:], "response_mask": response_mask,
        "old_log_probs": (-4.0 + 0.3 * torch.randn(response_mask.shape, generator=g)) * response_mask,
        "ref_log_prob": (-4.0 + 0.3 * torch.randn(response_mask.shape, generator=g)) * response_mask,
        "advantages": torch.randn(len(RESPONSES), 1, generator=g).expand_as(response_mask) * response_mask,
        "values": torch.randn(response_mask.shape, generator=g) * response_mask,
        "returns": torch.randn(response_mask.shape, generator=g) * response_mask,
    }  # fmt: skip
    td = left_right_2_no_padding(tu.get_tensordict(batch))
    tu.assign_non_tensor(td, global_token_num=mask.sum(-1).tolist(), **flags)
    return td


def update_flags(temperature=1.0, calculate_entropy=False):
    """What verl's trainer sets for an update: one mini-batch of the whole batch, one epoch, no shuffle."""
    n = len(RESPONSES)
    return dict(calculate_entropy=calculate_entropy, global_batch_size=n, mini_batch_size=n, epochs=1, seed=1,
                dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=temperature)  # fmt: skip


def parameters(w) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in w.engine.module.named_parameters()}


def close_parameters(got: dict, want: dict, start: dict):
    """The same update: every parameter within 1e-5 of its size of step (and some step taken)."""
    moved = 0.0
    for name in want:
        step = (want[name] - start[name]).norm()
        moved = max(moved, float(step))
        assert float((got[name] - want[name]).norm()) <= 1e-5 * max(float(step), 1e-3), name
    assert moved > 1e-3


def actor_config(**options):
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(strategy="fsdp2", rollout_n=GROUP, ppo_mini_batch_size=len(PROMPTS),
                           ppo_micro_batch_size_per_gpu=GROUP, use_torch_compile=False, **options)  # fmt: skip


# ---------------------------------------------------------------------------------------------- policy


@pytest.mark.parametrize("remove_padding", [True, False], ids=["remove-padding", "padded"])
def test_log_probs_and_entropies_equal_verls(checkpoints, remove_padding):
    """compute_log_prob's outputs: the tree engine's equal verl's engine's, at a temperature."""
    got = {}
    for tree in (False, True):
        w = worker(checkpoints["policy"], "language_model", tree, remove_padding=remove_padding)
        td = rollout_batch(calculate_entropy=True, compute_loss=False, temperature=0.7)
        out = w.infer_batch(td)
        got[tree] = [no_padding_2_padding(tu.get(out, key), td) for key in ("log_probs", "entropy")]
    mask = rollout_batch()["response_mask"].bool()
    for tree_out, verl_out in zip(got[True], got[False], strict=True):
        torch.testing.assert_close(tree_out[mask], verl_out[mask], rtol=1e-5, atol=1e-5)
    assert (got[False][0][mask] < -1).all()  # real log-probabilities (vocabulary 64)


def test_log_probs_in_bfloat16_as_close_as_verls(checkpoints):
    """verl's default precision (FSDP2 parameters in bfloat16 under autocast): the tree's log-probabilities
    are as close to the float32 ones as verl's own."""
    mask = rollout_batch()["response_mask"].bool()

    def log_probs(tree, param_dtype):
        w = worker(checkpoints["policy"], "language_model", tree, param_dtype=param_dtype)
        td = rollout_batch(calculate_entropy=False, compute_loss=False, temperature=1.0)
        return no_padding_2_padding(tu.get(w.infer_batch(td), "log_probs"), td).float()[mask]

    exact = log_probs(False, "fp32")
    own_error = (log_probs(False, "bf16") - exact).abs().max()
    error = (log_probs(True, "bf16") - exact).abs().max()
    assert 0 < own_error < 0.1 and error <= 2 * own_error, (float(own_error), float(error))


@pytest.mark.parametrize(
    "loss_agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_update_policy_equals_verls(checkpoints, loss_agg_mode):
    """One PPO update (clipped ratio, an entropy bonus, a KL loss, two micro-batches): the parameters after
    verl's optimizer step are those of verl's engine."""
    config = actor_config(loss_agg_mode=loss_agg_mode, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    after = {}
    for tree in (False, True):
        w = worker(checkpoints["policy"], "language_model", tree, loss_config=config)
        start = parameters(w)
        w.train_mini_batch(rollout_batch(**update_flags(temperature=0.8, calculate_entropy=True)))
        after[tree] = parameters(w)
    close_parameters(after[True], after[False], start)


@pytest.mark.parametrize(
    "options",
    [
        dict(remove_padding=False),
        dict(dynamic_bsz=True),
        dict(dynamic_bsz=True, max_tokens=40),
        dict(checkpointing=True),
        dict(lora_rank=4),
        dict(micro_batch=len(RESPONSES)),
    ],
    ids=["padded", "dynamic-bsz", "dynamic-bsz-whole-groups", "gradient-checkpointing", "lora", "one-micro-batch"],
)
def test_update_policy_equals_verls_with_verls_options(checkpoints, options):
    config = actor_config(loss_agg_mode="token-mean")
    after = {}
    for tree in (False, True):
        w = worker(checkpoints["policy"], "language_model", tree, loss_config=config, **options)
        start = parameters(w)
        w.train_mini_batch(rollout_batch(**update_flags()))
        after[tree] = parameters(w)
    close_parameters(after[True], after[False], start)


@pytest.mark.parametrize(
    "options, trees",
    [
        (dict(), [10, 17]),
        (dict(dynamic_bsz=True, max_tokens=40), [10, 17]),
        (dict(dynamic_bsz=True, max_tokens=24), None),
    ],
    ids=["micro-batches-of-a-group", "dynamic-bsz", "dynamic-bsz-groups-too-long"],
)
def test_a_group_is_one_tree(checkpoints, monkeypatch, options, trees):
    """A group is one tree: its prompt once, and response tokens shared by siblings once. Dynamic batching
    packs by length, cutting groups; the tree engine keeps each group whole where its 35 or 22 (flat)
    tokens fit a micro-batch, and leaves verl's packing where they do not (still exact)."""
    built, build = [], tree_engines.build_tree
    monkeypatch.setattr(tree_engines, "build_tree", lambda sequences: built.append(build(sequences)) or built[-1])
    w = worker(checkpoints["policy"], "language_model", True, **options)
    w.infer_batch(rollout_batch(calculate_entropy=False, compute_loss=False, temperature=1.0))
    # group 0: 35 flat tokens, the prompt's 5 and the trie of its responses' 12; group 1: 22 flat, 3 + 7
    got = sorted(t.num_tokens for t in built)
    assert got == trees if trees else len(got) > 2 and sum(got) > 27


# ---------------------------------------------------------------------------------------------- critic


def critic_config():
    from verl.workers.config import FSDPCriticConfig

    return FSDPCriticConfig(strategy="fsdp2", rollout_n=GROUP, ppo_mini_batch_size=len(PROMPTS),
                            ppo_micro_batch_size_per_gpu=GROUP, cliprange_value=0.2)  # fmt: skip


@pytest.fixture
def critics_without_flash_attention(monkeypatch):
    """verl loads a critic with FlashAttention 2, which has no CPU build: SDPA instead."""
    import transformers

    load = transformers.AutoModelForTokenClassification.from_pretrained

    def with_sdpa(*args, **kwargs):
        return load(*args, **{**kwargs, "attn_implementation": "sdpa"})

    monkeypatch.setattr(transformers.AutoModelForTokenClassification, "from_pretrained", with_sdpa)


@pytest.mark.usefixtures("critics_without_flash_attention")
def test_critic_values_and_update_equal_verls(checkpoints):
    """compute_values and update_critic: the tree engine's values and parameters are verl's engine's."""
    values, after = {}, {}
    for tree in (False, True):
        w = worker(checkpoints["critic"], "value_model", tree, loss_config=critic_config())
        td = rollout_batch(compute_loss=False, temperature=1.0)  # verl's critic reads the rollout's temperature
        values[tree] = no_padding_2_padding(tu.get(w.infer_batch(td), "values"), td)
        start = parameters(w)
        w.train_mini_batch(rollout_batch(**update_flags()))
        after[tree] = parameters(w)
    mask = rollout_batch()["response_mask"].bool()
    torch.testing.assert_close(values[True][mask], values[False][mask], rtol=1e-5, atol=1e-6)
    close_parameters(after[True], after[False], start)


# ---------------------------------------------------------------------------------------------- refusals


def test_importing_registers_the_tree_engines():
    """In place of verl's FSDP2 engines (what verl's external_lib import does); FSDP1 refused by name."""
    tree_engines.register()
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is tree_engines.TreeFSDPEngineWithLMHead
    assert EngineRegistry.get_engine_cls("value_model", "fsdp2") is tree_engines.TreeFSDPEngineWithValueHead
    with pytest.raises(ValueError, match="run on FSDP2: set strategy=fsdp2"):
        EngineRegistry.new("language_model", "fsdp", model_config=None)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda td: tu.assign_non_tensor(td, distillation_use_topk=True), "top-k distillation"),
        (lambda td: tu.assign_non_tensor(td, calculate_sum_pi_squared=True), "sum of squared probabilities"),
        (lambda td: tu.assign_non_tensor(td, enable_routing_replay=True), "routing replay"),
        (lambda td: td.__setitem__("temperature", torch.tensor([0.7] * 4 + [1.0] * 4)), "one temperature"),
    ],
    ids=["distillation", "sum-pi-squared", "routing-replay", "per-rollout-temperature"],
)
def test_what_the_tree_does_not_compute_is_refused(checkpoints, change, message):
    w = worker(checkpoints["policy"], "language_model", True, micro_batch=len(RESPONSES))
    td = rollout_batch(calculate_entropy=False, compute_loss=False, temperature=1.0)
    change(td)
    with pytest.raises(ValueError, match=message):
        w.infer_batch(td)


# ---------------------------------------------------------------------------------------------- images


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    """A tiny Qwen2.5-VL policy (vision tower of patch 2, merging 2 x 2 patches per token), with a tokenizer."""
    from tests.helpers import image_processor_in_code, tiny_vl_model

    path = tmp_path_factory.mktemp("vl")
    tiny_vl_model("qwen2.5-vl", torch.float32, seed=1).save_pretrained(path)
    image_processor_in_code().tokenizer.save_pretrained(path)
    return path


def image_rollout_batch(model, seed=0, **flags):
    """Two prompts with an image each (4 x 4 and 4 x 8 patches), two rollouts each, laid out as verl's
    trainer hands them over: left-padded prompts, right-padded responses, ``multi_modal_inputs`` per row,
    and positions [4, L] per row (the text count over the model's own multimodal rotary positions)."""
    from tests.helpers import IMAGE, VISION_END, VISION_START

    g = torch.Generator().manual_seed(seed)
    pictures = [(torch.randn(16, 12, generator=g), torch.tensor([[1, 4, 4]])),
                (torch.randn(32, 12, generator=g), torch.tensor([[1, 4, 8]]))]  # fmt: skip
    prompts = [[1, VISION_START] + [IMAGE] * 4 + [VISION_END, 5, 6], [1, VISION_START] + [IMAGE] * 8 + [VISION_END, 9]]
    responses = [[20, 21, 22], [20, 23], [30, 31], [32]]
    width = max(map(len, prompts))
    ids, mask, inputs = [], [], []
    for k, response in enumerate(responses):
        prompt = prompts[k // 2]
        ids.append([PAD] * (width - len(prompt)) + prompt + response + [PAD] * (3 - len(response)))
        mask.append([0] * (width - len(prompt)) + [1] * (len(prompt) + len(response)) + [0] * (3 - len(response)))
        pixels, grid = pictures[k // 2]
        inputs.append({"pixel_values": pixels, "image_grid_thw": grid})
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    rotary, _ = model.model.get_rope_index(
        ids, (ids == IMAGE).int(), image_grid_thw=torch.cat([x["image_grid_thw"] for x in inputs]), attention_mask=mask
    )
    text = torch.clip(mask.cumsum(-1) - 1, min=0)
    positions = torch.cat([text[None], rotary]).transpose(0, 1)  # [B, 4, L]
    response_mask = mask[:, width:]
    batch = {
        "input_ids": ids, "attention_mask": mask, "position_ids": positions, "prompts": ids[:, :width],
        "responses": ids[:, width:], "response_mask": response_mask, "multi_modal_inputs": inputs,
        "old_log_probs": (-4.0 + 0.3 * torch.randn(response_mask.shape, generator=g)) * response_mask,
        "advantages": torch.randn(len(responses), 1, generator=g).expand_as(response_mask) * response_mask,
    }  # fmt: skip
    td = left_right_2_no_padding(tu.get_tensordict(batch))
    tu.assign_non_tensor(td, global_token_num=mask.sum(-1).tolist(), **flags)
    return td


def test_images_in_the_tree_engine_equal_verls(vl_checkpoint):
    """A Qwen2.5-VL policy with image prompts: log-probabilities and the SGD update, vision tower included,
    of the tree engine are verl's engine's; each distinct image through the tower once."""
    config = actor_config(loss_agg_mode="token-mean")
    got, after = {}, {}
    # verl's engine with padding removal patches Qwen2.5-VL's attention with a flash-attention forward (no
    # CPU build); the tree engine leaves verl's patches out, so it runs with padding removal on, and first
    for tree in (True, False):
        w = worker(vl_checkpoint, "language_model", tree, loss_config=config, remove_padding=tree)
        model = w.engine.module
        td = image_rollout_batch(model, calculate_entropy=True, compute_loss=False, temperature=1.0)
        got[tree] = [no_padding_2_padding(tu.get(w.infer_batch(td), k), td) for k in ("log_probs", "entropy")]
        start = parameters(w)
        encoded, forward = [], model.model.visual.forward
        model.model.visual.forward = lambda x, e=encoded, f=forward, **kw: e.append(len(x)) or f(x, **kw)
        flags = update_flags()
        flags.update(global_batch_size=4, mini_batch_size=4)
        w.train_mini_batch(image_rollout_batch(model, **flags))
        after[tree] = parameters(w)
        if tree:  # micro-batches of 4 rows: two distinct images, 16 + 32 patches, once
            assert encoded and all(n == 48 for n in encoded), encoded
    mask = image_rollout_batch(w.engine.module)["response_mask"].bool()
    for tree_out, verl_out in zip(got[True], got[False], strict=True):
        torch.testing.assert_close(tree_out[mask], verl_out[mask], rtol=1e-5, atol=1e-5)
    close_parameters(after[True], after[False], start)
    assert any(float((after[True][n] - start[n]).norm()) > 0 for n in start if ".visual." in n)


def test_videos_are_refused():
    rows = [{"pixel_values": torch.zeros(16, 12), "image_grid_thw": torch.tensor([[1, 4, 4]])},
            {"pixel_values_videos": torch.zeros(16, 12), "video_grid_thw": torch.tensor([[1, 4, 4]])}]  # fmt: skip
    with pytest.raises(ValueError, match=r"take images .pixel_values, image_grid_thw., not \['pixel_values_videos'"):
        tree_engines._images_per_row({"multi_modal_inputs": rows})
    assert tree_engines._images_per_row({"multi_modal_inputs": [None, {}]}) is None  # text rows only


def test_the_verl_benchmark_gates_then_times(tmp_path, monkeypatch):
    """benchmarks/bench_verl.py on a tiny Qwen2: in float32 verl's engine (both layouts, fused kernels)
    and the tree engine in verl's worker make the same update, in bf16 the tree's is as near verl's
    float32 update as verl's own bf16 one (the gates), then verl's two layouts and the tree are timed; an
    update that differs fails a gate and gives no speed figure."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_verl

    args = bench_verl.parser().parse_args(
        ["--prompts", "2", "--group", "4", "--prompt-len", "6", "--response", "6", "--repeats", "1"]
    )  # fmt: skip
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=VOCAB)  # fmt: skip
    built, build = [], bench_verl.worker

    def kept(*args, **kwargs):  # each worker's model, to see that none outlives its run
        w = build(*args, **kwargs)
        built.append(weakref.ref(w.engine.module))
        return w

    monkeypatch.setattr(bench_verl, "worker", kept)
    row = bench_verl.run("qwen2-0.5b", args, str(tmp_path / "a"), **tiny)
    gc.collect()
    assert len(built) == 2 * len(bench_verl.ENGINES) and all(ref() is None for ref in built)
    monkeypatch.setattr(bench_verl, "worker", build)
    assert row["gate_ok"] and row["exact_rel_diff"] < 1e-4 and row["speedup"] > 0
    assert set(row["engines"]) == {"verl", "verl_padded", "tree"}
    assert row["baseline"] in ("verl", "verl_padded")
    assert row["unique_tokens"] < row["tokens"] and len(row["engines"]["tree"]["step_seconds"]) == 1
    bench_verl.print_table([row])
    right = bench_verl.parameters

    def off(w):  # the tree engine's parameters read 10% off
        p = right(w)
        return p * 1.1 if type(w.engine).__name__.startswith("Tree") else p

    monkeypatch.setattr(bench_verl, "parameters", off)
    row = bench_verl.run("qwen2-0.5b", args, str(tmp_path / "b"), **tiny)
    assert not row["gate_ok"] and "speedup" not in row and "seconds" not in row["engines"]["tree"]
    monkeypatch.setattr(bench_verl, "parameters", right)
    calls, exact_update = [], bench_verl.update

    def bf16_tree_off(w, td):  # float32 right, the tree's bf16 update 50% off: the drift gate fails
        calls.append(type(w.engine).__name__)
        bf16 = len(calls) > len(bench_verl.ENGINES)  # after the float32 gate's updates
        scale = 1.5 if bf16 and calls[-1].startswith("Tree") else 1.0
        return exact_update(w, td) * scale

    monkeypatch.setattr(bench_verl, "update", bf16_tree_off)
    row = bench_verl.run("qwen2-0.5b", args, str(tmp_path / "c"), **tiny)
    assert row["exact_rel_diff"] < 1e-4 and not row["gate_ok"] and "speedup" not in row
    sizes = []
    monkeypatch.setattr(bench_verl, "update", lambda w, td: sizes.append(len(td)) or exact_update(w, td))
    small = bench_verl.parser().parse_args(
        ["--prompts", "2", "--group", "4", "--prompt-len", "6", "--response", "6", "--repeats", "1",
         "--gate-prompts", "1"]
    )  # fmt: skip
    row = bench_verl.run("qwen2-0.5b", small, str(tmp_path / "d"), **tiny)  # the gates on one group, timed on two
    assert row["gate_ok"] and row["gate_prompts"] == 1 and sizes == [4] * 6 and row["exact_rel_diff"] < 1e-4
    small.gate_prompts = 3
    with pytest.raises(ValueError, match="--gate-prompts must be between 1 and --prompts"):
        bench_verl.run("qwen2-0.5b", small, str(tmp_path / "e"), **tiny)


def test_the_verl_profile_measures_every_engine(tmp_path):
    """benchmarks/dev/profile_verl.py on a tiny Qwen2: verl's two layouts and the tree in float32 lie as
    near each other as exact updates do, and each engine's bf16 step is profiled, with verl's fused
    kernels and without them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_verl
    from dev import profile_verl

    args = bench_verl.parser().parse_args(["--prompts", "2", "--group", "4", "--prompt-len", "6", "--response", "6"])
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=VOCAB)  # fmt: skip
    for fused in ("torch", None):
        row = profile_verl.run(args, fused, False, str(tmp_path / str(fused)), **tiny)
        assert set(row["float32_rel_diff"]) == {"verl~verl_padded", "tree~verl", "tree~verl_padded"}
        assert all(d < 1e-4 for d in row["float32_rel_diff"].values())
        assert set(row["bf16"]) == set(bench_verl.ENGINES) and all(r["seconds"] > 0 for r in row["bf16"].values())
    profile_verl.print_table(row)
