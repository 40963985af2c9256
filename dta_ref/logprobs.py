"""Per-sequence next-token logprobs: each rollout alone, or one packed tree.

Both functions return the same padded tensor [N, Lmax-1]: entry [i, t] is
log p(seq_i[t+1] | seq_i[:t+1]), and 0 where t >= len_i - 1. At a branch
point one packed position predicts different next tokens for different
rollouts, so logprobs are gathered per (sequence, step), never per packed
position; autograd then sums the gradients of shared positions exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .adapter import adapt
from .attention import masked_attend
from .checks import check_flag, check_temperature
from .linear_attention import TreeLinearMixing
from .multimodal import check_images
from .tree import PrefixTree, _as_token_list


def logprob_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logprobs are computed in float32 for half-precision models, else in the model's dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature)[..., target] for logits [..., V] and targets [...]."""
    return scaled_log_softmax(logits, temperature).gather(-1, targets[..., None]).squeeze(-1)


def next_token_targets(tree: PrefixTree):
    """Where each (sequence, step) reads its logits from and which token it scores.

    Returns ``rows`` [N, Lmax-1] (packed index of seq_i[t], 0 where invalid),
    ``targets`` [N, Lmax-1] (the token seq_i[t+1], 0 where invalid) and
    ``valid`` [N, Lmax-1] bool.
    """
    valid = tree.seq_index[:, 1:] >= 0
    rows = torch.where(valid, tree.seq_index[:, :-1], 0)
    targets = torch.where(valid, tree.tokens[tree.seq_index[:, 1:].clamp(min=0)], 0)
    return rows, targets, valid


@dataclass
class LogprobsAndEntropy:
    """Per-sequence next-token logprobs and the entropy of each next-token distribution, both [N, Lmax-1];
    and a MoE model's router auxiliary loss where it was asked for."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    aux_loss: torch.Tensor | None = None


def check_logprob_mask(mask, tree: PrefixTree):
    """None, or a bool [N, Lmax-1] tensor choosing which logprobs to compute."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
    shape = (tree.num_sequences, tree.max_length - 1)
    if tuple(mask.shape) != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, the tree's logprobs {shape}")
    return mask


def check_packed_hidden(hidden, tree: PrefixTree) -> None:
    """``hidden`` must be the tree's packed hidden states [T, hidden]."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[0] != tree.num_tokens:
        raise ValueError(
            f"hidden must be the tree's packed hidden states [{tree.num_tokens}, hidden], got "
            f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}"
        )


def scaled_log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) over the last dimension, in :func:`logprob_dtype`."""
    logits = logits.to(logprob_dtype(logits.dtype))
    return torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)


def entropy_of(logp: torch.Tensor) -> torch.Tensor:
    """Entropy of the distributions whose log-probabilities are ``logp`` [..., V]."""
    return -(logp.exp() * logp).sum(-1)


def gather_tree_logprobs(
    hidden: torch.Tensor, head, tree: PrefixTree, temperature: float = 1.0, entropy=False, mask=None
):
    """Per-sequence logprobs [N, Lmax-1] from packed hidden states [T, hidden] (and entropies, with ``entropy``).

    With ``mask`` [N, Lmax-1], entries outside it are 0.
    """
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"expected a PrefixTree, got {type(tree).__name__}")
    tree.validate()
    check_packed_hidden(hidden, tree)
    temperature, mask = check_temperature(temperature), check_logprob_mask(mask, tree)
    rows, targets, valid = next_token_targets(tree)
    valid = valid if mask is None else valid & mask.to(valid.device)
    logp = scaled_log_softmax(head(hidden), temperature)  # [T, V]
    out = logp[rows, targets].masked_fill(~valid, 0.0)
    if not entropy:
        return out
    return LogprobsAndEntropy(out, entropy_of(logp)[rows].masked_fill(~valid, 0.0))


