"""Tree attention's kernels on random trees, for compute-sanitizer (.ci/README.md, "Sanitizers").

    compute-sanitizer --tool memcheck  python3 .ci/sanitize.py
    compute-sanitizer --tool racecheck python3 .ci/sanitize.py

Runs the schedule kernels, the forward and the backward (every kernel of
dta_fast/attention/kernels.py) on random trees: bf16 and float32, GQA, a cached
prefix (Tq < Tk), a batch of different trees, head dims 64 and 128, sizes
that are and are not multiples of the blocks, and a NaN-poisoned row. Checks
each result against dta_ref's explicit-mask attention so that a run which
reads or writes out of bounds cannot also pass silently. One autotune
config per kernel (DTA_AUTOTUNE=0) keeps the runs short under the sanitizer.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DTA_AUTOTUNE", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dta_fast import tree_attention  # noqa: E402
from tests.attention_checks import check_tree_attention, random_depths, subtree_end_from_depths  # noqa: E402

CASES = [  # B, Hq, Hkv, Tq, Tk, D, dtype
    (1, 4, 2, 200, 200, 128, torch.bfloat16),
    (1, 14, 2, 130, 333, 64, torch.bfloat16),  # Qwen2-0.5B's heads, a cached prefix
    (2, 4, 4, 97, 97, 64, torch.float32),  # two different trees
    (3, 8, 2, 1, 150, 128, torch.bfloat16),  # one query per row (decoding)
]


def main():
    rng = np.random.default_rng(0)
    for B, Hq, Hkv, Tq, Tk, D, dtype in CASES:
        end = torch.stack([subtree_end_from_depths(random_depths(Tk, rng)) for _ in range(B)]).cuda()
        g = torch.Generator(device="cuda").manual_seed(B * Tk)
        q = torch.randn(B, Hq, Tq, D, device="cuda", dtype=dtype, generator=g)
        k, v = (torch.randn(B, Hkv, Tk, D, device="cuda", dtype=dtype, generator=g) for _ in range(2))
        check_tree_attention(q, k, v, end)  # output and q/k/v gradients against the reference
        v[0, 0, Tk // 2] = float("nan")  # isolation's paths: the flags, the epilogue, the LSE
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = tree_attention(*x, end)
        out.backward(torch.ones_like(out))
        before = max(0, Tk // 2 - (Tk - Tq))  # queries placed before the poisoned key cannot see it
        assert torch.isfinite(out[0, :, :before]).all() and torch.isfinite(out[1:]).all()
        assert torch.isfinite(x[0].grad[0, :, :before]).all()
        torch.cuda.synchronize()
        print(f"B={B} Hq={Hq} Hkv={Hkv} Tq={Tq} Tk={Tk} D={D} {dtype}: ok", flush=True)


if __name__ == "__main__":
    main()
