"""Tiny random Hugging Face models of every supported family, saved as safetensors folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvtier.config import ModelConfig
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.model.llama import CausalLM
from kvtier.planner.placement import KVPlan, plan_kv

CPU = torch.device("cpu")
PROMPT, DECODE, CHUNK, BLOCK = 23, 9, 5, 4  # the placement checks' prompt, decode steps, chunk, block
CONTEXT = PROMPT + DECODE

FAMILIES: dict[str, dict[str, Any]] = {
    "llama-gqa": {"cls": "LlamaConfig", "num_key_value_heads": 2},
    "llama-mha": {"cls": "LlamaConfig", "num_key_value_heads": 4},
    "llama-mqa": {"cls": "LlamaConfig", "num_key_value_heads": 1},
    "llama3-rope-scaling": {
        "cls": "LlamaConfig",
        "num_key_value_heads": 2,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "llama-linear-rope": {
        "cls": "LlamaConfig",
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    },
    "llama-yarn-rope": {
        "cls": "LlamaConfig",
        "num_key_value_heads": 2,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,  # = max_position_embeddings / original, as transformers expects
            "original_max_position_embeddings": 128,
        },
    },
    "mistral": {"cls": "MistralConfig", "num_key_value_heads": 2, "sliding_window": None},
    # Sliding windows shorter than the test prompts, so they bind in prefill chunks and decode.
    "mistral-window": {"cls": "MistralConfig", "num_key_value_heads": 2, "sliding_window": 8},
    "qwen2-window": {
        "cls": "Qwen2Config",
        "num_key_value_heads": 2,
        "use_sliding_window": True,
        "sliding_window": 6,
        "max_window_layers": 1,  # layer 0 full, layers 1 and 2 windowed
    },
    # Gemma-2: alternating local (window 8) and global layers, GeGLU, (1 + w) norms; caps small
    # enough that tanh bends the scores and logits, and a query scale other than head_dim ** -0.5.
    "gemma2": {
        "cls": "Gemma2Config",
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 0.1,
        "final_logit_softcapping": 3.0,
    },
    # DeepSeek-V2 latent attention (YaRN RoPE on the decoupled key, whose mscale also scales the
    # softmax) and MoE FFN after one dense layer; -lite projects q directly, the other through a
    # LoRA and routes within groups.
    "deepseek-v2-lite": {
        "cls": "DeepseekV2Config",
        **(
            _DEEPSEEK := {
                "kv_lora_rank": 32,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_shared_experts": 1,
                "moe_intermediate_size": 32,
                "first_k_dense_replace": 1,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 128,
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "mscale": 1.0,
                    "mscale_all_dim": 0.707,
                },
            }
        ),
        "q_lora_rank": None,
    },
    "deepseek-v2": {
        "cls": "DeepseekV2Config",
        **_DEEPSEEK,
        "q_lora_rank": 24,
        "topk_method": "group_limited_greedy",
        "n_group": 2,
        "topk_group": 1,
    },
    "qwen2-bias": {"cls": "Qwen2Config", "num_key_value_heads": 2},
    "qwen3-qknorm": {"cls": "Qwen3Config", "num_key_value_heads": 2, "head_dim": 16},
    "smollm-tied": {"cls": "LlamaConfig", "num_key_value_heads": 1, "tie_word_embeddings": True},
}


def make_hf_model(family: str, folder: Path, seed: int = 0, **overrides: Any) -> Any:
    """Build a random tiny model of `family`, save it to `folder`, return the HF model (fp32).

    `overrides` replace config fields of the family (e.g. `sliding_window=32`)."""
    import transformers

    spec = {**FAMILIES[family], **overrides}
    cls = getattr(transformers, spec.pop("cls"))
    cfg = cls(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=3,
        vocab_size=211,
        intermediate_size=96,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        **spec,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)  # non-trivial norm weights, so a missed norm shows
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)  # large biases, so a missed bias shows
    model.save_pretrained(folder, safe_serialization=True)
    return model


def drive(
    model: Any, store: Any, ids: torch.Tensor, chunk: int, decode: int
) -> tuple[list[torch.Tensor], list[int]]:
    """Chunked prefill of `ids` through `store`, then `decode` greedy steps.

    Returns every step's logits (all positions of prefill chunks) and the greedy tokens.
    """
    logits: list[torch.Tensor] = []
    tokens: list[int] = []
    for s in range(0, ids.shape[0], chunk):
        part = ids[s : s + chunk]
        store.begin_step(part.shape[0])
        logits.append(model(part, store, logits_at=torch.arange(part.shape[0], device=ids.device)))
        store.end_step()
    for _ in range(decode):
        tok = logits[-1][-1].argmax()
        tokens.append(int(tok))
        store.begin_step(1)
        logits.append(model(tok.view(1), store))
        store.end_step()
    return logits, tokens


def placement_plans(cfg: ModelConfig) -> dict[str, KVPlan]:
    """The planner's plans of CONTEXT tokens for every lossless policy, plus a partly resident
    and a sequence-block one (staging smaller than the context) built by hand."""
    made = {
        p: plan_kv(cfg, CONTEXT, policy=p, gpu_budget=None, dtype_bytes=4, chunk_size=CHUNK, block_size=BLOCK)
        for p in ("gpu", "layer", "head", "auto")
    }
    made["auto-mixed"] = KVPlan("auto", 1, 1, CHUNK, 2, 32)
    made["head-blocks"] = KVPlan("head", 1, 0, CHUNK, 2, 8)
    return made


def run_placement(
    model: CausalLM, cfg: ModelConfig, plan: KVPlan
) -> tuple[torch.Tensor, list[int], TieredKVStore]:
    """A PROMPT-token prefill in CHUNK-token steps and DECODE greedy steps over `plan` (fp32,
    BLOCK-token blocks): every position's logits, the tokens and the store."""
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5))
    store = TieredKVStore(
        cfg, plan, device=CPU, dtype=torch.float32, capacity=CONTEXT, options=StoreOptions(block_size=BLOCK)
    )
    logits, tokens = drive(model, store, ids, CHUNK, DECODE)
    return torch.cat(logits), tokens, store


def hf_step_logits(hf: Any, cfg: ModelConfig, tokens: list[int]) -> torch.Tensor:
    """transformers' logits of the same prompt followed by `tokens`, in one forward."""
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return hf(torch.cat((ids, torch.tensor(tokens)))[None]).logits[0]  # type: ignore[no-any-return]
