"""Tree attention in Triton: query at key position i attends key j iff ``j <= i < subtree_end[j]``.

- ``schedule.py``: ``build_schedule`` and ``TreeSchedule``, what every call over one tree shares;
- ``kernels.py``: the Triton kernels, schedule, forward, backward preprocess, dK/dV, dQ;
- ``hopper.py``: the forward, dK/dV and dQ kernels warp-specialised in Gluon for Hopper (bitwise twins);
- ``function.py``: their launchers, the autograd Function and ``tree_attention``;
- ``graphed.py``: small calls replayed from CUDA graphs, per schedule;
- ``interpreter.py``: ``TRITON_INTERPRET=1`` (the kernels on CPU, for tests).

``dta_ref.tree_attention`` is the readable twin, with the same signature.
"""

from ..dispatch import TRITON_MISSING, has_triton

if not has_triton():
    raise ImportError(TRITON_MISSING)

from .function import tree_attention  # noqa: E402
from .schedule import TreeSchedule, build_schedule, validate_subtree_end  # noqa: E402

__all__ = ["TreeSchedule", "build_schedule", "tree_attention", "validate_subtree_end"]
