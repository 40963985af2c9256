"""One RL training step computed two ways: each rollout alone, and one packed prefix tree.

    python -m dta_ref.demo [--seed S] [--dtype float64|float32] [--quick] [--threads N]

For a synthetic GRPO batch and an agentic multi-turn batch it prints how much
the prefix tree compresses the batch, then runs the same clipped
policy-gradient step on a small reference decoder (a) with every rollout run
alone and (b) with one packed forward over the tree, and compares the
logprobs and every parameter gradient. The demo is a check: it exits with
status 1 when the two ways differ by more than the tolerance of the dtype.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from .batches import agentic_batch, grpo_batch
from .logprobs import flat_logprobs, tree_logprobs
from .losses import policy_gradient_loss
from .model import Decoder, DecoderConfig
from .tree import PrefixTree

VOCAB_SIZE = 512
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}


@dataclass
class Case:
    name: str
    sequences: list[list[int]]
    loss_mask: torch.Tensor  # bool [N, Lmax-1]: which next-token logprobs enter the loss
    advantages: torch.Tensor  # [N]
    normalization: str


def grpo_case(quick: bool, seed: int) -> Case:
    groups, prompt, responses, response = (2, 128, 4, 32) if quick else (2, 256, 8, 64)
    seqs = grpo_batch(groups, prompt, responses, response, vocab_size=VOCAB_SIZE, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    rewards = torch.rand(groups, responses, generator=gen, dtype=torch.float64)
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    t = torch.arange(prompt + response - 1)
    # logprob t scores token t+1: the response tokens are t + 1 >= prompt
    mask = (t >= prompt - 1).expand(len(seqs), -1)
    return Case("GRPO", seqs, mask, advantages.flatten(), "sequence_mean")


def agentic_case(quick: bool, seed: int) -> Case:
    if quick:
        system, tasks, task, rollouts, turns, assistant, tool = 240, 2, 20, 2, 3, 8, 16
    else:
        system, tasks, task, rollouts, turns, assistant, tool = 480, 3, 40, 3, 4, 16, 32
    seqs = agentic_batch(system, tasks, task, rollouts, turns, assistant, tool, vocab_size=VOCAB_SIZE, seed=seed)
    gen = torch.Generator().manual_seed(seed + 2)
    per_rollout = torch.randn(tasks * rollouts, generator=gen, dtype=torch.float64)
    advantages = per_rollout.repeat_interleave(turns)  # every turn sample of a rollout shares its advantage
    lengths = torch.tensor([len(s) for s in seqs])
    t = torch.arange(int(lengths.max()) - 1)
    # each turn sample is trained on its last assistant message
    mask = (t[None, :] >= lengths[:, None] - 1 - assistant) & (t[None, :] < lengths[:, None] - 1)
    return Case("agentic", seqs, mask, advantages, "token_mean")


def train_step(model, case: Case, old_logprobs, packed: bool):
    """Logprobs [N, L], parameter gradients and wall seconds of one forward + loss + backward."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if packed:
        logprobs = tree_logprobs(model, PrefixTree.from_sequences(case.sequences))
    else:
        logprobs = flat_logprobs(model, case.sequences)
    loss = policy_gradient_loss(
        logprobs, old_logprobs, case.advantages.to(logprobs.dtype), case.loss_mask, normalization=case.normalization
    )
    loss.backward()
    seconds = time.perf_counter() - start
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logprobs.detach(), grads, seconds


def compare(model, case: Case, seed: int) -> tuple[float, float, float, float]:
    tree = PrefixTree.from_sequences(case.sequences)
    valid = tree.logprob_mask
    with torch.no_grad():
        current = tree_logprobs(model, tree)
    gen = torch.Generator().manual_seed(seed + 3)
    noise = 0.05 * torch.randn(current.shape, generator=gen, dtype=torch.float64).to(current.dtype)
    old_logprobs = torch.where(valid, current + noise, 0.0)

    lp_flat, g_flat, t_flat = train_step(model, case, old_logprobs, packed=False)
    lp_tree, g_tree, t_tree = train_step(model, case, old_logprobs, packed=True)
    lp_diff = float((lp_tree - lp_flat)[valid].abs().max())
    grad_diff = max(float((g_tree[n] - g_flat[n]).abs().max() / g_flat[n].abs().max()) for n in g_flat)
    return lp_diff, grad_diff, t_flat, t_tree


def warm_up(model) -> None:
    """Pay torch's one-time start-up costs outside the timed steps."""
    tiny = [[1, 2, 3, 4], [1, 2, 5]]
    (flat_logprobs(model, tiny).sum() + tree_logprobs(model, PrefixTree.from_sequences(tiny)).sum()).backward()
    model.zero_grad(set_to_none=True)


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dta_ref.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=_int_at_least(0), default=0)
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--quick", action="store_true", help="smaller batches")
    parser.add_argument(
        "--threads", type=_int_at_least(1), default=1, help="torch CPU threads (default 1: steadiest timings)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tol = TOLERANCE[dtype]

    torch.manual_seed(args.seed)
    cfg = DecoderConfig(vocab_size=VOCAB_SIZE, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = Decoder(cfg).to(dtype)
    cases = [grpo_case(args.quick, args.seed), agentic_case(args.quick, args.seed)]
    warm_up(model)

    print(f"Prefix-tree batches (reference decoder: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {args.dtype})")
    print()
    print(f"{'batch':<8} {'sequences':>9} {'flat tokens':>11} {'unique tokens':>13} {'compression':>11}")
    for case in cases:
        tree = PrefixTree.from_sequences(case.sequences)
        print(
            f"{case.name:<8} {tree.num_sequences:>9} {tree.flat_tokens:>11} {tree.num_tokens:>13} "
            f"{tree.compression_ratio:>10.2f}x"
        )
    print()
    print("One policy-gradient step: (a) each sequence alone, (b) one packed tree")
    print()
    print(f"{'batch':<8} {'flat s':>7} {'tree s':>7} {'speedup':>7} {'max|dlogprob|':>13} {'max rel dgrad':>13}")
    ok = True
    for case in cases:
        lp_diff, grad_diff, t_flat, t_tree = compare(model, case, args.seed)
        ok &= lp_diff <= tol and grad_diff <= tol
        print(
            f"{case.name:<8} {t_flat:>7.2f} {t_tree:>7.2f} {t_flat / t_tree:>6.1f}x {lp_diff:>13.1e} {grad_diff:>13.1e}"
        )
    print()
    print("Times are wall seconds of forward + loss + backward. dta_ref's packed attention uses a dense")
    print("T x T mask, so it pays for every masked pair; the tree kernels of dta_fast skip them.")
    print()
    if ok:
        print(f"OK: tree logprobs and gradients match the per-sequence ones within {tol:g}")
        return 0
    print(f"FAIL: a difference exceeds {tol:g}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
