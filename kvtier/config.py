"""The model configuration kvtier runs on: one frozen dataclass for the whole Llama family.

Llama-2/3/3.1, Mistral, Qwen2/2.5, Qwen3 and SmolLM differ only in a few switches (qkv bias,
q/k norm, RoPE scaling, tied embeddings), so one config and one model implementation serve all.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm", "smollm2")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. `kind` is 'default', 'linear' or 'llama3'."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3"):
            raise ModelLoadError(
                f"RoPE scaling type {self.kind!r} is not supported; kvtier supports "
                "'default', 'linear' and 'llama3'"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ModelLoadError(f"RoPE theta and factor must be positive, got {self.theta}, {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a Llama-family decoder. Validated at construction."""

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
    sliding_window: int | None = None  # Mistral v0.1; kvtier runs full attention up to this length

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

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (1 = MHA, num_heads = MQA)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers and KV heads."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        """Parameter count, from the shapes (embeddings counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * d
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dictionary (transformers 4.x or 5.x style)."""
        model_type = str(d.get("model_type", "llama"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model_type {model_type!r} is not supported; kvtier runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} models"
            )
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            attention_bias = bool(d.get("attention_bias", False))
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope=_rope_from_hf(d),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=attention_bias and model_type != "qwen2",
                qk_norm=model_type == "qwen3",
                model_type=model_type,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                sliding_window=_sliding_window(d),
            )
        except KeyError as e:
            raise ModelLoadError(f"model config is missing the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"model config has a malformed value: {e}") from None

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


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    # transformers 5 nests everything under rope_parameters; 4.x used rope_theta + rope_scaling.
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", d.get("rope_theta", 10000.0)))
    kind = str(merged.get("rope_type", merged.get("type", "default")))
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(d: dict[str, Any]) -> int | None:
    window = d.get("sliding_window")
    if window is None or d.get("use_sliding_window") is False:
        return None
    return int(window)
