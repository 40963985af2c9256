"""Synthetic rollout batches shaped like real RL post-training data.

Token ids are random; only the sharing structure matters for tree training.
"""

from __future__ import annotations

import numpy as np


def _check_sizes(**sizes: tuple[int, int]) -> None:
    """Each ``name=(value, minimum)`` an int of at least ``minimum``, or a clear error naming it."""
    for name, (value, minimum) in sizes.items():
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < minimum:
            raise ValueError(f"{name} must be at least {minimum}, got {value}")


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(0, vocab_size, size=n).tolist()


def grpo_batch(
    num_groups: int = 1,
    prompt_len: int = 2048,
    num_responses: int = 8,
    response_len: int = 1024,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[list[int]]:
    """GRPO: per group one prompt of ``prompt_len`` tokens and ``num_responses``
    responses of ``response_len`` tokens; each rollout is prompt + response."""
    _check_sizes(
        num_groups=(num_groups, 1),
        prompt_len=(prompt_len, 0),
        num_responses=(num_responses, 1),
        response_len=(response_len, 1),
        vocab_size=(vocab_size, 1),
        seed=(seed, 0),
    )
    rng = np.random.default_rng(seed)
    batch = []
    for _ in range(num_groups):
        prompt = _tokens(rng, prompt_len, vocab_size)
        batch += [prompt + _tokens(rng, response_len, vocab_size) for _ in range(num_responses)]
    return batch


def agentic_batch(
    system_len: int = 4800,
    num_tasks: int = 4,
    task_len: int = 200,
    rollouts_per_task: int = 4,
    turns: int = 8,
    assistant_len: int = 150,
    tool_len: int = 300,
    vocab_size: int = 32000,
    seed: int = 0,
    every_turn: bool = True,
) -> list[list[int]]:
    """Agentic multi-turn RL (tau2-bench-like).

    One system prompt shared by all; per task a task prompt; per task
    ``rollouts_per_task`` rollouts of ``turns`` turns (an assistant message,
    then a tool output). Every turn is its own training sample holding the
    whole context up to the end of that turn's assistant message, so the
    samples of one rollout are prefixes of each other. With
    ``every_turn=False`` each rollout is one sample, its whole context.
    """
    _check_sizes(
        system_len=(system_len, 0),
        num_tasks=(num_tasks, 1),
        task_len=(task_len, 0),
        rollouts_per_task=(rollouts_per_task, 1),
        turns=(turns, 1),
        assistant_len=(assistant_len, 1),
        tool_len=(tool_len, 0),
        vocab_size=(vocab_size, 1),
        seed=(seed, 0),
    )
    if not isinstance(every_turn, (bool, np.bool_)):
        raise TypeError(f"every_turn must be a bool, got {type(every_turn).__name__}")
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_len, vocab_size)
    batch = []
    for _ in range(num_tasks):
        context_start = system + _tokens(rng, task_len, vocab_size)
        for _ in range(rollouts_per_task):
            context = list(context_start)
            for turn in range(turns):
                context += _tokens(rng, assistant_len, vocab_size)
                if every_turn or turn + 1 == turns:
                    batch.append(list(context))
                if turn + 1 < turns:
                    context += _tokens(rng, tool_len, vocab_size)
    return batch
