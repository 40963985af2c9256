"""What the trainer integrations (dta_fast.trl, dta_fast.verl) share."""

from __future__ import annotations

import torch

from dta_ref.adapter import adapt
from dta_ref.checks import check_temperature
from dta_ref.losses import TokenLoss
from dta_ref.multimodal import pack_images
from dta_ref.padded import PaddedLayout

from .checkpointing import model_checkpointing_reentrant
from .logprobs import gather_logprobs_chunked, packed_hidden
from .tree import build_tree


def block_logprobs_and_entropy(
    model, input_ids, attention_mask, first_column: int, temperature: float = 1.0, vocab_head=None,
    router_aux_loss: bool = False, images=None, packed=None,
):  # fmt: skip
    """Logprobs and entropies [B, L - first_column] of a padded batch's tokens from ``first_column`` on.

    One prefix tree of the rows, one packed forward; only the block's tokens
    are projected onto the vocabulary (by ``vocab_head``, see
    :func:`dta_fast.logprobs.gather_logprobs_chunked`). Also returns the tree
    (its compression ratio is worth logging) and, with ``router_aux_loss``, a
    MoE model's load-balancing loss over the rows' tokens, that of the padded
    batch (else None). A row whose block has a token
    but nothing before it is refused: that token has no context to be
    scored from (a logprob of 0 would read as a certain token). ``images``:
    a vision-language model's ``(pixel_values, image_grid_thw)`` per row,
    packed with the rows by ``dta_ref.pack_images``; ``packed``: its result
    (tree, images) where the caller packed them already.
    """
    temperature = check_temperature(temperature)
    layout = PaddedLayout.of(attention_mask)
    block = attention_mask[:, first_column:].bool()
    no_prompt = (layout.start.to(block.device) >= first_column) & block.any(1)
    if no_prompt.any():
        raise ValueError(
            f"row {int(no_prompt.nonzero()[0])} has no prompt token: its first response token has no context to "
            "be scored from"
        )
    sequences = layout.sequences(input_ids)
    if packed is not None:
        tree, packed = packed
    elif images is not None:
        tree, packed = pack_images(model, sequences, *images)
    else:
        tree = build_tree(sequences)
    wanted = layout.to_tree(block, first_column, fill=False)
    head = adapt(model).head
    with model_checkpointing_reentrant(model, recording=router_aux_loss):  # the trainer's backward is a plain one
        hidden, tree, aux = packed_hidden(model, tree, router_aux_loss=router_aux_loss, images=packed)
    out = gather_logprobs_chunked(
        hidden, head, tree, temperature=temperature, entropy=True, mask=wanted, vocab_head=vocab_head
    )
    columns = input_ids.shape[1] - first_column
    logprobs, entropy = (layout.from_tree(x, first_column, columns) for x in (out.logprobs, out.entropy))
    return logprobs, entropy, tree, aux


class LinearizedLoss(TokenLoss):
    """sum(weights * logprobs): a loss linearised at the current logprobs (weights = d loss / d logprob)."""

    def _term(self, seq, step, logprobs):
        return logprobs


def dropout_in(model) -> str | None:
    """The name and rate of the first dropout module of ``model`` that drops anything (p > 0), or None:
    passes that must draw the same masks cannot when they run different forwards."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"{name or type(module).__name__} (p={module.p})"
    return None
