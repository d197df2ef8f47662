"""The model configuration kvtier runs on: one frozen dataclass for every supported family.

Llama-2/3/3.1, Mistral, Qwen2/2.5, Qwen3 and SmolLM differ only in a few switches (qkv bias,
q/k norm, RoPE scaling, tied embeddings, sliding-window layers), so one config and one model
implementation serve all. Gemma-2 adds its own block (`family` "gemma2": four (1 + w) RMSNorms
per layer, GeGLU, scaled embeddings) and attention switches (logit soft-capping, a query scale,
alternating sliding-window and global layers).

DeepSeek-V2 (`family` "deepseek_v2") adds multi-head latent attention (`MLAConfig`) and a
mixture-of-experts FFN (`MoEConfig`). Its cache is one entry per token and layer, the latent plus
the decoupled RoPE key, which the store keeps as one "KV head" (`num_kv_heads` 1) whose K and V
rows are the entry's two halves (`head_dim` = entry / 2).

Sliding windows (HF's `sliding_window_overlay`): the query at position p of a layer in
`sliding_layers` sees keys p - window + 1 .. p, i.e. its `window` most recent tokens itself
included. At a context of at most `window` tokens that is plain causal attention.
"""

from kvtier.config.hf import SUPPORTED_MODEL_TYPES
from kvtier.config.model import ModelConfig
from kvtier.config.parts import ACTIVATIONS, ROPE_KINDS, MLAConfig, MoEConfig, RopeConfig

__all__ = [
    "ACTIVATIONS",
    "ROPE_KINDS",
    "SUPPORTED_MODEL_TYPES",
    "MLAConfig",
    "MoEConfig",
    "ModelConfig",
    "RopeConfig",
]
