"""`--attention hip`: InfiniteHiP-style sparse attention with context extension (`kvtier.sparse`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.errors import ConfigError
from kvtier.methods.registry import (
    BuildContext,
    MethodEntry,
    Option,
    Placement,
    PlanInputs,
    PlanWith,
    register,
)
from kvtier.policies import PolicyParts
from kvtier.sparse import AUTO_PRESET, PRESET_NAMES, hip_config, make_hip_kernel, resolve_preset
from kvtier.sparse.config import REFRESH_PRESETS
from kvtier.sparse.planning import plan_hip


def _preset(text: str) -> str:
    if text not in PRESET_NAMES:
        raise ConfigError(f"unknown --hip-preset {text!r}; use one of {', '.join(PRESET_NAMES)}")
    return text


def _refresh(text: str) -> str:
    if text not in REFRESH_PRESETS:
        raise ConfigError(f"unknown --hip-refresh {text!r}; use one of {', '.join(REFRESH_PRESETS)}")
    return text


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise ConfigError(f"--hip-host-keys takes on or off, got {text!r}")
    return text == "on"


def _plan(inputs: PlanInputs, options: Mapping[str, Any], plan_with: PlanWith) -> Placement:
    """HiP's slicing and chunk search (`kvtier.sparse.planning.plan_hip`): whole layers first when
    the `auto` policy has no group given, with the largest block cache that fits."""
    preset = resolve_preset(str(options["hip_preset"]), inputs.cfg, inputs.context)
    hip = plan_hip(
        inputs.cfg,
        inputs.context,
        plan_with,
        gpu_budget=inputs.gpu_budget,
        preset=hip_config(preset, options.get("hip_refresh")),
        dtype_bytes=inputs.dtype_bytes,
        layers_first=inputs.kv == "auto" and inputs.head_group is None,
        chunk_size=inputs.chunk_size,
        hardware=inputs.hardware,
        staging_idle_in_decode=bool(options.get("hip_host_keys")) and inputs.staging_freed_in_decode,
    )
    return Placement(hip.plan, hip.cache_tokens, hip.reserve_bytes)


def _build(ctx: BuildContext) -> PolicyParts:
    asked = str(ctx.options["hip_preset"])
    preset = resolve_preset(asked, ctx.cfg, ctx.context)
    refresh = ctx.options.get("hip_refresh")
    hip = hip_config(preset, refresh)
    host_keys = bool(ctx.options.get("hip_host_keys"))
    kernel, unrotated = make_hip_kernel(
        ctx.cfg,
        ctx.device,
        preset,
        cache_tokens=ctx.hip_cache_tokens,
        refresh=hip.refresh,
        host_scoring=host_keys,
    )
    cache = "" if ctx.hip_cache_tokens is None else f", block cache {ctx.hip_cache_tokens} tokens/slice"
    auto = f" ({AUTO_PRESET})" if asked == AUTO_PRESET else ""
    every = "" if refresh is None else f", refresh {refresh}"
    keys = ", stage 0 on host keys" if host_keys else ""
    describe = f"hip {preset}{auto}{every}{cache}{keys}"
    return PolicyParts(kernel=kernel, rotate_keys=not unrotated, describe=describe)


HIP = register(
    MethodEntry(
        "hip",
        "attention",
        "InfiniteHiP-style sparse attention (chunk pruning + block-sparse attention), extends context",
        _build,
        takes=("hip_preset", "hip_refresh", "hip_host_keys"),
        plan=_plan,
        composes_with=("kv_quant",),
        borrows_pages=True,  # block caches, decode buffers, RoPE table: its reserve_bytes
    ),
    Option(
        "hip_preset",
        "--hip-preset",
        _preset,
        f"HiP budgets and refresh intervals: {', '.join(PRESET_NAMES)} (auto, the default: "
        "lean past the model's trained length, fast within it)",
    ),
    Option(
        "hip_refresh",
        "--hip-refresh",
        _refresh,
        "decode steps between reruns of HiP's pruning stages, by name: "
        + ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in REFRESH_PRESETS.items())
        + " (default: the preset's; stage 0 reads every key of an offloaded slice: default "
        "reruns it every 16 steps, lean and fast every 32)",
    ),
    Option(
        "hip_host_keys",
        "--hip-host-keys",
        _on_off,
        "on: a decode step that reruns HiP's stage 0 on an offloaded slice reads the slice's "
        "keys from host memory (half the bytes of streaming it whole) and the rest through the "
        "block cache; same output (default off: not measured on a GPU yet)",
    ),
)
