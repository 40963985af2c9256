"""Plain decode steps at fixed shapes, replayed from CUDA graphs on CUDA.

A decode step with no draft (plain sampling after the prompts' step, a speculative step with nothing to
draft) is the same computation every step but for three inputs: the rows' tokens, their cached lengths
and the step's uniforms. A row's cache holds its tokens at their positions, ``[0, length)``, so the new token's slot and
position are both its row's length. With those inputs in device buffers, the new K/V written in place
(a scatter at each row's length) and the keys read over a fixed range (the lengths rounded up to
``KEY_BUCKET``), no shape and no Python branch of the step changes from one step to the next: on CUDA the
step is captured once per (rows, keys) as a CUDA graph and replayed, costing the host one launch where
the eager step costs it every operator of the model (the sampler is host-bound at RL sizes:
docs/rollout.md). Elsewhere, or where a capture fails (a model whose step syncs with the host), the same
step runs eagerly. Its attention is SDPA with the tree's mask of a single path (every key at or before a
row's length, within a sliding window), exact since every key past a row's length is zero (the engine
zeroes what a step writes past a row's new length); with sinks or softcaps, which SDPA does not
compute, the same softmax written out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dta_ref.attention import tree_mask
from dta_ref.rollout.sampling import draw, sampling_probs

from .cuda_graphs import capture

KEY_BUCKET = 256  # a replayed step attends over its rows' lengths rounded up to this: a graph per 256 keys
CUDA_GRAPHS = True  # capture the steps on CUDA (off: every step eager, the same numbers)


def _hooked(model) -> bool:
    """Whether a forward of ``model`` runs code of others around its modules (forward hooks: sharded or
    offloaded weights gathered per forward, ZeRO-3 or accelerate's), which a graph's replay would skip."""
    from torch.nn.modules import module

    if module._global_forward_hooks or module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in model.modules())


class _Step:
    """One decode step's fixed-shape inputs, outputs and (once captured) CUDA graph."""

    def __init__(self, rows: int, keys: int, greedy: bool, device):
        self.keys = keys
        self.inputs = torch.zeros(2, rows, dtype=torch.long, device=device)  # the rows' tokens, lengths
        self.uniforms = None if greedy else torch.zeros(rows, dtype=torch.float64, device=device)
        self.outputs = torch.zeros(2, rows, dtype=torch.float64, device=device)  # tokens drawn, their logprobs
        self.graph = None
        self.eager_runs = 0


class DecodeSteps:
    """The fixed-shape decode steps of one KV engine (``dta_fast.rollout.KVEngine``): its adapter, head and
    per-layer buffers ``keys`` / ``values`` [B, Hkv, L, D], read at each step. :meth:`reset` whenever the
    engine replaces its buffers (grown, rows dropped): a graph writes to the buffers it was captured with."""

    def __init__(self, engine, params):
        self.engine, self.params = engine, params
        self.capture = CUDA_GRAPHS and engine.device.type == "cuda" and not _hooked(engine.adapter.model)
        self.steps: dict[tuple[int, int], _Step] = {}
        self.pool = None  # one memory pool for every graph of the run
        self.replays = 0

    def reset(self) -> None:
        self.steps.clear()
        self.pool = None  # its graphs are gone: the next capture starts a pool of its own

    def __call__(self, tokens: list[int], lengths: list[int], uniforms, live: list[int]) -> torch.Tensor:
        """float64 [2, rows] on the host: each buffer row's drawn token and its log-probability, its K/V
        written at its length. ``uniforms``: one per ``live`` row (the unfinished ones), in order; a
        finished row draws from 0."""
        engine = self.engine
        # on CUDA one key range per 256 keys, captured or not (the same shapes, so the same numbers, either
        # way); elsewhere about the keys the rows hold
        bucket = KEY_BUCKET if engine.device.type == "cuda" else 16
        keys = min(-(-(max(lengths) + 1) // bucket) * bucket, engine.capacity)
        step = self.steps.get((len(tokens), keys))
        if step is None:
            step = self.steps[len(tokens), keys] = _Step(len(tokens), keys, uniforms is None, engine.device)
        step.inputs.copy_(torch.tensor([tokens, lengths]))  # one copy to the device
        if uniforms is not None and len(live) == len(tokens):
            step.uniforms.copy_(uniforms)
        elif uniforms is not None:
            step.uniforms.zero_().index_copy_(0, torch.tensor(live, device=uniforms.device), uniforms)
        if step.graph is not None:
            step.graph.replay()
            self.replays += 1
        elif self.capture and step.eager_runs:  # warmed up on the default stream: capture the next call
            self._capture(step)
        else:
            self._body(step)
            step.eager_runs += 1
        return step.outputs.cpu()

    def _capture(self, step: _Step) -> None:
        try:
            step.graph = capture(lambda: self._body(step), self.pool, self.engine.device).graph
        except Exception:  # the model's step syncs with the host somewhere: eager from now on, same numbers
            self.capture = False
            return
        self.pool = step.graph.pool()

    def _body(self, step: _Step) -> None:
        engine, keys = self.engine, step.keys
        tokens, lengths = step.inputs
        device = tokens.device
        key_index = torch.arange(keys, device=device)
        path_end = torch.full((keys,), keys, device=device)  # a row's cache is one path: seen by every later token
        biases, slots = {}, {}  # built once a step: per window and dtype, per K/V shape

        def bias(window, dtype):  # tree_mask's rule, each row's query at its length: 0 where seen, else -inf
            if (window, dtype) not in biases:
                seen = tree_mask(lengths[:, None], key_index, path_end, key_index, window)  # [rows, keys]
                zeros = torch.zeros(seen.shape, dtype=dtype, device=device)
                biases[window, dtype] = zeros.masked_fill(~seen, -torch.inf)[:, None, None]
            return biases[window, dtype]

        def attend(layer, q, k, v, scale, window=None, sinks=None, softcap=None):
            K, V = engine.keys[layer], engine.values[layer]
            for x in (k, v):
                if x.shape not in slots:
                    slots[x.shape] = lengths.view(-1, 1, 1, 1).expand(x.shape)
            K.scatter_(2, slots[k.shape], k)
            V.scatter_(2, slots[v.shape], v)
            B, Hq, _, D = q.shape
            Hkv = k.shape[1]
            folded = q.reshape(B, Hkv, Hq // Hkv, D)  # a GQA group's heads as its query rows
            K, V = K[:, :, :keys], V[:, :, :keys]
            if sinks is None and softcap is None:
                out = F.scaled_dot_product_attention(folded, K, V, attn_mask=bias(window, q.dtype), scale=scale)
            else:  # SDPA computes neither: the softmax written out, in float32 for low precision as the kernels
                compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
                scores = torch.matmul(folded.to(compute), K.to(compute).transpose(-1, -2)) * scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                scores = scores + bias(window, compute)
                lse = torch.logsumexp(scores, -1, keepdim=True)
                if sinks is not None:  # one more logit per query head in every row's denominator
                    lse = torch.logaddexp(lse, sinks.to(compute).view(1, Hkv, -1, 1))
                out = torch.matmul(torch.exp(scores - lse), V.to(compute)).to(q.dtype)
            return out.reshape(B, Hq, 1, V.shape[-1])

        hidden = engine.adapter.hidden_states(tokens[:, None], lengths[:, None], attend)
        drawn, logp = draw(sampling_probs(engine.head(hidden[:, 0]), self.params), step.uniforms)
        step.outputs[0].copy_(drawn)
        step.outputs[1].copy_(logp)
