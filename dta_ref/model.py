"""A small Llama-style decoder for teaching and tests.

RMSNorm, rotary embeddings driven by ``position_ids`` (so a packed tree token
gets the position it has in every rollout), grouped-query attention and a
SwiGLU MLP. How tokens attend each other is not decided here: every layer
calls ``attend(layer_idx, q, k, v, scale)``, which the caller supplies
(causal for one sequence, the tree mask, the Triton tree kernel, or a cached
path in chunked execution).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass
class DecoderConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # default hidden_size // num_heads
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False

    def __post_init__(self):
        sizes = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")
        for name in sizes + (("head_dim",) if self.head_dim is not None else ()):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
            setattr(self, name, int(value))
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads}), "
                    "or give head_dim"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(x, position_ids, theta: float):
    """Rotate x [B, H, T, D] by the angles of position_ids [B, T]."""
    D = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float64) / D)
    angles = position_ids.to(torch.float64)[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, T, D]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return x * cos + rotate_half(x) * sin


def causal_attend(layer_idx, q, k, v, scale):
    """Plain causal attention over one sequence (keys = queries)."""
    T = q.shape[-2]
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return attention(q, k, v, mask, scale)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, position_ids, attend: Attend):
        B, T, _ = x.shape
        D = self.cfg.head_dim
        q = self.q_proj(x).view(B, T, -1, D).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_proj(x).view(B, T, -1, D).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, -1, D).transpose(1, 2)
        q = rotary(q, position_ids, self.cfg.rope_theta)
        k = rotary(k, position_ids, self.cfg.rope_theta)
        out = attend(self.layer_idx, q, k, v, 1.0 / math.sqrt(D))  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, position_ids, attend: Attend):
        x = x + self.attn(self.input_norm(x), position_ids, attend)
        return x + self.mlp(self.post_attn_norm(x))


class Decoder(nn.Module):
    """Llama-style causal LM. ``forward`` returns logits [B, T, vocab]."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.5 / math.sqrt(module.weight.shape[-1]))

    def hidden_states(self, input_ids, position_ids=None, attend: Attend = causal_attend):
        """Final normalised hidden states [B, T, hidden]."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, position_ids, attend)
        return self.norm(x)

    def forward(self, input_ids, position_ids=None, attend: Attend = causal_attend):
        return self.lm_head(self.hidden_states(input_ids, position_ids, attend))