def packed_hidden(model, tree: PrefixTree, router_aux_loss: bool = False, images=None):
    """The packed forest's final hidden states [T, hidden], the tree on the model's device, and the router
    auxiliary loss over the rollouts (each packed token weighted by its multiplicity) or None. ``images``:
    a vision-language model's images in packed order (``dta_ref.pack_images``)."""
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"expected a PrefixTree, got {type(tree).__name__}")
    tree.validate()
    adapter = adapt(model)
    images = check_images(images, tree, adapter.device)
    adapter.check_token_ids(tree.tokens)
    tree = tree.to(adapter.device)
    index = torch.arange(tree.num_tokens, device=tree.tokens.device)
    attend = masked_attend(tree.subtree_end, index, tree.position_ids)
    out = adapter.hidden_states(
        tree.tokens[None], tree.position_ids[None], attend, output_router_logits=router_aux_loss,
        linear=TreeLinearMixing(tree.parent), images=images,
    )  # fmt: skip
    if not router_aux_loss:
        return out[0], tree, None
    return out[0][0], tree, adapter.router_aux_loss(out[1], tree.multiplicity)


def tree_logprobs(model, tree: PrefixTree, *, temperature: float = 1.0, mask=None, images=None) -> torch.Tensor:
    """Logprobs of every rollout from one packed forward over the tree (explicit mask).

    ``temperature`` divides the logits first, as an RL trainer scoring its
    samples at the sampling temperature does. ``mask`` (bool [N, Lmax-1]):
    only those logprobs are wanted (the others are 0), so a trainer that
    scores responses only never projects its prompt rows. ``images``: a
    vision-language model's images, from ``dta_ref.pack_images`` with the tree.
    """
    temperature, mask = check_temperature(temperature), check_logprob_mask(mask, tree)
    head = adapt(model).head  # before the forward: a value model has none
    hidden, tree, _ = packed_hidden(model, tree, images=images)
    return gather_tree_logprobs(hidden, head, tree, temperature, mask=mask)


def tree_logprobs_and_entropy(
    model, tree: PrefixTree, *, temperature: float = 1.0, mask=None, router_aux_loss: bool = False, images=None
) -> LogprobsAndEntropy:
    """:func:`tree_logprobs` and the entropy of every next-token distribution, from one packed forward.
    ``router_aux_loss``: also a MoE model's load-balancing loss, equal to that of the padded batch of the
    tree's rollouts (each packed token counted once per rollout that holds it)."""
    temperature, mask = check_temperature(temperature), check_logprob_mask(mask, tree)
    head = adapt(model).head
    hidden, tree, aux = packed_hidden(model, tree, check_flag("router_aux_loss", router_aux_loss), images)
    out = gather_tree_logprobs(hidden, head, tree, temperature, entropy=True, mask=mask)
    out.aux_loss = aux
    return out


def flat_logprobs(model, sequences, *, temperature: float = 1.0) -> torch.Tensor:
    """Logprobs of every rollout, each run alone as an ordinary causal sequence (ground truth).

    A Hugging Face model runs exactly as its user built it (its own attention
    implementation and causal mask); the reference decoder runs causal attention.
    """
    if isinstance(sequences, PrefixTree):
        sequences = [sequences.sequence(i) for i in range(sequences.num_sequences)]
    if isinstance(sequences, (torch.Tensor, np.ndarray)) and sequences.ndim == 2:
        sequences = list(sequences)
    if not isinstance(sequences, (list, tuple)):
        raise TypeError(f"sequences must be a list of token sequences, got {type(sequences).__name__}")
    if len(sequences) == 0:
        raise ValueError("empty batch: at least one sequence is needed")
    temperature = check_temperature(temperature)
    adapter = adapt(model)
    seqs = [_as_token_list(s, i) for i, s in enumerate(sequences)]
    adapter.check_token_ids(torch.tensor([max(s) for s in seqs]))
    device = adapter.device
    width = max(len(s) for s in seqs) - 1
    rows = []
    for s in seqs:
        ids = torch.tensor(s, device=device)[None]
        positions = torch.arange(len(s), device=device)[None]
        logits = adapter.logits(ids, positions)[0]
        lp = token_logprobs(logits[:-1], ids[0, 1:], temperature)
        rows.append(F.pad(lp, (0, width - lp.shape[0])))
    return torch.stack(rows)
