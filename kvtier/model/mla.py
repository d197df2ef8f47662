"""Multi-head latent attention (DeepSeek-V2), with the up-projections absorbed.

The cache holds one entry per token and layer: the normalized latent c [L] and the decoupled
RoPE key k_pe [R], shared by every head. Instead of expanding c into per-head keys and values,
the key half of `kv_b_proj` is folded into the queries and its value half applied after
attention, so attention runs over the entries themselves (MQA with key = entry, value = c):

```
 score_h = q_nope_h . (W_UK_h c) + q_pe_h . k_pe = [q_nope_h W_UK_h ; q_pe_h] . [c ; k_pe]
 out_h   = sum_j p_hj (W_UV_h c_j)              = W_UV_h (sum_j p_hj c_j)
```

The entry goes to the store as its two halves (`k`, `v` of one "KV head" of (L + R) / 2 values,
`ModelConfig.head_dim`), so the store keeps exactly L + R values per token; `LatentRotary`
rotates q_pe and the k_pe tail in place, and `kvtier.attention.dense.attend` puts the halves back
side by side. Module names follow HF's `DeepseekV2Attention`.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtier.attention.interface import Attention
from kvtier.config import ModelConfig
from kvtier.model.layers import RMSNorm

LORA_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm ignore rms_norm_eps


class LatentAttention(nn.Module):
    """Projections of MLA around the injected `Attention` (which returns the latent per head)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        h, heads = cfg.hidden_size, cfg.num_heads
        self.mla, self.num_heads = mla, heads
        self.q_proj: nn.Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.entry, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * mla.v_head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, layer: int, attention: Attention) -> torch.Tensor:
        mla, heads, t = self.mla, self.num_heads, x.shape[0]
        nope, lat = mla.qk_nope_head_dim, mla.kv_lora_rank
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, heads, mla.qk_head_dim).split([nope, mla.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([lat, mla.qk_rope_head_dim], dim=-1)  # [T, L], [T, R]
        w = self.kv_b_proj.weight.view(heads, nope + mla.v_head_dim, lat)  # [H, nope + v, L]
        q_lat = torch.einsum("thn,hnl->thl", q_nope, w[:, :nope])  # [T, H, L]
        query = torch.cat((q_lat, q_pe), dim=-1)  # [T, H, L + R], RoPE part last
        entry = torch.cat((self.kv_a_layernorm(c), k_pe), dim=-1).view(t, 1, mla.entry)  # [T, 1, L + R]
        half = mla.entry // 2
        o_lat = attention(layer, query, entry[..., :half], entry[..., half:])  # [T, H, L]
        out = torch.einsum("thl,hvl->thv", o_lat, w[:, nope:])  # [T, H, v]
        return self.o_proj(out.reshape(t, heads * mla.v_head_dim))
