"""The model one tensor-parallel rank (or pipeline stage) holds, as a `ModelConfig`, so that
every formula and the placement planner apply to a rank unchanged.

With N ranks each rank owns num_kv_heads / N KV heads with their query heads and
intermediate_size / N MLP channels (Megatron's column / row split); embeddings, norms and the
LM head are whole on every rank. A config with those three fields divided is exactly the rank's
module: its parameter count is the rank's weights, its KV heads are the rank's slices, its
activations are the rank's (q, k, v and the MLP's [T, I] buffers split, the [T, hidden]
residual whole). The planner plans a rank by planning this config on one GPU's budget.

A pipeline stage holds a contiguous run of layers (`stage_layers`): its config is the model's
with those layers only.
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
    if size > 1 and (cfg.mla is not None or cfg.moe is not None):
        raise ConfigError(
            f"--tensor-parallel splits KV heads; {cfg.model_type}'s latent attention caches one entry "
            "shared by every head (and its experts are not split yet): use --pipeline-parallel"
        )
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


def stage_layers(num_layers: int, size: int, rank: int) -> range:
    """The decoder layers of pipeline stage `rank` of `size`: contiguous, in order; the first
    num_layers % size stages take one layer more."""
    base, extra = divmod(num_layers, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def check_pipeline_parallel(cfg: ModelConfig, size: int) -> None:
    """ConfigError unless `size` stages can each take at least one of `cfg`'s layers."""
    if not 1 <= size <= cfg.num_layers:
        raise ConfigError(
            f"--pipeline-parallel {size} must be between 1 and the model's {cfg.num_layers} layers "
            "(each stage holds at least one)"
        )


def stage_config(cfg: ModelConfig, size: int, rank: int) -> ModelConfig:
    """The config of pipeline stage `rank` of `size`: its layers, renumbered from 0 (embeddings,
    final norm and LM head are on every stage, so its parameter count is the stage's weights).

    NOTE: what is per layer moves with the layers: the sliding-window layers (Gemma-2's
    alternation, Qwen2's windows) and the first MoE layer (DeepSeek's dense ones before it)."""
    check_pipeline_parallel(cfg, size)
    layers = stage_layers(cfg.num_layers, size, rank)
    moe = cfg.moe and replace(cfg.moe, first_dense=max(0, cfg.moe.first_dense - layers.start))
    return replace(
        cfg,
        num_layers=len(layers),
        sliding_layers=tuple(i - layers.start for i in cfg.sliding_layers if i in layers),
        moe=moe,
    )
