"""The model one tensor-parallel rank holds, as a `ModelConfig`, so that every formula and the
placement planner apply to a rank unchanged.

With N ranks each rank owns num_kv_heads / N KV heads with their query heads and
intermediate_size / N MLP channels (Megatron's column / row split); embeddings, norms and the
LM head are whole on every rank. A config with those three fields divided is exactly the rank's
module: its parameter count is the rank's weights, its KV heads are the rank's slices, its
activations are the rank's (q, k, v and the MLP's [T, I] buffers split, the [T, hidden]
residual whole). The planner plans a rank by planning this config on one GPU's budget.
"""

from __future__ import annotations

from dataclasses import replace

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError


def tensor_parallel_sizes(cfg: ModelConfig) -> list[int]:
    """Every N that a model can be split over: N divides both the KV heads and the MLP width."""
    return [
        n
        for n in range(1, cfg.num_kv_heads + 1)
        if cfg.num_kv_heads % n == 0 and cfg.intermediate_size % n == 0
    ]


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """ConfigError, saying which sizes work, unless `size` ranks can split `cfg`."""
    if size < 1:
        raise ConfigError(f"--tensor-parallel must be at least 1, got {size}")
    if cfg.num_kv_heads % size:
        raise ConfigError(
            f"--tensor-parallel {size} must divide the model's {cfg.num_kv_heads} KV heads (each rank "
            f"owns whole KV heads and their query heads); use one of "
            f"{', '.join(map(str, tensor_parallel_sizes(cfg)))}"
        )
    if cfg.intermediate_size % size:
        raise ConfigError(
            f"--tensor-parallel {size} must divide the model's MLP width ({cfg.intermediate_size}); "
            f"use one of {', '.join(map(str, tensor_parallel_sizes(cfg)))}"
        )


def rank_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config of one of `size` tensor-parallel ranks (`cfg` itself when size is 1)."""
    check_tensor_parallel(cfg, size)
    if size == 1:
        return cfg
    return replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=cfg.num_kv_heads // size,
        intermediate_size=cfg.intermediate_size // size,
    )


def rank_host_budget(host_budget: int | None, size: int) -> int | None:
    """One rank's share of the host memory: the ranks of one machine split it evenly."""
    return None if host_budget is None else host_budget // size
