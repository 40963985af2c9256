"""The one registry of benchmark shapes: rollout sets, attention head layouts and model shapes.

Every benchmark names its shapes from here, so "GRPO P=2K N=8 R=1K" is one tree everywhere:

- ``ROLLOUTS``: rollout sets (docs: DESIGN "Benchmark shapes"). ``ROLLOUTS[key].sequences()`` builds
  their token sequences with ``dta_ref.grpo_batch`` / ``agentic_batch``; ``.tree()`` packs them.
  Token ids are random, so the vocabulary decides how often two rollouts share a first token by
  chance: attention benchmarks keep dta_ref's default (32,000), model benchmarks pass the model's.
- ``HEADS``: attention head layouts (query heads / K/V heads, head dim).
- ``ATTENTION``: the (rollout set, head layout) cases of ``bench_attention.py --shapes GROUP``.
- ``MODELS``: model shapes with random weights (``MODELS[key].build(device)``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # this checkout's dta_ref, whether installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dta_ref import PrefixTree, agentic_batch, grpo_batch  # noqa: E402

VOCAB = 32000  # dta_ref's default vocabulary for batches that feed attention alone


def _k(n: int) -> str:
    """2048 -> "2K", 512 -> "512"."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class Grpo:
    """Per group one prompt of ``prompt`` tokens and ``responses`` responses of ``response`` tokens."""

    prompt: int
    responses: int
    response: int
    groups: int = 1
    label: str = "GRPO"  # "DualKV" for the DualKV paper's shapes (the same layout: a shared prompt, depth 1)

    @property
    def name(self) -> str:
        if self.label == "DualKV":
            return f"DualKV N={self.responses} P={_k(self.prompt)} R={_k(self.response)}"
        groups = f"{self.groups} groups, " if self.groups > 1 else ""
        return f"GRPO {groups}P={_k(self.prompt)} N={self.responses} R={_k(self.response)}"

    def sequences(self, vocab_size: int = VOCAB, seed: int = 0) -> list[list[int]]:
        return grpo_batch(self.groups, self.prompt, self.responses, self.response, vocab_size=vocab_size, seed=seed)


@dataclass(frozen=True)
class GrpoMixed:
    """``groups`` GRPO groups whose prompts grow: group g has a prompt of ``prompt_step * (1 + g)`` tokens."""

    groups: int = 16
    prompt_step: int = 512
    responses: int = 16
    response: int = 1024

    @property
    def name(self) -> str:
        return (
            f"GRPO {self.groups} groups, P in {self.prompt_step}..{_k(self.prompt_step * self.groups)}, "
            f"N={self.responses}, R={_k(self.response)}"
        )

    def sequences(self, vocab_size: int = VOCAB, seed: int = 0) -> list[list[int]]:
        return sum(
            (
                grpo_batch(
                    1, self.prompt_step * (1 + g), self.responses, self.response, vocab_size=vocab_size, seed=seed + g
                )
                for g in range(self.groups)
            ),
            [],
        )


@dataclass(frozen=True)
class Agentic:
    """tau2-bench-like (after AReaL-DTA): a shared system prompt, per task a task prompt, per task
    ``rollouts`` rollouts of ``turns`` turns (assistant 150 tokens, tool 300); each turn its own sample
    (``every_turn``) or each rollout one sample."""

    tasks: int = 4
    rollouts: int = 4
    turns: int = 8
    every_turn: bool = True

    @property
    def name(self) -> str:
        one = "" if self.every_turn else ", one sample per rollout"
        return f"agentic {self.tasks} tasks x {self.rollouts} rollouts x {self.turns} turns{one}"

    def sequences(self, vocab_size: int = VOCAB, seed: int = 0) -> list[list[int]]:
        return agentic_batch(
            num_tasks=self.tasks,
            rollouts_per_task=self.rollouts,
            turns=self.turns,
            vocab_size=vocab_size,
            seed=seed,
            every_turn=self.every_turn,
        )


