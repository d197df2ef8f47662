"""Known model shapes, for benchmarks and planning without a download.

A preset is a Hugging Face `config.json` dictionary; `kvtier.loading.load_model` builds it with
random weights. The shapes are those of the published checkpoints.
"""

from __future__ import annotations

from typing import Any

from kvtier.config import ModelConfig
from kvtier.errors import ModelLoadError

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _gemma2(
    *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int, scalar: int
) -> dict[str, Any]:
    """A Gemma-2 config.json (google/gemma-2-*): the shapes vary, the rest is shared."""
    return {
        "model_type": "gemma2",
        "vocab_size": 256000,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "query_pre_attn_scalar": scalar,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
    }


PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama-3.1-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_scaling": _LLAMA3_ROPE,
        "rope_theta": 500000.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama-2-7b": {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "mistral-7b": {
        "model_type": "mistral",
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Mistral-7B-v0.1: the one with a 4096-token sliding window on every layer (v0.2/v0.3,
    # the "mistral-7b" shapes above, dropped it).
    "mistral-7b-v0.1": {
        "model_type": "mistral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2-7b": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    # Gemma-2: even layers local (4096-token window), odd layers global; logits soft-capped.
    "gemma-2-2b": _gemma2(
        hidden=2304, intermediate=9216, layers=26, heads=8, kv_heads=4, head_dim=256, scalar=256
    ),
    "gemma-2-9b": _gemma2(
        hidden=3584, intermediate=14336, layers=42, heads=16, kv_heads=8, head_dim=256, scalar=256
    ),
    "gemma-2-27b": _gemma2(
        hidden=4608, intermediate=36864, layers=46, heads=32, kv_heads=16, head_dim=128, scalar=144
    ),
    # DeepSeek-V2-Lite: MLA (512-value latent + 64-value RoPE key per token and layer, q without
    # LoRA), 64 routed experts (6 per token) + 2 shared after one dense layer, YaRN x40 RoPE.
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "moe_intermediate_size": 1408,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "tie_word_embeddings": False,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
    },
    "llama-3-70b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "smollm2-135m": {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig of a preset; unknown names list the known ones."""
    try:
        return ModelConfig.from_hf_dict(PRESETS[name])
    except KeyError:
        raise ModelLoadError(
            f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
        ) from None
