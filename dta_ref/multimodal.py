"""Images in a packed forest: vision-language models (Qwen2.5-VL, Qwen3-VL) on the prefix tree.

A VLM's prompt holds an image as a run of placeholder tokens, one per merged patch, which the model's
forward fills with the vision tower's embeddings of that image. In a GRPO group the image sits in the
shared prompt: computed per rollout, the tower encodes it G times and every layer runs its tokens G
times. On the tree it is a prefix like any other:

- :func:`pack_images` builds the tree with each image's placeholders keyed by the image's content, so
  the same image after the same tokens is one run of packed tokens and different images never merge
  (their placeholders are the same token id);
- the distinct images are handed to the vision tower once, in the order their runs appear in the
  packed forest, which is the order the model's forward scatters embeddings into placeholders;
- the model's multimodal rotary positions (mrope, [3, T]) are the model's own ``get_rope_index`` of each
  rollout alone, gathered per packed token: a token's position depends on its prefix only, so every
  rollout through it gives it the same one (checked).

The packed forward then runs the model's own multimodal trunk with the image features computed once,
its attention routed to the tree (:mod:`dta_ref.hf`); autograd sums a shared image's gradient over the
rollouts that read it, through the vision tower.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .adapter import adapt
from .tree import PrefixTree


@dataclass
class TreeImages:
    """The distinct images of a packed forest, in packed order, as the model's forward takes them."""

    pixel_values: torch.Tensor  # the patches of every distinct image, concatenated in packed order
    image_grid_thw: torch.Tensor  # [I, 3] each image's (t, h, w) patch grid
    position_ids: torch.Tensor  # [3, T] the model's multimodal rotary position of every packed token
    # a chunk's share of images encoded once (dta_fast.chunked.images): the vision tower's outputs for its
    # placeholders, which the model's forward takes as ``mm_encoder_outputs`` in place of pixel_values
    encoded: dict | None = None

    def to(self, device) -> TreeImages:
        moved = (x.to(device) for x in (self.pixel_values, self.image_grid_thw, self.position_ids))
        return TreeImages(*moved, encoded=self.encoded)


def pack_images(model, sequences, pixel_values, image_grid_thw) -> tuple[PrefixTree, TreeImages]:
    """The prefix tree of ``sequences`` and their images in its packed order.

    ``pixel_values[i]`` holds rollout i's image patches (all its images, in order, as the model's
    processor makes them: [patches, channels x patch volume]) and ``image_grid_thw[i]`` their grids
    [images_i, 3]; a rollout without images has an empty grid. Rollout i's placeholder runs must match
    its grids (t h w / merge^2 placeholders each, merge the vision tower's spatial merge size).
    """
    model = adapt(model).core  # the Hugging Face model inside PEFT's, DDP's or torch.compile's wrapper
    config = _vl_config(model)
    placeholder, merge = config.image_token_id, config.vision_config.spatial_merge_size
    sequences = [list(map(int, s)) for s in sequences]
    if not (len(sequences) == len(pixel_values) == len(image_grid_thw)):
        raise ValueError(
            f"one pixel_values and one image_grid_thw per rollout: got {len(sequences)} rollouts, "
            f"{len(pixel_values)} pixel_values, {len(image_grid_thw)} image_grid_thw"
        )
    # each rollout's images, as (grid, patches) and the key of their content
    keys, images, keyed = {}, [], []
    for i, (seq, pixels, grids) in enumerate(zip(sequences, pixel_values, image_grid_thw, strict=True)):
        grids = torch.as_tensor(grids).reshape(-1, 3)
        sizes = (grids.prod(-1)).tolist()
        if sum(sizes) != len(pixels):
            raise ValueError(f"rollout {i}: its grids hold {sum(sizes)} patches, its pixel_values {len(pixels)}")
        runs = _placeholder_runs(seq, placeholder)
        expected = [n // merge**2 for n in sizes]
        if [b - a for a, b in runs] != expected:
            raise ValueError(
                f"rollout {i} has image placeholder runs of {[b - a for a, b in runs]} tokens, its grids need "
                f"{expected} (t h w / {merge}^2 each)"
            )
        seq, start = list(seq), 0
        for (a, b), grid, n in zip(runs, grids, sizes, strict=True):
            patches = pixels[start : start + n]
            start += n
            key = (tuple(grid.tolist()), patches.shape, _content(patches))
            if key not in keys:
                keys[key] = len(images)
                images.append((grid, patches))
            seq[a:b] = [-1 - keys[key]] * (b - a)  # the image's own key: same image, same tokens
        keyed.append(seq)
    offset = 1 + max((t for s in sequences for t in s), default=0)
    tree = PrefixTree.from_sequences([[t if t >= 0 else offset - 1 - t for t in s] for s in keyed])
    surrogate = tree.tokens >= offset
    image_of_token = torch.where(surrogate, tree.tokens - offset, -1)
    tree = dataclasses.replace(tree, tokens=torch.where(surrogate, placeholder, tree.tokens))
    # the images in the order their runs start in the packed forest
    starts = surrogate & torch.cat([torch.ones(1, dtype=torch.bool), image_of_token[1:] != image_of_token[:-1]])
    order = image_of_token[starts].tolist()
    if order:
        pixels = torch.cat([images[k][1] for k in order])
        grids = torch.stack([images[k][0] for k in order]).long()
    else:
        pixels, grids = torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long)
    return tree, TreeImages(pixels, grids, _packed_positions(model, tree, sequences, image_grid_thw))


