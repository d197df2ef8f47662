"""The kvtier `ModelConfig` of a Hugging Face model, and the checks that it can run over the store."""

from __future__ import annotations

from typing import Any

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError


def model_config(model: Any) -> ModelConfig:
    """The shapes of `model` (a transformers causal LM of the Llama family) as a `ModelConfig`.

    Raises `ModelLoadError` for a model type kvtier does not run and `ConfigError` for
    attention the store cannot reproduce (sliding windows, non-default attention scaling).
    """
    hf = model.config.get_text_config(decoder=True)
    d = dict(hf.to_dict())
    # NOTE: HF applies RoPE before the cache sees the keys, so the store never rotates anything
    # here: whatever RoPE type transformers implements is fine, and the parameters are dropped
    # (kvtier's own RoPE supports fewer types and would reject some).
    d.pop("rope_parameters", None)
    d.pop("rope_scaling", None)
    cfg = ModelConfig.from_hf_dict(d)
    layer_types = set(d.get("layer_types") or ["full_attention"])
    if cfg.sliding_window is not None or layer_types != {"full_attention"}:
        raise ConfigError(
            f"this {cfg.model_type} model uses sliding-window attention (sliding_window="
            f"{d.get('sliding_window')}, layer types {sorted(layer_types)}), which kvtier's store does "
            "not implement; kvtier.hf runs models with full attention in every layer"
        )
    if not cfg.plain_scores:  # HF's attention hands the cache its own key layout for these
        raise ConfigError(
            f"this {cfg.model_type} model scores attention with soft-capping or latent attention (MLA), "
            "which kvtier.hf cannot run through transformers' cache; use kvtier's own runner "
            "(kvtier.LLM, kvtier generate)"
        )
    return cfg
