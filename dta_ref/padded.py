"""Trainer batches in and out: padded [B, L] tensors and the tree's [N, Lmax-1] layout.

RL trainers hold rollouts as padded tensors: TRL a left-padded prompt block
and a right-padded completion block, verl ``input_ids`` / ``attention_mask``
with a ``responses`` block at the end. Row i's tokens are the columns where
its attention mask is 1, one contiguous run starting at column ``start[i]``.
The tree's layout puts, at [i, t], the logprob of row i's token t+1 (its
column ``start[i] + t + 1``). A per-token tensor of a block of columns
(``first_column`` onwards, TRL's completion block, verl's responses) moves
between the two with :meth:`PaddedLayout.to_tree` and :meth:`PaddedLayout.from_tree`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PaddedLayout:
    """Where each row's tokens lie in a padded batch of width ``width``."""

    start: torch.Tensor  # [B] long, first column holding a token
    length: torch.Tensor  # [B] long, number of tokens (>= 1)
    width: int

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> PaddedLayout:
        """The layout of ``attention_mask`` [B, L] (1 or True at tokens); each row's ones must be contiguous."""
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be 2-D [batch, length], got shape {tuple(attention_mask.shape)}")
        if attention_mask.shape[0] == 0:
            raise ValueError("empty batch: attention_mask has no rows")
        if attention_mask.dtype.is_complex or not ((attention_mask == 0) | (attention_mask == 1)).all():
            raise ValueError("attention_mask must hold only 0 and 1 (or False and True)")
        mask = attention_mask.bool()
        length = mask.sum(dim=1)
        empty = (length == 0).nonzero()
        if empty.numel():
            raise ValueError(f"row {int(empty[0])} of attention_mask has no token: every row needs at least one")
        start = mask.int().argmax(dim=1)
        columns = torch.arange(mask.shape[1], device=mask.device)
        inside = (columns >= start[:, None]) & (columns < (start + length)[:, None])
        gaps = (inside != mask).any(dim=1).nonzero()
        if gaps.numel():
            raise ValueError(
                f"row {int(gaps[0])} of attention_mask is not one contiguous run of ones: padding may only sit "
                "before and after a row's tokens"
            )
        return cls(start.long(), length.long(), mask.shape[1])

    @property
    def num_rows(self) -> int:
        return self.start.shape[0]

    @property
    def tree_width(self) -> int:
        """Lmax - 1: the width of the tree's per-sequence logprob layout."""
        return int(self.length.max()) - 1

    def sequences(self, input_ids: torch.Tensor) -> list[list[int]]:
        """Row i's tokens, as lists of ints."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a tensor, got {type(input_ids).__name__}")
        if tuple(input_ids.shape) != (self.num_rows, self.width):
            raise ValueError(
                f"input_ids has shape {tuple(input_ids.shape)}, the attention mask {(self.num_rows, self.width)}"
            )
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        rows = input_ids.cpu().tolist()
        return [row[s : s + n] for row, s, n in zip(rows, self.start.tolist(), self.length.tolist(), strict=True)]

    def _block(self, name: str, values: torch.Tensor, first_column: int) -> None:
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(values).__name__}")
        if isinstance(first_column, bool) or not isinstance(first_column, numbers.Integral):
            raise TypeError(f"first_column must be an int, got {type(first_column).__name__}")
        if values.dim() != 2 or values.shape[0] != self.num_rows:
            raise ValueError(f"{name} must be [{self.num_rows}, columns], got shape {tuple(values.shape)}")
        if not 0 <= first_column <= self.width - values.shape[1]:
            raise ValueError(
                f"a block of {values.shape[1]} columns from column {first_column} does not fit rows of {self.width}"
            )

    def to_tree(self, values: torch.Tensor, first_column: int, fill=0) -> torch.Tensor:
        """Per-token ``values`` [B, W] of columns ``first_column`` onwards, in the tree's layout [B, Lmax-1].

        Entry [i, t] is the value at row i's token t+1, ``fill`` where that
        token lies outside the block (or past the row's end).
        """
        self._block("values", values, first_column)
        if not isinstance(fill, numbers.Real):
            raise TypeError(f"fill must be a number, got {type(fill).__name__}")
        if not values.dtype.is_floating_point and not (math.isfinite(fill) and float(fill).is_integer()):
            raise ValueError(f"fill must be a whole number for values of dtype {values.dtype}, got {fill}")
        if values.dtype == torch.bool:
            low, high = 0, 1
        else:
            info = (torch.finfo if values.dtype.is_floating_point else torch.iinfo)(values.dtype)
            low, high = info.min, info.max
        if math.isfinite(fill) and not low <= fill <= high:  # it would wrap, or round to inf
            raise ValueError(f"fill {fill} does not fit values of dtype {values.dtype}")
        t = torch.arange(self.tree_width, device=values.device)
        column = self.start.to(values.device)[:, None] + t + 1 - first_column  # [B, Lmax-1] in the block
        valid = (t < self.length.to(values.device)[:, None] - 1) & (column >= 0) & (column < values.shape[1])
        if values.shape[1] == 0:
            return torch.full(valid.shape, fill, dtype=values.dtype, device=values.device)
        picked = values.gather(1, column.clamp(0, values.shape[1] - 1))
        return torch.where(valid, picked, torch.as_tensor(fill, dtype=values.dtype, device=values.device))

    def from_tree(self, values: torch.Tensor, first_column: int, columns: int) -> torch.Tensor:
        """Per-sequence ``values`` [B, Lmax-1] as a block [B, columns] from ``first_column``: 0 where none."""
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a tensor, got {type(values).__name__}")
        if isinstance(columns, bool) or not isinstance(columns, numbers.Integral) or columns < 0:
            raise ValueError(f"columns must be a non-negative int, got {columns!r}")
        self._block("block", values.new_empty(self.num_rows, columns), first_column)
        if values.shape != (self.num_rows, self.tree_width):
            raise ValueError(f"values must be [{self.num_rows}, {self.tree_width}], got shape {tuple(values.shape)}")
        t = first_column + torch.arange(columns, device=values.device) - self.start.to(values.device)[:, None] - 1
        valid = (t >= 0) & (t < self.length.to(values.device)[:, None] - 1)
        if self.tree_width == 0:
            return values.new_zeros(self.num_rows, columns)
        picked = values.gather(1, t.clamp(0, self.tree_width - 1))
        return torch.where(valid, picked, torch.zeros((), dtype=values.dtype, device=values.device))