@dataclass(frozen=True)
class IrregularAgentic:
    """Agentic rollouts with irregular turns: ``min_turns`` to ``max_turns`` per rollout, each message
    of ``min_len`` to ``max_len`` tokens; every turn a sample holding the context so far."""

    tasks: int = 4
    rollouts: int = 4
    min_turns: int = 4
    max_turns: int = 12
    min_len: int = 40
    max_len: int = 900
    system: int = 4800
    task: int = 200

    @property
    def name(self) -> str:
        return (
            f"agentic, irregular turns: {self.tasks} tasks x {self.rollouts} rollouts x "
            f"{self.min_turns}-{self.max_turns} turns of {self.min_len}-{self.max_len} tokens"
        )

    def sequences(self, vocab_size: int = VOCAB, seed: int = 0) -> list[list[int]]:
        rng = np.random.default_rng(seed)

        def tokens(n):
            return rng.integers(0, vocab_size, size=int(n)).tolist()

        system, batch = tokens(self.system), []
        for _ in range(self.tasks):
            start = system + tokens(self.task)
            for _ in range(self.rollouts):
                context, turns = list(start), int(rng.integers(self.min_turns, self.max_turns + 1))
                for turn in range(turns):
                    context += tokens(rng.integers(self.min_len, self.max_len + 1))  # assistant
                    batch.append(list(context))
                    if turn + 1 < turns:
                        context += tokens(rng.integers(self.min_len, self.max_len + 1))  # tool
        return batch


@dataclass(frozen=True)
class Chain:
    """One sequence of ``tokens`` tokens: no tree, plain causal attention."""

    tokens: int

    @property
    def name(self) -> str:
        return f"causal {_k(self.tokens)} (one sequence)"

    def sequences(self, vocab_size: int = VOCAB, seed: int = 0) -> list[list[int]]:
        return [np.random.default_rng(seed).integers(0, vocab_size, size=self.tokens).tolist()]


RolloutSet = Grpo | GrpoMixed | Agentic | IrregularAgentic | Chain

ROLLOUTS: dict[str, RolloutSet] = {
    # GRPO trees of the attention table
    "grpo_p2k_n8_r1k": Grpo(2048, 8, 1024),
    "grpo_p8k_n16_r1k": Grpo(8192, 16, 1024),
    "grpo_p16k_n16_r2k": Grpo(16384, 16, 2048),
    "grpo_p1k_n64_r512": Grpo(1024, 64, 512),
    "grpo_p8k_n8_r1k": Grpo(8192, 8, 1024),  # 16K tokens: the windowed rows
    # the DualKV paper's shapes (a long shared prompt, many responses)
    "dualkv_n28_p4k_r2k": Grpo(4096, 28, 2048, label="DualKV"),
    "dualkv_n28_p16k_r2k": Grpo(16384, 28, 2048, label="DualKV"),
    "dualkv_n16_p32k_r2k": Grpo(32768, 16, 2048, label="DualKV"),
    # TRL micro-batches (one prompt and its G completions) besides grpo_p2k_n8_r1k
    "grpo_p1k_n8_r1k": Grpo(1024, 8, 1024),
    "grpo_p2k_n16_r1k": Grpo(2048, 16, 1024),
    # small trees: chunk-sized calls at which a call's host cost shows
    "grpo_p128_n4_r64": Grpo(128, 4, 64),
    "grpo_p512_n4_r256": Grpo(512, 4, 256),
    "grpo_p512_n8_r256": Grpo(512, 8, 256),
    # batches of several groups (partition, distributed)
    "grpo_8x_p2k_n8_r1k": Grpo(2048, 8, 1024, groups=8),
    "grpo_mixed_16": GrpoMixed(),
    # agentic
    "agentic_1x4x8": Agentic(1, 4, 8),
    "agentic_4x4x8": Agentic(4, 4, 8),
    "agentic_8x4x8": Agentic(8, 4, 8),
    "agentic_16x4x8": Agentic(16, 4, 8),
    "agentic_16x8x8": Agentic(16, 8, 8),
    "agentic_irregular": IrregularAgentic(),
    # long paths: one sample per rollout of 60 turns (31.7K tokens each)
    "agentic_long_1x1": Agentic(1, 1, 60, every_turn=False),
    "agentic_long_10x4": Agentic(10, 4, 60, every_turn=False),
    "causal_16k": Chain(16384),
}


