"""One lean decoder for the Llama family (Llama-2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM).

The model is pure: it holds weights and computes projections, norms and MLPs on a flat
[T, hidden] stream of tokens, and calls attention through `kvtier.attention.Attention`.
Module and parameter names follow Hugging Face's `LlamaForCausalLM`, so a HF state dict loads
as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtier.attention.interface import Attention
from kvtier.config import ModelConfig
from kvtier.model.layers import GatedMLP, RMSNorm


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

    def forward(self, x: torch.Tensor, layer: int, attention: Attention) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, H_q, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, H_kv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, H_kv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attention(layer, q, k, v)  # [T, H_q, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, layer: int, attention: Attention, mlp_chunk: int | None
    ) -> torch.Tensor:
        # x: [T, hidden], the residual stream
        h = self.self_attn(self.input_layernorm(x), layer, attention)
        x, h = self.post_attention_layernorm.add_norm(x, h)  # one fused pass on CUDA
        return x + self.mlp(h, mlp_chunk)


class DecoderStack(nn.Module):
    """Embeddings, layers and final norm (HF's `LlamaModel`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder plus its LM head. `forward` runs one step of T tokens."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention: Attention,
        logits_at: torch.Tensor | None = None,
        mlp_chunk: int | None = None,
    ) -> torch.Tensor:
        """Run tokens `input_ids` [T] through the model, attending via `attention`.

        Returns float32 logits [N, vocab] for the token indices `logits_at` (default: only the
        last token, so a long prefill never materializes [T, vocab]).
        """
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, i, attention, mlp_chunk)
        if logits_at is None:
            logits_at = torch.tensor([input_ids.shape[0] - 1], device=input_ids.device)
        h = self.model.norm(x[logits_at])  # [N, hidden]
        return self.lm_head(h).float()
