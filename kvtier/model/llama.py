"""One lean decoder for the Llama family (Llama-2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM),
Gemma-2 (its layer in `kvtier.model.gemma2`; here its embedding scale and final soft-cap) and
DeepSeek-V2 (the Llama block with latent attention, `kvtier.model.mla`, and a mixture-of-experts
FFN, `kvtier.model.moe`).

The model is pure: it holds weights and computes projections, norms and MLPs on a flat
[T, hidden] stream of tokens, and calls attention through `kvtier.attention.Attention`.
Module and parameter names follow Hugging Face's `LlamaForCausalLM` (`Gemma2ForCausalLM`), so
a HF state dict loads as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtier.attention.interface import Attention
from kvtier.config import ModelConfig
from kvtier.model.gemma2 import Gemma2DecoderLayer
from kvtier.model.layers import GatedMLP, OffsetRMSNorm, RMSNorm
from kvtier.model.mla import LatentAttention
from kvtier.model.moe import MoE
from kvtier.model.self_attention import SelfAttention


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP; DeepSeek-V2 swaps in latent attention and, from layer
    `moe.first_dense` on, the mixture of experts."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn: SelfAttention | LatentAttention = (
            SelfAttention(cfg) if cfg.mla is None else LatentAttention(cfg)
        )
        moe = cfg.moe is not None and index >= cfg.moe.first_dense
        self.mlp: GatedMLP | MoE = (
            MoE(cfg) if moe else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        )
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
    """Embeddings, layers and final norm (HF's `LlamaModel`, `Gemma2Model`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        gemma = cfg.family == "gemma2"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layer = Gemma2DecoderLayer if gemma else DecoderLayer
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = (OffsetRMSNorm if gemma else RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps)


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
        x = self.embed(input_ids)  # [T, hidden]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, i, attention, mlp_chunk)
        return self.logits(x, logits_at)

    # The pieces of `forward`, for a runner that takes the layers in another order (a prefill
    # run layer by layer: `kvtier.engine.layer_prefill`).

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream [T, hidden] of tokens input_ids [T] before the first layer."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.config.family == "gemma2":
            # NOTE: Gemma scales by sqrt(hidden) rounded to the weights' dtype first (as HF).
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    def logits(self, x: torch.Tensor, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [N, vocab] of the residual stream x [T, hidden] after the last layer,
        at the indices `logits_at` (None: the last token only)."""
        # NOTE: the last token by a slice: a tensor made from a host value would be a copy that
        # waits on CUDA for the step's queued layers before the head is issued
        h = self.model.norm(x[-1:] if logits_at is None else x[logits_at])  # [N, hidden]
        logits = self.lm_head(h).float()  # [N, vocab]
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
