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
    # the distinct videos, likewise (None: none), and their seconds per temporal patch (Qwen2.5-VL)
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None

    def to(self, device) -> TreeImages:
        moved = (x.to(device) for x in (self.pixel_values, self.image_grid_thw, self.position_ids))
        videos = (None if x is None else x.to(device) for x in (self.pixel_values_videos, self.video_grid_thw))
        return TreeImages(*moved, self.encoded, *videos)

    def media(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The kinds of media the forest holds: ``{"image": (patches, grids), "video": ...}``."""
        out = dict(image=(self.pixel_values, self.image_grid_thw))
        out["video"] = (self.pixel_values_videos, self.video_grid_thw)
        return {kind: m for kind, m in out.items() if m[1] is not None and len(m[1])}


def pack_images(model, sequences, pixel_values, image_grid_thw, *, videos=None) -> tuple[PrefixTree, TreeImages]:
    """The prefix tree of ``sequences`` and their images (and videos) in its packed order.

    ``pixel_values[i]`` holds rollout i's image patches (all its images, in order, as the model's
    processor makes them: [patches, channels x patch volume]) and ``image_grid_thw[i]`` their grids
    [images_i, 3]; a rollout without images has an empty grid. Rollout i's placeholder runs must match
    its grids (t h w / merge^2 placeholders each, merge the vision tower's spatial merge size; a video's
    may be split into several runs, one per frame, as Qwen3-VL's timestamps split them). ``videos``:
    ``(pixel_values_videos, video_grid_thw)`` per rollout likewise, or
    ``(pixel_values_videos, video_grid_thw, second_per_grid_ts)`` for Qwen2.5-VL's temporal positions.
    """
    model = adapt(model).core  # the Hugging Face model inside PEFT's, DDP's or torch.compile's wrapper
    config = _vl_config(model)
    sequences = [list(map(int, s)) for s in sequences]
    media = {"image": (pixel_values, image_grid_thw, None)}
    if videos is not None:
        if not isinstance(videos, (tuple, list)) or len(videos) not in (2, 3):
            raise ValueError("videos must be (pixel_values_videos, video_grid_thw[, second_per_grid_ts]) per rollout")
        media["video"] = (videos[0], videos[1], videos[2] if len(videos) == 3 else None)
    for kind, (pixels, grids, seconds) in media.items():
        if (
            len(pixels) != len(sequences)
            or len(grids) != len(sequences)
            or (seconds is not None and len(seconds) != len(sequences))
        ):
            raise ValueError(
                f"one {kind} pixel_values and one {kind}_grid_thw per rollout: got {len(sequences)} rollouts, "
                f"{len(pixels)} pixel_values, {len(grids)} {kind}_grid_thw"
            )
    # each rollout's media items, as (kind, grid, patches, seconds, runs) and the key of their content
    keys, items, keyed = {}, [], []
    for i, seq in enumerate(sequences):
        seq = list(seq)
        for kind, (pixels, grids, seconds) in media.items():
            placeholder = getattr(config, f"{kind}_token_id")
            for a, b, key_item in _items_of(i, seq, kind, placeholder, config, pixels[i], grids[i], seconds):
                if key_item[0] not in keys:
                    keys[key_item[0]] = len(items)
                    items.append(key_item[1])
                seq[a:b] = [-1 - keys[key_item[0]]] * (b - a)  # the item's own key: same media, same tokens
        keyed.append(seq)
    offset = 1 + max((t for s in sequences for t in s), default=0)
    tree = PrefixTree.from_sequences([[t if t >= 0 else offset - 1 - t for t in s] for s in keyed])
    surrogate = tree.tokens >= offset
    item_of_token = torch.where(surrogate, tree.tokens - offset, -1)
    placeholders = torch.tensor([getattr(config, f"{items[k][0]}_token_id") for k in range(len(items))] or [0])
    tree = dataclasses.replace(
        tree, tokens=torch.where(surrogate, placeholders[item_of_token.clamp(min=0)], tree.tokens)
    )
    # the items in the order their runs appear in the packed forest, per kind: an item at two places of
    # the forest (the same image after different tokens) twice, a video split into runs once per its runs
    starts = surrogate & torch.cat([torch.ones(1, dtype=torch.bool), item_of_token[1:] != item_of_token[:-1]])
    seen, order = {}, []
    for k in item_of_token[starts].tolist():
        seen[k] = seen.get(k, 0) + 1
        if (seen[k] - 1) % items[k][4] == 0:
            order.append(k)
    packed = {}
    for kind in media:
        mine = [items[k] for k in order if items[k][0] == kind]
        if mine:
            packed[kind] = (torch.cat([m[2] for m in mine]), torch.stack([m[1] for m in mine]).long())
        else:
            packed[kind] = (torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long))
    positions = _packed_positions(model, tree, sequences, media)
    video = packed.get("video", (None, None))
    return tree, TreeImages(*packed["image"], positions, None, *video)


def _items_of(i, seq, kind, placeholder, config, pixels, grids, seconds):
    """Rollout i's media of one kind: (start, end, (key, (kind, grid, patches, seconds, runs))) per
    placeholder run; an item's runs (one, or a video's frames) together hold its t h w / merge^2
    placeholders."""
    merge = config.vision_config.spatial_merge_size
    grids = torch.as_tensor(grids).reshape(-1, 3)
    sizes = grids.prod(-1).tolist()
    if sum(sizes) != len(pixels):
        raise ValueError(f"rollout {i}: its {kind} grids hold {sum(sizes)} patches, its pixel_values {len(pixels)}")
    runs = _placeholder_runs(seq, placeholder)
    expected = [n // merge**2 for n in sizes]
    out, r, start = [], 0, 0
    for g, (grid, n, need) in enumerate(zip(grids, sizes, expected, strict=True)):
        patches = pixels[start : start + n]
        start += n
        second = None if seconds is None else float(torch.as_tensor(seconds[i]).reshape(-1)[g])
        key = (kind, tuple(grid.tolist()), patches.shape, _content(patches), second)
        mine = []
        while need > 0 and r < len(runs):
            mine.append(runs[r])
            need -= runs[r][1] - runs[r][0]
            r += 1
        out += [(a, b, (key, (kind, grid, patches, second, len(mine)))) for a, b in mine]
        if need != 0:
            break
    if r != len(runs) or sum(b - a for a, b, _ in out) != sum(expected):
        raise ValueError(
            f"rollout {i} has {kind} placeholder runs of {[b - a for a, b in runs]} tokens, its grids need "
            f"{expected} (t h w / {merge}^2 each, a video's possibly split into runs)"
        )
    return out


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


def _packed_positions(model, tree: PrefixTree, sequences, media) -> torch.Tensor:
    """[3, T]: the model's own rotary positions of each rollout alone, gathered per packed token."""
    config, trunk = _vl_config(model), model.model
    positions = torch.full((3, tree.num_tokens), -1, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids = torch.tensor([seq])
        types = (ids == config.image_token_id).int()
        kwargs = {"image_grid_thw": torch.as_tensor(media["image"][1][i]).reshape(-1, 3).long()}
        if "video" in media:
            types = types + 2 * (ids == config.video_token_id).int()
            kwargs["video_grid_thw"] = torch.as_tensor(media["video"][1][i]).reshape(-1, 3).long()
            if media["video"][2] is not None:
                kwargs["second_per_grid_ts"] = torch.as_tensor(media["video"][2][i]).reshape(-1)
        kwargs = {k: v for k, v in kwargs.items() if len(v)}
        if "image_grid_thw" in kwargs or "video_grid_thw" in kwargs:
            pos, _ = trunk.get_rope_index(ids, types, **kwargs)
            pos = pos[:, 0].cpu()
        else:  # text alone: the model counts tokens on every axis
            pos = torch.arange(len(seq)).expand(3, -1)
        index = tree.seq_index[i, : len(seq)]
        seen = positions[:, index]
        if bool(((seen >= 0) & (seen != pos)).any()):
            raise ValueError(f"rollout {i} gives a shared token another rotary position than an earlier rollout")
        positions[:, index] = pos
    return positions
