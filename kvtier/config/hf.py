"""Reading a Hugging Face `config.json` dictionary into `ModelConfig` fields."""

from __future__ import annotations

from typing import Any

from kvtier.config.parts import MLAConfig, MoEConfig, RopeConfig
from kvtier.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm", "smollm2", "gemma2", "deepseek_v2")


def hf_fields(d: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig`'s keyword arguments from a transformers 4.x or 5.x config dictionary;
    ModelLoadError names what is missing or malformed."""
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
        mla = _mla_from_hf(d) if model_type == "deepseek_v2" else None
        kv_heads = int(d.get("num_key_value_heads") or heads) if mla is None else 1
        head_dim = int(d.get("head_dim") or hidden // heads) if mla is None else mla.entry // 2
        if mla is not None and attention_bias:
            raise ModelLoadError("model config: DeepSeek-V2 with attention_bias is not supported")
        return dict(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
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
            mla=mla,
            moe=_moe_from_hf(d) if model_type == "deepseek_v2" else None,
        )
    except KeyError as e:
        raise ModelLoadError(f"model config is missing the field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"model config has a malformed value: {e}") from None


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
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=_optional_float(merged.get("mscale")),
        mscale_all_dim=_optional_float(merged.get("mscale_all_dim")),
        truncate=bool(merged.get("truncate", True)),
    )


def _mla_from_hf(d: dict[str, Any]) -> MLAConfig:
    q_lora = d.get("q_lora_rank")
    return MLAConfig(
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        q_lora_rank=None if q_lora is None else int(q_lora),
    )


def _moe_from_hf(d: dict[str, Any]) -> MoEConfig | None:
    experts = d.get("n_routed_experts") or d.get("num_experts")
    if not experts:
        return None
    return MoEConfig(
        num_experts=int(experts),
        experts_per_token=int(d["num_experts_per_tok"]),
        intermediate_size=int(d["moe_intermediate_size"]),
        num_shared=int(d.get("n_shared_experts") or 0),
        first_dense=int(d.get("first_k_dense_replace") or 0),
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
        topk_method=str(d.get("topk_method") or "greedy"),
        n_group=int(d.get("n_group") or 1),
        topk_group=int(d.get("topk_group") or 1),
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
