"""Depth-first chunked training (docs/chunked_execution.md): train a forest larger than memory with exact
gradients.

- ``plan.py``: the chunks of a forest, the order they run in and each one's cached prefix;
- ``memory.py``: what a plan keeps alive at its worst moment (``estimated_step_bytes``);
- ``budget.py``: the cheapest plan that fits a memory budget (``plan_for_budget``);
- ``options.py``: ``tree_backward``'s options and their checks;
- ``engine.py``: the execution, ``tree_backward``.
"""

from .budget import chunk_tokens_for_budget, plan_for_budget
from .engine import tree_backward
from .memory import MemoryModel, estimated_step_bytes
from .options import TreeBackwardOptions, checked_options
from .plan import ChunkPlan, Forest, plan_chunks

__all__ = [
    "ChunkPlan",
    "Forest",
    "MemoryModel",
    "TreeBackwardOptions",
    "checked_options",
    "chunk_tokens_for_budget",
    "estimated_step_bytes",
    "plan_chunks",
    "plan_for_budget",
    "tree_backward",
]
