"""dta_ref: the readable PyTorch reference for prefix-tree training.

Explicit T x T masks, any dtype (float64 included), runs on the CPU, needs no
Triton. It is the ground truth that every dta_fast op is tested against.
"""

from .adapter import ModelAdapter, adapt
from .attention import (
    attention,
    mask_from_subtree_end,
    tree_attention,
    tree_attention_mask,
    tree_mask,
)
from .batches import agentic_batch, grpo_batch
from .logprobs import (
    LogprobsAndEntropy,
    flat_logprobs,
    gather_tree_logprobs,
    next_token_targets,
    tree_logprobs,
    tree_logprobs_and_entropy,
)
from .losses import (
    PolicyGradientLoss,
    SFTLoss,
    TokenLoss,
    ValueLoss,
    clipped_policy_gradient_terms,
    policy_gradient_loss,
    sft_loss,
    token_weights,
    value_loss,
)
from .model import Decoder, DecoderConfig
from .multimodal import TreeImages, pack_images
from .padded import PaddedLayout
from .rollout import Rollout, RolloutCache, sample, speculative_sample
from .tree import PrefixTree
from .values import flat_values, tree_values

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "PrefixTree",
    "PaddedLayout",
    "pack_images",
    "TreeImages",
    "adapt",
    "ModelAdapter",
    "tree_mask",
    "tree_attention",
    "tree_attention_mask",
    "mask_from_subtree_end",
    "attention",
    "Decoder",
    "DecoderConfig",
    "flat_logprobs",
    "tree_logprobs",
    "tree_logprobs_and_entropy",
    "tree_values",
    "flat_values",
    "LogprobsAndEntropy",
    "gather_tree_logprobs",
    "next_token_targets",
    "policy_gradient_loss",
    "clipped_policy_gradient_terms",
    "sft_loss",
    "value_loss",
    "token_weights",
    "TokenLoss",
    "PolicyGradientLoss",
    "SFTLoss",
    "ValueLoss",
    "grpo_batch",
    "agentic_batch",
    "draw_tree",
    "draw_states",
    "sample",
    "speculative_sample",
    "RolloutCache",
    "Rollout",
]


def draw_tree(*args, **kwargs):
    """Draw a small tree and its attention mask to a PNG (needs matplotlib); see dta_ref.plot."""
    from .plot import draw_tree as _draw_tree

    return _draw_tree(*args, **kwargs)


def draw_states(*args, **kwargs):
    """Draw how a linear-attention layer runs on a small tree (segments, forked states) to a PNG; see
    dta_ref.plot."""
    from .plot import draw_states as _draw_states

    return _draw_states(*args, **kwargs)