def check_images(images, tree: PrefixTree, device) -> TreeImages | None:
    """``images`` checked against the tree and moved to ``device``; None stays None."""
    if images is None:
        return None
    if not isinstance(images, TreeImages):
        raise TypeError(f"images must be the TreeImages of dta_ref.pack_images, got {type(images).__name__}")
    if images.position_ids.shape != (3, tree.num_tokens):
        raise ValueError(
            f"images belong to a tree of {images.position_ids.shape[-1]} packed tokens, this tree has "
            f"{tree.num_tokens}: pack the images with the tree (dta_ref.pack_images)"
        )
    return images.to(device)


def _vl_config(model):
    config = getattr(model, "config", None)
    if getattr(config, "image_token_id", None) is None or getattr(config, "vision_config", None) is None:
        raise TypeError(f"{type(model).__name__} is not a vision-language model (no image_token_id, no vision_config)")
    return config


def _placeholder_runs(seq: list[int], placeholder: int) -> list[tuple[int, int]]:
    runs, t = [], 0
    while t < len(seq):
        if seq[t] == placeholder:
            a = t
            while t < len(seq) and seq[t] == placeholder:
                t += 1
            runs.append((a, t))
        else:
            t += 1
    return runs


def _content(patches: torch.Tensor) -> bytes:
    return patches.detach().cpu().contiguous().numpy().tobytes()


def _packed_positions(model, tree: PrefixTree, sequences, image_grid_thw) -> torch.Tensor:
    """[3, T]: the model's own rotary positions of each rollout alone, gathered per packed token."""
    config, trunk = _vl_config(model), model.model
    positions = torch.full((3, tree.num_tokens), -1, dtype=torch.long)
    for i, (seq, grids) in enumerate(zip(sequences, image_grid_thw, strict=True)):
        ids = torch.tensor([seq])
        types = (ids == config.image_token_id).int()
        grids = torch.as_tensor(grids).reshape(-1, 3).long()
        if len(grids):
            pos, _ = trunk.get_rope_index(ids, types, image_grid_thw=grids)
            pos = pos[:, 0].cpu()
        else:  # text alone: the model counts tokens on every axis
            pos = torch.arange(len(seq)).expand(3, -1)
        index = tree.seq_index[i, : len(seq)]
        seen = positions[:, index]
        if bool(((seen >= 0) & (seen != pos)).any()):
            raise ValueError(f"rollout {i} gives a shared token another rotary position than an earlier rollout")
        positions[:, index] = pos
    return positions
