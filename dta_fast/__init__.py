"""dta_fast: the Triton fast path for prefix-tree training.

Every function here that has a dta_ref twin has the same name and signature
and is tested against it, outputs and gradients. Importing it needs no
Triton: the kernels load when first used (dta_fast.dispatch says which runs).
"""

from dta_ref import __version__
from dta_ref.losses import PolicyGradientLoss, SFTLoss, TokenLoss

from .chunked import chunk_tokens_for_budget, estimated_step_bytes, tree_backward
from .distributed import distributed_tree_backward
from .logprobs import gather_logprobs_chunked, tree_logprobs, tree_logprobs_and_entropy
from .partition import CostModel, Partition, partition
from .rollout import sample, speculative_sample
from .tree import build_tree
from .values import tree_values

__all__ = [
    "__version__",
    "build_tree",
    "tree_attention",
    "build_schedule",
    "TreeSchedule",
    "validate_subtree_end",
    "tree_logprobs",
    "tree_logprobs_and_entropy",
    "tree_values",
    "gather_logprobs_chunked",
    "tree_backward",
    "chunk_tokens_for_budget",
    "estimated_step_bytes",
    "TokenLoss",
    "PolicyGradientLoss",
    "SFTLoss",
    "partition",
    "Partition",
    "CostModel",
    "distributed_tree_backward",
    "sample",
    "speculative_sample",
]


_KERNEL_NAMES = ("TreeSchedule", "build_schedule", "tree_attention", "validate_subtree_end")


def __getattr__(name):
    if name in _KERNEL_NAMES:  # the Triton kernels, imported on first use
        from . import attention

        return getattr(attention, name)
    raise AttributeError(f"module 'dta_fast' has no attribute {name!r}")
