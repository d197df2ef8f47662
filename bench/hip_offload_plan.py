"""What one `bench/hip_offload.py` row runs over: the slice kernel of its method ("dense" or a
HiP preset, shrunk to the context on the CPU smoke run), the GPU bytes HiP keeps beside the store,
and the store's plan (`--policy`, or HiP's slices and block cache as the engine plans them)."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from typing import Any

import torch

from kvtier.attention.interface import DenseKernel, SliceKernel
from kvtier.config import ModelConfig
from kvtier.planner.hardware import hardware_preset
from kvtier.planner.placement import KVPlan, plan_kv
from kvtier.sparse import HIP_PRESETS, HipConfig, make_hip_kernel
from kvtier.sparse.rope_ext import table_bytes


def preset_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """A `--presets` entry, a preset name with options after '+' ("fast+strides=16/4/1+exact=8",
    "fast+stage0=256", "fast+landmarks=1"), as the name and its options, named as
    `MethodChoice`'s (`hip_strides`, `hip_exact`, `hip_stage0`, `hip_landmarks`)."""
    name, *options = spec.split("+")
    known = {"strides": "hip_strides", "exact": "hip_exact", "stage0": "hip_stage0"}
    known["landmarks"] = "hip_landmarks"
    out: dict[str, Any] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in known or not value:
            raise SystemExit(
                f"--presets {spec!r}: options are strides=A/B/C, exact=N, stage0=N and landmarks=1, "
                f"got {option!r}"
            )
        out[known[key]] = value if key == "strides" else int(value)
    if name not in HIP_PRESETS:
        raise SystemExit(f"--presets {spec!r}: unknown preset {name!r}; use one of {', '.join(HIP_PRESETS)}")
    return name, out


def hip_config(preset: str, context: int, smoke: bool, cache_tokens: int | None = None) -> HipConfig:
    """The config of `preset` (a `preset_spec`); in smoke mode shrunk to the context
    (`HipConfig.scaled`). `cache_tokens`: the GPU block cache of a streamed slice (None: a
    whole refresh interval)."""
    name, options = preset_spec(preset)
    base = HIP_PRESETS[name]
    if "hip_strides" in options:
        base = replace(base, query_strides=tuple(int(v) for v in options["hip_strides"].split("/")))
    base = replace(base, exact_chunk=options.get("hip_exact", base.exact_chunk))
    base = replace(base, stage0_block_q=options.get("hip_stage0", base.stage0_block_q))
    base = replace(base, stage0_landmarks=bool(options.get("hip_landmarks", base.stage0_landmarks)))
    if not smoke:
        return replace(base, cache_tokens=cache_tokens)
    scaled = HipConfig.scaled(context, refresh=base.refresh, cache_block=8, cache_tokens=cache_tokens)
    return replace(
        scaled,
        exact_chunk=base.exact_chunk,
        stage0_block_q=base.stage0_block_q,
        stage0_landmarks=base.stage0_landmarks,
    )


def make_kernel(
    cfg: ModelConfig,
    method: str,
    context: int,
    device: torch.device,
    smoke: bool,
    cache_tokens: int | None,
    host_scoring: bool = False,
) -> tuple[SliceKernel, bool]:
    """("dense" | "hip-<preset>") -> the slice kernel and whether keys stay un-rotated;
    `host_scoring`: `HipConfig.host_scoring` (stage-0 reruns on keys read from the host)."""
    if method == "dense":
        return DenseKernel(), False
    hip = hip_config(method.removeprefix("hip-"), context, smoke, cache_tokens)
    hip = replace(hip, host_scoring=host_scoring)
    overrides = {f.name: getattr(hip, f.name) for f in fields(HipConfig)}
    return make_hip_kernel(cfg, device, "default", **overrides)


def cache_bytes_estimate(
    cfg: ModelConfig, method: str, context: int, smoke: bool, dtype_bytes: int, cache_tokens: int | None
) -> int:
    """GPU bytes of HiP's block caches and decode attention buffers (the same for any slicing
    of a layer's KV heads: one selection per slice), and its RoPE table (0 for dense)."""
    if method == "dense":
        return 0
    hip = hip_config(method.removeprefix("hip-"), context, smoke, cache_tokens)
    token = 2 * cfg.head_dim * dtype_bytes
    per_slice = hip.offload_cache_tokens() + hip.decode_buffer_tokens()
    rope = table_bytes(context + 4096, cfg.head_dim, dtype_bytes) if hip.extend else 0  # + prefill chunk
    return cfg.num_layers * cfg.num_kv_heads * per_slice * token + rope


def make_plan(cfg: ModelConfig, total: int, args: argparse.Namespace, reserve: int) -> KVPlan:
    """The `--policy` plan (`--head-group`): every slice streamed on the CPU smoke run, planned
    under the cap, less HiP's `reserve` bytes, on the GPU."""
    if args.smoke:
        return KVPlan(
            policy="layer" if args.policy == "layer" else "head",
            group_size=cfg.num_kv_heads if args.policy == "layer" else 1,
            resident_slices=0,
            chunk_size=args.chunk or 256,
            staging_buffers=2,
            staging_tokens=total,
        )
    return plan_kv(
        cfg,
        total,
        policy="auto" if args.policy == "planned" else args.policy,  # lossless: the engine's plan
        gpu_budget=args.budget - reserve,
        dtype_bytes=2,
        chunk_size=args.chunk or None,
        group_size=args.head_group,
        hardware=hardware_preset("h200"),
        codec=codec_of(args),
    )


def codec_of(args: argparse.Namespace) -> Any:
    """`--kv-quant`'s codec (None: bf16 KV), fresh for each store."""
    if args.kv_quant is None:
        return None
    from kvtier.methods.spec import parse_choice

    return parse_choice(args.kv_quant).codec()


def engine_plan(
    cfg: ModelConfig, total: int, args: argparse.Namespace, method: str
) -> tuple[KVPlan, int | None]:
    """What `kvtier generate --attention hip --kv auto` plans (`kvtier.methods.plan_for`): slices
    and block cache per slice, with the preset's budgets."""
    from kvtier.methods import MethodChoice, PlanInputs, plan_for

    inputs = PlanInputs(
        cfg,
        total,
        hardware=hardware_preset("h200"),
        dtype_bytes=2,
        gpu_budget=args.budget,
        kv="auto",
        chunk_size=args.chunk or None,
    )
    name, options = preset_spec(method.removeprefix("hip-"))
    choice = MethodChoice(
        attention="hip",
        hip_preset=name,
        **{k: v for k, v in options.items() if k.startswith("hip_")},  # (stage 0's group: not planned)
        kv_quant=args.kv_quant,
        hip_host_keys=args.host_scoring,  # as the kernel: with host keys caches take the staging bytes
    )
    placed = plan_for(inputs, choice)
    return placed.plan, placed.cache_tokens
