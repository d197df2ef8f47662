"""How one layer scores its keys: the sliding window, logit soft-capping and the query scale.

Most layers are plain causal softmax(q.k / sqrt(D)) attention (`PLAIN`), which runs on the
fused SDPA kernels. A window (Mistral, Qwen2, Gemma-2's local layers) masks keys older than
`window` tokens per query; Gemma-2 soft-caps the scores (cap * tanh(s / cap)) and scales them by
query_pre_attn_scalar ** -0.5; DeepSeek-V2's latent attention (`latent`) stores one entry per
token as the K and V rows of a single KV head, whose first `latent` values are also the value.
The store hands the spec of the slice's layer to its kernel in `SliceStep.attn`;
`kvtier.attention.dense` implements every combination exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config import ModelConfig


@dataclass(frozen=True)
class LayerAttention:
    """One layer's scoring. window: the query at position p sees keys p - window + 1 .. p;
    softcap: scores -> softcap * tanh(scores / softcap); scale: the factor on q.k (None: D ** -0.5);
    latent: the key is the stored K and V rows side by side (the MLA entry) and the value its
    first `latent` values (None: K and V as stored)."""

    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    latent: int | None = None

    @property
    def plain(self) -> bool:
        """Plain causal attention (the fused kernels' case)."""
        return self.window is None and self.softcap is None and self.scale is None and self.latent is None

    @property
    def scored(self) -> bool:
        """Needs the scores themselves (soft-capping, a custom scale, a latent): no fused kernel."""
        return self.softcap is not None or self.scale is not None or self.latent is not None


PLAIN = LayerAttention()


def layer_attention(cfg: ModelConfig, context: int) -> tuple[LayerAttention, ...]:
    """Every layer's spec for a sequence of up to `context` tokens (a window that never binds
    at that length is left out: the layer is then plain causal)."""
    latent = None if cfg.mla is None else cfg.mla.kv_lora_rank
    return tuple(
        LayerAttention(cfg.window_of(i, context), cfg.attn_softcap, cfg.attn_scale, latent)
        for i in range(cfg.num_layers)
    )
