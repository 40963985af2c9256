"""Images (and videos) in depth-first chunks: the vision tower runs once per step, each chunk reads its share.

A vision-language model's forward fills each image placeholder with a row of the vision tower's output
(and, in Qwen3-VL, adds rows of its deepstack features to early layers). In packed order the
placeholders and those rows correspond one to one, so a chunk's placeholders read a contiguous range of
rows. The tower runs once, before the first chunk, and its outputs are handed to the chunks as leaves:
each chunk's forward takes its rows through the model's own ``mm_encoder_outputs`` (transformers 5.18
and later), its backward leaves their gradient on the leaves, and after the last chunk the tower's
backward runs once on the sum.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect

import numpy as np
import torch

from dta_ref.multimodal import TreeImages
from dta_ref.tree import PrefixTree


class ChunkImages:
    """The images (and videos) of a chunked step, encoded once; :meth:`chunk` gives a chunk's share,
    :meth:`backward` runs the vision tower's backward after the last chunk."""

    def __init__(self, model, images: TreeImages, tree: PrefixTree):
        trunk = getattr(model, "model", None)
        if not callable(getattr(trunk, "get_image_features", None)):
            raise TypeError(f"{type(model).__name__} takes no images: it has no multimodal trunk with a vision tower")
        if "mm_encoder_outputs" not in inspect.signature(trunk.forward).parameters:
            raise ValueError(
                f"{type(model).__name__}'s forward takes no encoded images (mm_encoder_outputs, transformers "
                ">= 5.18), which images in several chunks need: upgrade transformers, or score the images "
                "in one forward (tree_logprobs(images=...) or one chunk)"
            )
        self.images, tokens = images, tree.tokens.cpu().numpy()
        self.kinds = {}  # kind -> (the tower's output record, its tensors, their leaves, placeholders before)
        for kind, (pixels, grids) in images.media().items():
            output = getattr(trunk, f"get_{kind}_features")(pixels, grids, return_dict=True)
            # the tower's outputs, each one [placeholders, width] in packed order, and their leaves
            tensors = [torch.cat(output.pooler_output)]
            tensors += [torch.cat(f) for f in getattr(output, "deepstack_features", None) or ()]
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
            before = np.concatenate([[0], np.cumsum(tokens == getattr(model.config, f"{kind}_token_id"))])
            if tensors[0].shape[0] != before[-1]:
                raise ValueError(
                    f"the vision tower gave {tensors[0].shape[0]} rows for {before[-1]} {kind} placeholders: "
                    "pack the images with the tree (dta_ref.pack_images)"
                )
            self.kinds[kind] = (output, tensors, leaves, before)

    def chunk(self, a: int, b: int) -> TreeImages:
        """Packed tokens [a, b)'s rotary positions and the rows of their placeholders."""
        empty = self.images.image_grid_thw[:0]
        share = TreeImages(self.images.pixel_values[:0], empty, self.images.position_ids[:, a:b])
        encoded = {}
        for kind, (output, _, leaves, before) in self.kinds.items():
            lo, hi = int(before[a]), int(before[b])
            if lo == hi:
                continue
            rows = [leaf[lo:hi] for leaf in leaves]
            record = copy.copy(output)  # the model's own output record, its rows this chunk's
            record.pooler_output = (rows[0],)
            if len(rows) > 1:
                record.deepstack_features = [(r,) for r in rows[1:]]
            encoded[kind] = record
        return dataclasses.replace(share, encoded=encoded) if encoded else share

    def backward(self) -> None:
        """The vision tower's backward, with what every chunk left on its outputs."""
        pairs = [
            (t, leaf.grad)
            for _, tensors, leaves, _ in self.kinds.values()
            for t, leaf in zip(tensors, leaves, strict=True)
            if leaf.grad is not None
        ]
        if pairs:
            torch.autograd.backward(*zip(*pairs))
