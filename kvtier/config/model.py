"""`ModelConfig`: the shapes and switches of one decoder, validated at construction."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config.hf import hf_fields
from kvtier.config.parts import ACTIVATIONS, MLAConfig, MoEConfig, RopeConfig
from kvtier.errors import ModelLoadError


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a decoder (Llama family, Gemma-2, DeepSeek-V2). Validated at
    construction; `from_hf_dict` reads a `config.json` (`kvtier.config.hf`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # tokens a query of a `sliding_layers` layer sees
    sliding_layers: tuple[int, ...] = ()  # layers with sliding-window attention, ascending
    attn_softcap: float | None = None  # Gemma-2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma-2: logits -> cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None  # Gemma-2: scores scaled by its ** -0.5
    hidden_act: str = "silu"  # the gated MLP's activation: SwiGLU or GeGLU
    mla: MLAConfig | None = None  # DeepSeek-V2's latent attention (then num_kv_heads == 1)
    moe: MoEConfig | None = None  # DeepSeek's mixture-of-experts FFN

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(
                f"model config: hidden_act {self.hidden_act!r} is not supported; "
                f"use one of {', '.join(ACTIVATIONS)}"
            )
        if self.sliding_layers:
            if self.sliding_window is None or self.sliding_window < 1:
                raise ModelLoadError(
                    "model config: sliding-window layers need a positive sliding_window, "
                    f"got {self.sliding_window}"
                )
            if list(self.sliding_layers) != sorted(set(self.sliding_layers)) or not (
                self.sliding_layers[0] >= 0 and self.sliding_layers[-1] < self.num_layers
            ):
                raise ModelLoadError(
                    f"model config: sliding_layers {self.sliding_layers} must be distinct ascending layer "
                    f"indices below num_layers ({self.num_layers})"
                )
        if self.mla is not None and (self.num_kv_heads != 1 or 2 * self.head_dim != self.mla.entry):
            raise ModelLoadError(
                f"model config: an MLA model stores one entry of {self.mla.entry} values per token: "
                f"num_kv_heads must be 1 and head_dim {self.mla.entry // 2}"
            )
        for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ModelLoadError(f"model config: {name} must be positive, got {value}")

    @property
    def family(self) -> str:
        """The decoder block: "gemma2" (sandwich norms, GeGLU, scaled embeddings), "deepseek_v2"
        (latent attention, MoE) or "llama"."""
        return self.model_type if self.model_type in ("gemma2", "deepseek_v2") else "llama"

    @property
    def attn_scale(self) -> float | None:
        """The factor on q.k when it is not head_dim ** -0.5 (None: the default)."""
        if self.mla is not None:  # scores over the per-head q.k of nope + rope dims
            return self.mla.qk_head_dim**-0.5 * self.rope.softmax_mscale()
        if self.query_pre_attn_scalar is None or self.query_pre_attn_scalar == self.head_dim:
            return None
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def score_dim(self) -> int:
        """Width of one query head as attention scores it (MLA: the absorbed query, the entry)."""
        return self.head_dim if self.mla is None else self.mla.entry

    @property
    def value_dim(self) -> int:
        """Width of one head of attention output (MLA: the latent, before the value projection)."""
        return self.head_dim if self.mla is None else self.mla.kv_lora_rank

    @property
    def plain_scores(self) -> bool:
        """Scores are q.k / sqrt(head_dim) over stored K/V, not soft-capped, not latent (what
        every fused kernel computes)."""
        return self.attn_softcap is None and self.attn_scale is None and self.mla is None

    def window_of(self, layer: int, context: int) -> int | None:
        """The sliding window of `layer` where it binds at `context` tokens, else None: a window
        of at least `context` tokens never hides a key, so such a layer is plain causal."""
        w = self.sliding_window
        if w is None or layer not in self.sliding_layers or context <= w:
            return None
        return w

    def windowed_layers(self, context: int) -> tuple[int, ...]:
        """Layers whose window binds at `context` tokens (they keep only that window of KV)."""
        return tuple(i for i in self.sliding_layers if self.window_of(i, context) is not None)

    def full_layers(self, context: int) -> int:
        """Layers that keep every token's KV at `context` tokens."""
        return self.num_layers - len(self.windowed_layers(context))

    def kv_bytes(self, context: int, dtype_bytes: int) -> int:
        """K and V of a `context`-token sequence: every token in full layers, the window in
        windowed ones (what a cache must hold at the end, not counting per-step slack)."""
        per_layer = 2 * self.num_kv_heads * self.head_dim * dtype_bytes
        windowed = len(self.windowed_layers(context))
        return per_layer * (self.full_layers(context) * context + windowed * (self.sliding_window or 0))

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (1 = MHA, num_heads = MQA)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers and KV heads (the cache without windows)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count, from the shapes (embeddings counted once when tied). `active`: only
        the experts one token runs through (routed + shared) count, for FLOPs."""
        h, i = self.hidden_size, self.intermediate_size
        norms = 4 if self.family == "gemma2" else 2
        layers = self.num_layers * (self._attention_parameters() + norms * h)
        moe = self.moe
        dense = self.num_layers if moe is None else min(moe.first_dense, self.num_layers)
        layers += dense * 3 * h * i
        if moe is not None:
            experts = moe.experts_per_token if active else moe.num_experts
            per_layer = (experts + moe.num_shared) * 3 * h * moe.intermediate_size + moe.num_experts * h
            layers += (self.num_layers - dense) * per_layer
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + emb + h

    def _attention_parameters(self) -> int:
        h, d, heads = self.hidden_size, self.head_dim, self.num_heads
        mla = self.mla
        if mla is not None:
            q = h * heads * mla.qk_head_dim
            if mla.q_lora_rank is not None:
                q = h * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * heads * mla.qk_head_dim
            kv = (
                h * mla.entry
                + mla.kv_lora_rank
                + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
            )
            return q + kv + heads * mla.v_head_dim * h
        attn = h * d * (heads + 2 * self.num_kv_heads) + heads * d * h
        if self.qkv_bias:
            attn += d * (heads + 2 * self.num_kv_heads)
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * d
        return attn

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dictionary (transformers 4.x or 5.x style)."""
        return cls(**hf_fields(d))

    @classmethod
    def from_json(cls, path: Path) -> ModelConfig:
        """Read a `config.json`; errors name the file."""
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"no config.json at {path}") from None
        except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8 at all
            raise ModelLoadError(f"cannot read {path} as JSON: {e}") from None
        if not isinstance(d, dict):
            raise ModelLoadError(f"{path} does not hold a JSON object")
        return cls.from_hf_dict(d)
