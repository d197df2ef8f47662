"""The attention block's projections (q, k, v, o, optional biases and q/k norms) around the
injected `kvtier.attention.Attention`; the same for every family."""

from __future__ import annotations

import torch
from torch import nn

from kvtier.attention.interface import Attention
from kvtier.config import ModelConfig
from kvtier.model.layers import RMSNorm, fuse_linears_


class SelfAttention(nn.Module):
    """Projections around attention; the attention itself is the injected `Attention`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.qkv_proj: nn.Linear | None = None  # q, k and v as one matmul, after `fuse()`

    def fuse(self) -> None:
        """Run q, k and v as one matmul (`qkv_proj`); the three become views of its rows (no
        extra memory). Call after any sharding: the head counts must be final. Mutates."""
        self.qkv_proj = fuse_linears_(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, layer: int, attention: Attention) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None:
            nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q_, k_, v_ = self.qkv_proj(x).split((nq, nkv, nkv), dim=-1)  # views of [T, nq + 2 nkv]
            # NOTE: contiguous, as unfused: the stores and kernels behind `attention` may assume it.
            q_, k_, v_ = q_.contiguous(), k_.contiguous(), v_.contiguous()
        else:
            q_, k_, v_ = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q_.view(t, self.num_heads, self.head_dim)  # [T, H_q, D]
        k = k_.view(t, self.num_kv_heads, self.head_dim)  # [T, H_kv, D]
        v = v_.view(t, self.num_kv_heads, self.head_dim)  # [T, H_kv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attention(layer, q, k, v)  # [T, H_q, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
