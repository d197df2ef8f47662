"""Which attention and KV method a request runs with: lossless dense by default; sparse
attention (HiP, Quest), quantized KV, eviction and head-wise sparsity are opt-in.

Methods are store parts (a slice kernel, codec, evictor); they hold per-request state (decode
caches, attention scores), so `StoreMethod.build` makes fresh parts for every request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.model.llama import CausalLM
from kvtier.policies import PolicyParts, build_policy

ATTENTION_METHODS = ("dense", "hip", "quest")


@dataclass(frozen=True)
class StoreMethod:
    """User-facing method options (the CLI flags of the same names)."""

    attention: str = "dense"
    hip_preset: str = "default"
    kv_quant: str | None = None
    evict: str | None = None
    kv_budget: int | None = None
    head_sparsity: float | None = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_METHODS:
            raise ConfigError(
                f"unknown --attention {self.attention!r}; use one of {', '.join(ATTENTION_METHODS)}"
            )
        if self.attention == "hip":
            others = [
                flag
                for flag, value in (
                    ("--kv-quant", self.kv_quant),
                    ("--evict", self.evict),
                    ("--kv-budget", self.kv_budget),
                    ("--head-sparsity", self.head_sparsity),
                )
                if value is not None
            ]
            if others:
                raise ConfigError(f"--attention hip cannot be combined with {', '.join(others)} yet")
        if self.head_sparsity is not None and not 0.0 <= self.head_sparsity <= 1.0:
            raise ConfigError(f"--head-sparsity must be a ratio in [0, 1], got {self.head_sparsity}")

    @property
    def lossless(self) -> bool:
        return self == StoreMethod()

    def build(
        self, cfg: ModelConfig, device: torch.device, model: CausalLM, hip_cache_tokens: int | None = None
    ) -> PolicyParts:
        """Fresh store parts for one request; raises ConfigError on bad names or combinations.
        `hip_cache_tokens`: HiP's block cache per offloaded slice (None: the preset's)."""
        if self.attention == "hip":
            from kvtier.sparse import make_hip_kernel

            kernel, unrotated = make_hip_kernel(cfg, device, self.hip_preset, cache_tokens=hip_cache_tokens)
            cache = "" if hip_cache_tokens is None else f", block cache {hip_cache_tokens} tokens/slice"
            describe = f"hip {self.hip_preset}{cache}"
            return PolicyParts(kernel=kernel, rotate_keys=not unrotated, describe=describe)
        return build_policy(
            cfg,
            kv_quant=self.kv_quant,
            evict=self.evict,
            kv_budget=self.kv_budget,
            attention=None if self.attention == "dense" else self.attention,
            head_sparsity=self.head_sparsity,
            device=device,
            model=model,
        )
