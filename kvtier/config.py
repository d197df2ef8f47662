"""The model configuration kvtier runs on: one frozen dataclass for every supported family.

Llama-2/3/3.1, Mistral, Qwen2/2.5, Qwen3 and SmolLM differ only in a few switches (qkv bias,
q/k norm, RoPE scaling, tied embeddings, sliding-window layers), so one config and one model
implementation serve all. Gemma-2 adds its own block (`family` "gemma2": four (1 + w) RMSNorms
per layer, GeGLU, scaled embeddings) and attention switches (logit soft-capping, a query scale,
alternating sliding-window and global layers).

Sliding windows (HF's `sliding_window_overlay`): the query at position p of a layer in
`sliding_layers` sees keys p - window + 1 .. p, i.e. its `window` most recent tokens itself
included. At a context of at most `window` tokens that is plain causal attention.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm", "smollm2", "gemma2")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SwiGLU, GeGLU


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
    """Shapes and switches of a decoder (Llama family or Gemma-2). Validated at construction."""

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
        for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ModelLoadError(f"model config: {name} must be positive, got {value}")

    @property
    def family(self) -> str:
        """The decoder block: "gemma2" (sandwich norms, GeGLU, scaled embeddings) or "llama"."""
        return "gemma2" if self.model_type == "gemma2" else "llama"

    @property
    def attn_scale(self) -> float | None:
        """The factor on q.k when it is not head_dim ** -0.5 (None: the default)."""
        if self.query_pre_attn_scalar is None or self.query_pre_attn_scalar == self.head_dim:
            return None
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def plain_scores(self) -> bool:
        """Scores are q.k / sqrt(head_dim), not soft-capped (what every fused kernel computes)."""
        return self.attn_softcap is None and self.attn_scale is None

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
        norms = 4 if self.family == "gemma2" else 2
        layer = attn + 3 * h * i + norms * h
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
            layers = int(d["num_hidden_layers"])
            window = _sliding_window(d, model_type)
            gemma = model_type == "gemma2"
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope=_rope_from_hf(d),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),  # Gemma's default: tied
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=attention_bias and model_type != "qwen2",
                qk_norm=model_type == "qwen3",
                model_type=model_type,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                sliding_window=window,
                sliding_layers=_sliding_layers(d, model_type, layers, window),
                attn_softcap=_optional_float(d.get("attn_logit_softcapping")) if gemma else None,
                final_softcap=_optional_float(d.get("final_logit_softcapping")) if gemma else None,
                query_pre_attn_scalar=_optional_float(d.get("query_pre_attn_scalar")) if gemma else None,
                hidden_act=str(
                    d.get("hidden_activation")
                    or d.get("hidden_act")
                    or ("gelu_pytorch_tanh" if gemma else "silu")
                ),
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


def _sliding_window(d: dict[str, Any], model_type: str) -> int | None:
    # NOTE: Qwen2/3 configs carry a sliding_window that is off unless use_sliding_window is set
    # (transformers' default False); Mistral and Gemma-2 have no such switch.
    window = d.get("sliding_window")
    switch = d.get("use_sliding_window", model_type not in ("qwen2", "qwen3"))
    if window is None or not switch:
        return None
    return int(window)


def _sliding_layers(d: dict[str, Any], model_type: str, layers: int, window: int | None) -> tuple[int, ...]:
    """The layers that attend within the window, as transformers 5 decides them: its
    `layer_types` when the config has them, else Mistral: every layer; Qwen2/3: layers from
    `max_window_layers` on (with `use_sliding_window`); Gemma-2: the even layers."""
    if window is None:
        return ()
    types = d.get("layer_types")
    if types is not None:
        if len(types) != layers:
            raise ModelLoadError(f"model config: layer_types has {len(types)} entries for {layers} layers")
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if model_type in ("qwen2", "qwen3"):
        first = int(d.get("max_window_layers", layers))
        return tuple(range(first, layers))
    if model_type == "gemma2":
        return tuple(range(0, layers, 2))
    return tuple(range(layers))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
