"""The parts of a model config that are configs of their own: RoPE (with YaRN), MLA and MoE."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.errors import ModelLoadError

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SwiGLU, GeGLU
ROPE_KINDS = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. `kind` is one of ROPE_KINDS; the beta and mscale fields are
    YaRN's (transformers' `_compute_yarn_parameters`)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ModelLoadError(
                f"RoPE scaling type {self.kind!r} is not supported; kvtier supports {', '.join(ROPE_KINDS)}"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ModelLoadError(f"RoPE theta and factor must be positive, got {self.theta}, {self.factor}")

    @property
    def attention_factor(self) -> float:
        """YaRN's multiplier on cos and sin (1 for the other kinds)."""
        if self.kind != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)

    def softmax_mscale(self) -> float:
        """DeepSeek's extra factor on the softmax scale under scaled RoPE: mscale(factor,
        mscale_all_dim) ** 2, or 1 (transformers' `yarn_apply_mscale`)."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2): keys and values are up-projected from a
    `kv_lora_rank` latent per token; `qk_rope_head_dim` dimensions of every head carry RoPE
    through one key shared by all heads (the "decoupled" key, cached next to the latent)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q projected from hidden directly (V2-Lite)

    def __post_init__(self) -> None:
        dims = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if min(dims) < 1 or (self.q_lora_rank is not None and self.q_lora_rank < 1):
            raise ModelLoadError(f"model config: MLA dimensions must be positive, got {self}")
        if self.entry % 2 or self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.entry // 2:
            raise ModelLoadError(
                f"model config: kvtier stores the MLA entry (kv_lora_rank + qk_rope_head_dim = {self.entry}) "
                "as two halves: it must be even, with an even RoPE part of at most half of it"
            )

    @property
    def entry(self) -> int:
        """Values cached per token and layer: the latent and the decoupled RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """A DeepSeek mixture-of-experts FFN: a softmax router picks `experts_per_token` of
    `num_experts` (greedy, or within the `topk_group` best of `n_group` groups), weights scaled
    by `routed_scaling_factor`, plus `num_shared` always-on experts; the first `first_dense`
    layers keep a dense MLP. `experts_on_host`: where the model as loaded keeps its routed
    experts, in pinned host memory (each step copies in the experts its tokens chose) instead of
    on the device; `kvtier.planner.memory.place_experts` decides it from the GPU budget."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    num_shared: int = 0
    first_dense: int = 0
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    experts_on_host: bool = False

    def __post_init__(self) -> None:
        if min(self.num_experts, self.experts_per_token, self.intermediate_size) < 1:
            raise ModelLoadError(f"model config: MoE sizes must be positive, got {self}")
        if self.experts_per_token > self.num_experts or self.num_experts % max(self.n_group, 1):
            raise ModelLoadError(f"model config: inconsistent MoE routing, got {self}")
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ModelLoadError(
                f"model config: topk_method {self.topk_method!r} is not supported; "
                "kvtier routes 'greedy' and 'group_limited_greedy'"
            )
