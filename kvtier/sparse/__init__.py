"""InfiniteHiP-style sparse attention: hierarchical chunk pruning + block-sparse attention.

`make_hip_kernel(cfg, device, preset, **overrides)` builds the `SliceKernel` for the tiered KV
store and says whether the store must keep keys un-rotated (context extension).

May import: the store (`kvtier.kv`), the planner, the model and attention interfaces.
Imported by the methods registry (`kvtier.methods.hip`), never by the store.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from kvtier.attention.interface import SliceKernel
from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.model.rope import Rotary
from kvtier.sparse.config import REFRESH_PRESETS, HipConfig
from kvtier.sparse.decode_memory import slice_decode_bytes
from kvtier.sparse.gpu_cache import CacheStats
from kvtier.sparse.kernel import HipKernel, HipStats
from kvtier.sparse.prune_memory import PRUNE_BATCH_BYTES, decode_scoring_bytes
from kvtier.sparse.pruning import SCORING_SLAB
from kvtier.sparse.rope_ext import table_bytes

# "5K": finer chunks and larger budgets, for harder retrieval (the paper recommends it).
_5K = HipConfig(chunk_sizes=(64, 32, 16), budgets=(32768, 16384, 4096), wide_budget=4096)
# "long": 5K with softmax chunk scores and a 2048-token window, what retrieved best beyond the
# trained length on SmolLM2 on the CPU (16K: 4/5, 32K: 3/5, dense 0; docs/hip_quality.md).
_LONG = replace(_5K, head_score="softmax", window=2048)

HIP_PRESETS: dict[str, HipConfig] = {
    # The paper's "3K" setting: sink 256, window 1024, chunks 256/32/8, keep 32K/8K/2K (4K in
    # layers 0-3); decode refresh every (16, 8, 4) steps.
    "default": HipConfig(),
    "fast": HipConfig(refresh=REFRESH_PRESETS["fast"]),
    "flash": HipConfig(refresh=REFRESH_PRESETS["flash"]),
    "5k": _5K,
    "long": _LONG,
    # "lean": long with fewer keys (sink 256 + 2K selected + 1K window) in finer chunks after the
    # first stage. On the embedded SmolLM2's prose NIAH (CUDA, 3 samples a depth) 16K 31/33 and
    # 32K 29/33 against long's 27/33 and 19/33: past the trained length, the fewer keys a query
    # attends, the better it retrieves (bench/results/hip_lean_prose.json). Its first stage
    # scores the paper's 256-token chunks: up to 32K its 32K budget keeps every candidate, so no
    # quality run ever depended on that chunk (tests/test_hip.py), and past it the 32-token
    # chunks it had cost half of Llama-3.1's prefill at 160K (hip_cli_speed_160k_lean_fast.json).
    # Its decode reruns stage 0 every 128 steps and stages 1 and 2 every 8 and 4
    # (REFRESH_PRESETS): the quality runs above ran 16/8/4, and answers of up to 17 tokens (every
    # pass key, most NIAH answers) are the same with either: 16/8/4's first stage-0 rerun is the
    # 17th decode step (18th token).
    "lean": replace(
        _LONG,
        chunk_sizes=(256, 16, 8),
        budgets=(32768, 16384, 2048),
        window=1024,
        refresh=REFRESH_PRESETS["lean"],
    ),
}

# `--hip-preset auto` (the default): the preset a request's context calls for.
AUTO_PRESET = "auto"
PRESET_NAMES = (AUTO_PRESET, *HIP_PRESETS)
# Past the trained length, `lean` kept NIAH at 94-100% (16K) and 88-100% (32K) on the embedded
# SmolLM2 where the paper's setting missed; within it `lean` also scored 98.5-100% at 4K and 8K
# (bench/results/niah_smollm2_cuda_*_lean_x3.json). Within the trained length `fast` keeps the
# paper's speed: it keeps 8K tokens after stage 1 where lean keeps 16K, and it reruns the stages
# every 32/16/8 decode steps, the public hip-attention code's default (the paper's Table 2 finds
# it as good as its own 16/8/4).
EXTENSION_PRESET = "lean"
WITHIN_PRESET = "fast"


def resolve_preset(name: str, cfg: ModelConfig, context: int | None) -> str:
    """The HIP_PRESETS key a request runs: `name` itself, or for "auto" `EXTENSION_PRESET` when
    the request's `context` (prompt plus output, in tokens) exceeds the model's trained length
    (`max_position_embeddings`) and `WITHIN_PRESET` otherwise (also when the context is unknown).
    Raises ConfigError on an unknown name."""
    if name == AUTO_PRESET:
        past = context is not None and context > cfg.max_position_embeddings
        return EXTENSION_PRESET if past else WITHIN_PRESET
    if name not in HIP_PRESETS:
        raise ConfigError(f"unknown hip preset {name!r}; use one of {', '.join(PRESET_NAMES)}")
    return name


def hip_config(preset: str | HipConfig, refresh: str | None = None) -> HipConfig:
    """A preset's HipConfig (a HipConfig passes through), with the decode refresh intervals of
    the REFRESH_PRESETS name `refresh` when given. Raises ConfigError on an unknown name."""
    if isinstance(preset, str):
        if preset not in HIP_PRESETS:
            raise ConfigError(f"unknown hip preset {preset!r}; use one of {', '.join(HIP_PRESETS)}")
        preset = HIP_PRESETS[preset]
    return preset if refresh is None else preset.with_refresh(refresh)


def make_hip_kernel(
    cfg: ModelConfig,
    device: torch.device,
    preset: str = "default",
    capacity: int | None = None,
    **overrides: object,
) -> tuple[SliceKernel, bool]:
    """The HiP kernel for a model, and whether the store needs `rotate_keys=False`.

    `preset` is a key of HIP_PRESETS; `overrides` are HipConfig fields (e.g. `window=512`,
    `extend=False`, `refresh=(96, 24, 8)`); `capacity`: the request's tokens, which a RoPE table
    placed in the store's memory is sized for (`HipKernel.place_caches`) and which bound its
    block caches and decode rows (`HipConfig.capacity`). Raises ConfigError on
    an unknown preset or field, or on contradictory budgets.
    """
    if preset not in HIP_PRESETS:
        raise ConfigError(f"unknown hip preset {preset!r}; use one of {', '.join(HIP_PRESETS)}")
    names = {f.name for f in fields(HipConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(f"unknown hip option(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    hip = replace(HIP_PRESETS[preset], **{"capacity": capacity, **overrides})  # type: ignore[arg-type]
    rotary = Rotary(cfg.rope, cfg.head_dim, device) if hip.extend else None
    kernel = HipKernel(hip, rotary)  # NOTE: `hip.capacity` sizes its RoPE table and caches
    return kernel, kernel.needs_unrotated_keys


# Block-cache sizes (tokens per offloaded slice) the engine tries, largest first, when a whole
# refresh interval's cache leaves no room for a layer's staging buffers. 8K still holds the
# published budgets' final selection (2K in 8-token chunks), sinks and window.
CACHE_TOKEN_STEPS = (16384, 12288, 10240, 8192)
# Smaller ones, tried only when no slicing fits with those: a step then fetches from the host
# the part of its final selection the cache misses, rather than the request failing (a 256K
# HiP request beside an 8B model's pool under 24 GiB fits with 4K).
SMALL_CACHE_TOKEN_STEPS = (6144, 4096)


def hip_gpu_bytes(
    cfg: ModelConfig,
    preset: str | HipConfig = "default",
    dtype_bytes: int = 2,
    context: int = 0,
    cache_tokens: int | None = None,
) -> int:
    """GPU bytes HiP holds besides the plan's KV: every slice's block cache (used when the slice
    is offloaded) and decode attention buffer, at the preset's budgets (bounded by `context`:
    `HipConfig.capacity`), the RoPE table of
    context extension, which covers every position up to `context`, and prefill's temporaries
    (pruning one batch of query blocks). `cache_tokens`: the block cache
    per slice (None: the preset's, a whole refresh interval).

    The planner does not know about them; the engine takes them off the GPU budget.
    """
    return sum(hip_phase_bytes(cfg, preset, dtype_bytes, context, cache_tokens))


def cache_bank_bytes(cfg: ModelConfig, hip: HipConfig, group: int, dtype_bytes: int = 2) -> int:
    """GPU bytes of the block-cache bank of one streamed slice of `group` KV heads under `hip`
    (its `cache_tokens`; None: a refresh interval): what `CachedDecode._cache_for` allocates,
    from the store's memory when the kernel was given it (`HipKernel.place_caches`)."""
    slots = hip.offload_cache_slots(group if hip.per_head else 1)
    return slots * hip.cache_block * 2 * group * cfg.head_dim * dtype_bytes


def hip_method_buffers(
    cfg: ModelConfig, hip: HipConfig, group: int, dtype_bytes: int, context: int, streamed: list[bool]
) -> tuple[int, ...]:
    """What a `HipKernel` given the store's memory (`place_caches`) allocates there, in order
    (`Placement.method_buffers`): the RoPE table's cos and sin (with `extend`, sized for
    `context`), then each slice's decode arena (`slice_decode_bytes`) in slice order, as the
    first decode step reaches them; `streamed[i]`: whether slice i streams (its bank)."""
    rope = table_bytes(context, cfg.head_dim, dtype_bytes) // 2 if hip.extend and context else 0
    hip = replace(hip, capacity=context) if context else hip  # as the kernel is built for it
    arenas = [slice_decode_bytes(cfg.head_dim, hip, group, dtype_bytes, s) for s in streamed]
    return (*((rope, rope) if rope else ()), *arenas)


def hip_phase_bytes(
    cfg: ModelConfig,
    preset: str | HipConfig = "default",
    dtype_bytes: int = 2,
    context: int = 0,
    cache_tokens: int | None = None,
) -> tuple[int, int]:
    """`hip_gpu_bytes` by phase: (decode only: block caches and decode buffers; always: the RoPE
    table and pruning temporaries, the larger of prefill's batch (`HipConfig.prune_bytes`) and a
    decode refresh's scoring product). The kernel frees the decode bytes when a prefill step starts
    (`HipKernel.begin_prefill`), so a prefill chunk's activations and the decode caches need not
    fit at once. `preset`: a HIP_PRESETS name or its config (`hip_config`)."""
    hip = replace(hip_config(preset), cache_tokens=cache_tokens, capacity=context or None)
    tokens = hip.offload_cache_tokens() + hip.decode_buffer_tokens()
    caches = cfg.num_layers * cfg.num_kv_heads * tokens * 2 * cfg.head_dim * dtype_bytes
    rope = table_bytes(context, cfg.head_dim, dtype_bytes) if context and hip.extend else 0
    vectors = min(SCORING_SLAB, context * cfg.num_kv_heads) if context else SCORING_SLAB
    batch = PRUNE_BATCH_BYTES if hip.prune_bytes is None else hip.prune_bytes
    pruning = max(batch, decode_scoring_bytes(vectors, cfg.head_dim, dtype_bytes))
    return caches, rope + pruning


__all__ = [
    "AUTO_PRESET",
    "CACHE_TOKEN_STEPS",
    "HIP_PRESETS",
    "PRESET_NAMES",
    "SMALL_CACHE_TOKEN_STEPS",
    "CacheStats",
    "HipConfig",
    "HipKernel",
    "HipStats",
    "cache_bank_bytes",
    "hip_config",
    "hip_gpu_bytes",
    "hip_method_buffers",
    "hip_phase_bytes",
    "make_hip_kernel",
    "resolve_preset",
    "slice_decode_bytes",
]
