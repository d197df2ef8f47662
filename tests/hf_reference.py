"""Tiny random Hugging Face models of every supported family, saved as safetensors folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

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
