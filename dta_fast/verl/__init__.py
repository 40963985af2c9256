"""verl's actor log-probabilities from one prefix tree per micro-batch.

verl's PPO actor scores a micro-batch laid out as ``input_ids`` /
``attention_mask`` / ``position_ids`` [B, L] (a left-padded prompt followed
by the right-padded response block) and ``responses`` [B, R], the last R
columns of ``input_ids``; it returns, per response token, the log-probability
under ``logits / temperature`` and optionally the entropy, both [B, R], zero
where the response is padding. :func:`verl_log_probs` returns the same from
one packed forward over the prefix tree of the micro-batch's rows (OpenRLHF's
actor lays its batch out the same way: ``sequences`` with an
``attention_mask`` and the action block at the end). verl's PPO critic scores
the same layout: :func:`verl_values` gives its values [B, R], that of the
state before each response token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dta_ref.multimodal import pack_images
from dta_ref.padded import PaddedLayout

from ..trainer_common import block_logprobs_and_entropy
from ..tree import build_tree
from ..values import tree_values


@dataclass
class ResponseLogProbs:
    """Per response token [B, R]: log-probability, and entropy when asked for (else None)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None


def verl_log_probs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    responses: torch.Tensor,
    *,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    multi_modal_inputs=None,
) -> ResponseLogProbs:
    """log p(response token) and the entropy, [B, R], for a verl micro-batch, through one prefix tree.

    ``position_ids`` must be verl's text positions (the running count of
    tokens, as ``compute_position_id_with_mask`` makes them): the tree gives
    every token its depth, which is that count. A vision-language micro-batch
    passes verl's ``multi_modal_inputs`` (one dict per row, with its
    ``pixel_values`` and ``image_grid_thw``) and its multimodal positions
    [B, 3 or 4, L], which must be the model's own (``get_rope_index``; with 4
    axes the first is the text count): each distinct image is encoded once.
    """
    images = None if multi_modal_inputs is None else images_of_rows(multi_modal_inputs)
    layout = _check_micro_batch(input_ids, attention_mask, position_ids, responses, multimodal=images is not None)
    packed = None
    if images is not None:
        packed = pack_images(model, layout.sequences(input_ids), *images)
        _check_padded_positions(position_ids, attention_mask, layout, *packed)
    first_column = input_ids.shape[1] - responses.shape[1]
    log_probs, entropy, *_ = block_logprobs_and_entropy(
        model, input_ids, attention_mask, first_column, temperature, packed=packed
    )
    return ResponseLogProbs(log_probs, entropy if calculate_entropy else None)


IMAGE_INPUTS = {"pixel_values", "image_grid_thw"}


def images_of_rows(rows):
    """verl's ``multi_modal_inputs`` (one dict per row) as each row's (pixel_values, image_grid_thw); None
    when no row has an image. Other inputs (videos) are refused by name."""
    rows = [getattr(row, "data", row) or {} for row in rows]
    if not any(row.get("pixel_values") is not None for row in rows):
        return None
    other = sorted({key for row in rows for key, value in row.items() if value is not None} - IMAGE_INPUTS)
    if other:
        raise ValueError(f"multi_modal_inputs on the tree take images (pixel_values, image_grid_thw), not {other}")
    pixels = [row.get("pixel_values", torch.zeros(0)) for row in rows]
    grids = [row.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long)) for row in rows]
    return pixels, grids


def _check_padded_positions(position_ids, attention_mask, layout, tree, images) -> None:
    """A padded multimodal micro-batch's positions [B, 3 or 4, L] must be the model's own per row."""
    for i in range(position_ids.shape[0]):
        real = attention_mask[i].bool().to(position_ids.device)
        given = position_ids[i][:, real].to(images.position_ids.device)
        want = images.position_ids[:, tree.seq_index[i, : int(real.sum())].to(images.position_ids.device)]
        if given.shape[0] == 4:  # verl's text positions over the three rotary axes
            text, given = given[0], given[1:]
            if not torch.equal(text, torch.arange(len(text), device=text.device)):
                raise ValueError(f"row {i}: its text positions do not count its tokens from 0")
        if not torch.equal(given, want):
            raise ValueError(f"row {i}: the multimodal positions are not the model's own (get_rope_index)")


def _check_micro_batch(input_ids, attention_mask, position_ids, responses, multimodal=False) -> PaddedLayout:
    """The rows' layout, once the micro-batch is checked to be verl's: text positions (multimodal ones are
    checked against the packed images), responses the tail."""
    for name, x in (("input_ids", input_ids), ("responses", responses)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor [batch, length], got {getattr(x, 'shape', x)}")
    for name, x in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if name == "position_ids" and multimodal:
            B, L = input_ids.shape
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or (x.shape[0], x.shape[2]) != (B, L) or x.shape[1] < 3:
                shape = getattr(x, "shape", x)
                raise ValueError(f"position_ids must be [batch, 3 or 4, length] with images, got {shape}")
            continue
        if not isinstance(x, torch.Tensor) or x.shape != input_ids.shape:
            hint = " (multimodal positions need multi_modal_inputs)" if name == "position_ids" else ""
            raise ValueError(
                f"{name} must be [batch, length] like input_ids {tuple(input_ids.shape)}, got "
                f"{tuple(getattr(x, 'shape', ()))}{hint}"
            )
    batch, width = input_ids.shape
    response_length = responses.shape[1]
    if responses.shape[0] != batch or response_length > width:
        raise ValueError(f"responses {tuple(responses.shape)} must be the last columns of input_ids {(batch, width)}")
    if not torch.equal(responses, input_ids[:, width - response_length :]):
        raise ValueError("responses must equal the last response_length columns of input_ids")
    layout = PaddedLayout.of(attention_mask)
    if multimodal:
        return layout
    columns = torch.arange(width, device=position_ids.device)
    depth = columns - layout.start.to(position_ids.device)[:, None]
    real = attention_mask.bool().to(position_ids.device)
    if not torch.equal(position_ids[real], depth[real]):
        raise ValueError("position_ids must count the tokens of each row from 0 (verl's text positions)")
    return layout


def verl_values(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
    responses: torch.Tensor, *, value_head=None, attention_impl: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """verl's critic values [B, R] for a micro-batch, through one prefix tree.

    Column c is the value of the state before response token c (the critic's
    output at the token before it, as verl's ``values[:, -R - 1 : -1]``), 0
    where the response is padding. The critic is a token classifier with
    ``num_labels=1``, or a causal LM with ``value_head`` beside it (see
    :func:`dta_ref.tree_values`). Same checks as :func:`verl_log_probs`.
    """
    layout = _check_micro_batch(input_ids, attention_mask, position_ids, responses)
    first_column = input_ids.shape[1] - responses.shape[1]
    no_prompt = (layout.start >= first_column) & (layout.start + layout.length > first_column)
    if no_prompt.any():
        raise ValueError(
            f"row {int(no_prompt.nonzero()[0])} has no prompt token: no state precedes its first response token"
        )
    tree = build_tree(layout.sequences(input_ids))
    values = tree_values(model, tree, value_head=value_head, attention_impl=attention_impl)
    # entry [i, t] of the tree's [B, Lmax-1] block layout belongs to token t+1: the value of the state before it
    return layout.from_tree(values[:, :-1], first_column, responses.shape[1])
