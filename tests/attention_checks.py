"""Shared checks for the tree attention kernel against the explicit-mask reference.

Tolerance comes from the data (docs/../CONTRIBUTING.md, "Tolerance policy"):
the reference runs in float64 on the same low-precision inputs (ground
truth), and again as plain torch ops in the kernel's precision. The kernel
must satisfy err(kernel) <= 2 * err(same-precision torch) + floor.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import dta_ref
from dta_ref import mask_from_subtree_end

FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def subtree_end_from_depths(depths) -> torch.Tensor:
    """subtree_end of the preorder forest whose token depths are ``depths``."""
    T = len(depths)
    end = [T] * T
    stack: list[int] = []
    for k, d in enumerate(depths):
        while stack and depths[stack[-1]] >= d:
            end[stack.pop()] = k
        stack.append(k)
    return torch.tensor(end, dtype=torch.long)


def random_depths(T: int, rng: np.random.Generator, p_up: float = 0.3) -> list[int]:
    """Depths of a random preorder forest: each token goes one deeper or climbs back up."""
    depths = [0]
    for _ in range(T - 1):
        d = depths[-1] + 1 if rng.random() > p_up else int(rng.integers(0, depths[-1] + 1))
        depths.append(d)
    return depths


def attention_in_dtype(q, k, v, mask, scale, sinks=None, softcap=None):
    """Plain torch attention in the inputs' own precision (softmax in float32, its probabilities rounded
    to the inputs' dtype before they meet V, as a fused kernel's are)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = (torch.matmul(q, k.transpose(-1, -2)) * scale).float()
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(*s.shape[:3], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    else:
        p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.matmul(p, v)


def _grads(fn, inputs, do):
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*inputs)
    grads = torch.autograd.grad(out, inputs, do.to(out.dtype))
    return [out.detach(), *grads]


def report(name, actual, expected) -> str:
    diff = (actual.double() - expected.double()).abs()
    rel_rms = (diff.pow(2).mean().sqrt() / expected.double().pow(2).mean().sqrt().clamp(min=1e-30)).item()
    worst = np.unravel_index(int(diff.argmax()), tuple(diff.shape)) if diff.numel() else ()
    return (
        f"{name}: max abs diff {diff.max().item():.3e}, relative RMS {rel_rms:.3e}, worst at {tuple(map(int, worst))}"
    )


def check_tree_attention(q, k, v, subtree_end, *, scale=None, seed=0, position_ids=None, window=None, sinks=None,
                         softcap=None):  # fmt: skip
    """Compare output, dq, dk, dv (and dsinks), and the LSE of dta_fast.tree_attention with its twin
    dta_ref.tree_attention (one shared upstream grad), for any variant: a sliding window over
    ``position_ids``, ``sinks``, a ``softcap``, a value head dim of its own."""
    from dta_fast import tree_attention

    Tq, Tk, D = q.shape[2], k.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    end = subtree_end.to(q.device)
    pos = None if position_ids is None else position_ids.to(q.device)
    mask = mask_from_subtree_end(end, torch.arange(Tk - Tq, Tk, device=q.device), pos, window)
    if mask.dim() == 3:  # one tree per batch row: [B, 1, Tq, Tk]
        mask = mask[:, None]
    g = torch.Generator(device=q.device).manual_seed(seed)
    do = torch.randn(*q.shape[:3], v.shape[3], generator=g, device=q.device, dtype=q.dtype)
    variant = dict(position_ids=pos, window=window, softcap=softcap)

    def twin(attend, dtype=None):
        def run(a, b, c, *s):
            return attend(a, b, c, end, scale, sinks=s[0] if s else None, **variant)

        return run

    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    fast = _grads(twin(tree_attention), inputs, do)
    exact = _grads(twin(dta_ref.tree_attention), [x.double() for x in inputs], do.double())
    lse_fast = tree_attention(q, k, v, end, scale, sinks=sinks, return_lse=True, **variant)[1]
    lse_exact = dta_ref.tree_attention(*[x.double() for x in (q, k, v)], end, scale, return_lse=True,
                                       sinks=None if sinks is None else sinks.double(), **variant)[1]  # fmt: skip
    assert lse_fast.dtype == lse_exact.dtype == torch.float32
    torch.testing.assert_close(lse_fast, lse_exact, rtol=1e-5, atol=FLOOR[q.dtype], msg=lambda m: "LSE: " + m)
    if q.dtype == torch.float32:
        same = _grads(twin(dta_ref.tree_attention), inputs, do)
    else:
        in_dtype = lambda a, b, c, *s: attention_in_dtype(a, b, c, mask, scale, *s, softcap=softcap)  # noqa: E731
        same = _grads(in_dtype, inputs, do)
    failures = []
    for name, f, e, s in zip(("out", "dq", "dk", "dv", "dsinks"), fast, exact, same):
        assert f.shape == e.shape, f"{name}: shape {tuple(f.shape)} != {tuple(e.shape)}"
        assert torch.isfinite(f).all(), f"{name} has non-finite values: {report(name, f, e)}"
        err_fast = (f.double() - e).abs().max().item()
        err_same = (s.double() - e).abs().max().item()
        bound = 2 * err_same + FLOOR[q.dtype] * max(1.0, e.abs().max().item())
        if err_fast > bound:
            failures.append(f"{report(name, f, e)} > bound {bound:.3e} (same-precision torch error {err_same:.3e})")
    assert not failures, "\n".join(failures)
    return fast
