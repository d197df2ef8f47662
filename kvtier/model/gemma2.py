"""Gemma-2's decoder layer: attention and a GeGLU MLP, each between two (1 + w) RMSNorms.

```
 x ─┬─ input_layernorm ─ attention ─ post_attention_layernorm ─(+)─> x
    └───────────────────────────────────────────────────────────┘
 x ─┬─ pre_feedforward_layernorm ─ mlp ─ post_feedforward_layernorm ─(+)─> out
    └────────────────────────────────────────────────────────────────┘
```

What else is Gemma-2 lives elsewhere: the embedding scale and the final soft-cap in
`kvtier.model.llama.CausalLM`, attention soft-capping, the query scale and the alternating
sliding-window layers in the store's `LayerAttention` (`kvtier.attention.spec`). Module names
follow HF's `Gemma2DecoderLayer`, so its state dict loads as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtier.attention.interface import Attention
from kvtier.config import ModelConfig
from kvtier.model.layers import GatedMLP, OffsetRMSNorm
from kvtier.model.self_attention import SelfAttention


class Gemma2DecoderLayer(nn.Module):
    """One Gemma-2 layer; `index` is unused (every family's layer is built from (cfg, index))."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = SelfAttention(cfg)
        self.mlp = GatedMLP(h, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)

    def forward(
        self, x: torch.Tensor, layer: int, attention: Attention, mlp_chunk: int | None
    ) -> torch.Tensor:
        # x: [T, hidden], the residual stream
        h = self.self_attn(self.input_layernorm(x), layer, attention)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), mlp_chunk)
        return x + self.post_feedforward_layernorm(h)