def agentic(tasks: int, rollouts: int = 4, turns: int = 8, every_turn: bool = True) -> Agentic:
    """An agentic rollout set of another size (``--tasks`` options); the registry's own are in ROLLOUTS."""
    return Agentic(tasks, rollouts, turns, every_turn)


def long_paths(tasks: int, rollouts: int = 4) -> Agentic:
    """Agentic forests of paths of 31.7K tokens (60 turns, one sample per rollout), ``tasks`` tasks."""
    return replace(ROLLOUTS["agentic_long_10x4"], tasks=tasks, rollouts=rollouts)


def tree(rollouts: RolloutSet | str, vocab_size: int = VOCAB, seed: int = 0) -> PrefixTree:
    """The packed tree of a rollout set (a registry key or a set)."""
    rollouts = ROLLOUTS[rollouts] if isinstance(rollouts, str) else rollouts
    return PrefixTree.from_sequences(rollouts.sequences(vocab_size, seed))


@dataclass(frozen=True)
class Heads:
    """An attention head layout: query heads, K/V heads (GQA when fewer), head dim."""

    q: int
    kv: int
    dim: int

    @property
    def name(self) -> str:
        return f"{self.q}/{self.kv} heads, D={self.dim}"


HEADS: dict[str, Heads] = {
    "h32_d128": Heads(32, 32, 128),
    "h32_kv8_d128": Heads(32, 8, 128),  # the agentic and DualKV rows
    "qwen2": Heads(14, 2, 64),  # Qwen2-0.5B's attention
    "qwen3": Heads(16, 8, 128),  # Qwen3-1.7B's attention
    "gemma3": Heads(16, 8, 256),  # Gemma-3-12B's attention
    "gpt_oss": Heads(64, 8, 64),  # GPT-OSS-20B's attention
}

# What a model's attention computes beyond the plain tree rule (dta_fast.tree_attention's keywords)
VARIANTS: dict[str, dict] = {
    "window1024": dict(window=1024),  # Gemma 3's local layers
    "sinks_window128": dict(window=128, sinks=True),  # GPT-OSS's local layers
}


@dataclass(frozen=True)
class AttentionCase:
    rollouts: str  # a ROLLOUTS key
    heads: str  # a HEADS key
    variant: str | None = None  # a VARIANTS key

    @property
    def name(self) -> str:
        extra = f", {self.variant}" if self.variant else ""
        return f"{ROLLOUTS[self.rollouts].name}, {HEADS[self.heads].name}{extra}"


def _cases(rollouts: list[str], heads: str) -> list[AttentionCase]:
    return [AttentionCase(r, heads) for r in rollouts]


_GRPO = ["grpo_p2k_n8_r1k", "grpo_p8k_n16_r1k", "grpo_p16k_n16_r2k", "grpo_p1k_n64_r512"]
_DUALKV = ["dualkv_n28_p4k_r2k", "dualkv_n28_p16k_r2k", "dualkv_n16_p32k_r2k"]
ATTENTION: dict[str, list[AttentionCase]] = {
    "grpo": _cases(_GRPO, "h32_d128"),
    "dualkv": _cases(_DUALKV, "h32_kv8_d128"),
    "agentic": _cases(["agentic_4x4x8"], "h32_kv8_d128"),
    "qwen2": _cases(_GRPO[:2] + ["agentic_4x4x8"], "qwen2"),
    "causal": _cases(["causal_16k"], "h32_d128"),  # no tree: SDPA's default on the same causal problem
    "qwen2_rest": _cases(_GRPO[2:] + _DUALKV, "qwen2"),  # the other trees at Qwen2-0.5B's heads
    "variants": [  # sliding windows and attention sinks on a 16K-token GRPO tree
        AttentionCase("grpo_p8k_n8_r1k", "gemma3", "window1024"),
        AttentionCase("grpo_p8k_n8_r1k", "gpt_oss", "sinks_window128"),
    ],
}


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape; ``build`` makes it with random weights (Hugging Face transformers)."""

    family: str  # a transformers model type: qwen2, qwen3, llama, qwen3_moe, qwen3_5_text, ...
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = True
    extra: dict = field(default_factory=dict, compare=False)  # other config fields

    @property
    def heads(self) -> Heads:
        return Heads(self.num_attention_heads, self.num_key_value_heads, self.head_dim)

    def config(self, **overrides):
        import transformers

        fields = dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_dropout=0.0,
            max_position_embeddings=65536,
        )
        return transformers.AutoConfig.for_model(self.family, **{**fields, **self.extra, **overrides})

    def build(
        self, device="cuda", dtype=None, attn_implementation: str = "sdpa", seed: int = 0, head: str = "lm", **overrides
    ):
        """The model in training mode, weights drawn from ``seed`` (bfloat16 unless ``dtype``); ``head="value"``
        builds it as a critic (a token classifier of one label)."""
        import torch
        import transformers

        if head not in ("lm", "value"):
            raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
        auto = transformers.AutoModelForCausalLM if head == "lm" else transformers.AutoModelForTokenClassification
        critic = dict(num_labels=1, classifier_dropout=0.0)  # no dropout, as RL trainers train critics
        config = self.config(**overrides, **({} if head == "lm" else critic))
        torch.manual_seed(seed)
        with torch.device(device):
            model = auto.from_config(config, attn_implementation=attn_implementation, dtype=dtype or torch.bfloat16)
        return model.train()


MODELS: dict[str, ModelShape] = {
    "qwen2-0.5b": ModelShape("qwen2", 896, 4864, 24, 14, 2, 64, 151936),
    "qwen3-1.7b": ModelShape("qwen3", 2048, 6144, 28, 16, 8, 128, 151936),
    # Qwen3-30B-A3B's layers, halved in depth and experts to train on one H100: 8.3B parameters, 2.0B active
    "qwen3-moe-8b-a2b": ModelShape(
        "qwen3_moe",
        2048,
        6144,
        24,
        32,
        4,
        128,
        151936,
        tie_word_embeddings=False,
        extra=dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    ),  # fmt: skip
    # a Qwen3.5 hybrid text model (three Gated DeltaNet layers to one attention layer), 2B-sized
    "qwen3.5-2b": ModelShape(
        "qwen3_5_text",
        2048,
        6144,
        24,
        8,
        2,
        256,
        151936,
        extra=dict(layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6),
    ),  # fmt: skip
    # Qwen3-Next-80B-A3B's layers at 24 layers and 64 experts of 512 (top-8, a shared expert), three Gated
    # DeltaNet layers to one attention layer: 6.3B parameters, 2.1B active
    "qwen3-next-6b-a2b": ModelShape(
        "qwen3_next",
        2048,
        5632,
        24,
        16,
        2,
        256,
        151936,
        tie_word_embeddings=False,
        extra=dict(
            num_experts=64,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
        ),
    ),  # fmt: skip
    # bench_rollout.py's policy: a small Llama (24.1M parameters) over a 512-token vocabulary
    "llama-24m": ModelShape(
        "llama", 512, 1408, 8, 8, 4, 64, 512, tie_word_embeddings=False, extra=dict(max_position_embeddings=4096)
    ),
}


def build_model(name: str, device="cuda", **kwargs):
    """``MODELS[name].build(device, ...)``."""
    return MODELS[name].build(device, **kwargs)
