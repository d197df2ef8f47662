"""`--attention hip`: InfiniteHiP-style sparse attention with context extension (`kvtier.sparse`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.kv.slices import place_slices
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
from kvtier.sparse import (
    AUTO_PRESET,
    PRESET_NAMES,
    SMALL_CACHE_TOKEN_STEPS,
    hip_config,
    hip_method_buffers,
    make_hip_kernel,
    resolve_preset,
)
from kvtier.sparse.config import EXACT_CHUNK_MAX, REFRESH_PRESETS, HipConfig, refresh_intervals
from kvtier.sparse.planning import HipPlacement, plan_hip, whole_chunk_pruning


def _preset(text: str) -> str:
    if text not in PRESET_NAMES:
        raise ConfigError(f"unknown --hip-preset {text!r}; use one of {', '.join(PRESET_NAMES)}")
    return text


def _refresh(text: str) -> str:
    intervals = refresh_intervals(text, "--hip-refresh")
    return text if text in REFRESH_PRESETS else "/".join(map(str, intervals))


def _on_off(text: str) -> bool | None:
    if text not in ("on", "off", "auto"):
        raise ConfigError(f"--hip-host-keys takes on, off or auto, got {text!r}")
    return None if text == "auto" else text == "on"


def _strides(text: str) -> str:
    """`--hip-strides`: queries mean-pooled per score in each pruning stage, joined by '/'."""
    try:
        values = [int(v) for v in text.split("/")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(
            f"--hip-strides takes a positive number of queries pooled per score for each pruning "
            f"stage, joined by '/' (the presets' 4/4/1), got {text!r}"
        )
    return "/".join(map(str, values))


def _exact(text: str) -> int:
    """`--hip-exact`: 0 or off, or the largest chunk (tokens, a power of two) scored on every key."""
    value = 0 if text == "off" else int(text) if text.isdigit() else -1
    if value < 0 or value > EXACT_CHUNK_MAX or value & (value - 1):
        raise ConfigError(
            f"--hip-exact takes off or a chunk size in tokens, a power of two up to {EXACT_CHUNK_MAX} "
            f"(8: lean's last stage), got {text!r}"
        )
    return value


def _stage0(text: str) -> int:
    """`--hip-stage0`: 0 or off, or the queries (a positive multiple of 64) that share stage 0."""
    value = 0 if text == "off" else int(text) if text.isdigit() else -1
    if value < 0 or value % 64:
        raise ConfigError(
            f"--hip-stage0 takes off or a number of queries, a multiple of 64 (HiP's query block), "
            f"such as 256 (stage 0 once per 4 blocks), got {text!r}"
        )
    return value


def _landmarks(text: str) -> bool | str:
    """on: True, off: False, all: "all" (the prompt's last token on the landmarks too)."""
    if text not in ("on", "off", "all"):
        raise ConfigError(f"--hip-landmarks takes on, all or off, got {text!r}")
    return "all" if text == "all" else text == "on"


def _config(options: Mapping[str, Any], preset: str) -> HipConfig:
    """The request's HipConfig: the preset with `--hip-refresh`'s intervals, `--hip-strides`'
    query strides, `--hip-exact`'s chunk and `--hip-stage0`'s group where given (ConfigError
    where the strides do not fit the preset's stages)."""
    config = hip_config(preset, options.get("hip_refresh"))
    strides = options.get("hip_strides")
    if strides is not None:
        config = replace(config, query_strides=tuple(int(v) for v in str(strides).split("/")))
    if options.get("hip_align_window"):
        config = replace(config, align_window=True)
    exact = options.get("hip_exact")
    if exact is not None:
        config = replace(config, exact_chunk=int(exact))
    stage0 = options.get("hip_stage0")
    if stage0 is not None:
        config = replace(config, stage0_block_q=int(stage0))
    marks = options.get("hip_landmarks")
    if marks:
        config = replace(config, stage0_landmarks=True, prompt_landmarks=marks == "all")
    return config


def _probes(text: str) -> bool:
    if text not in ("on", "off"):
        raise ConfigError(f"--hip-probes takes on or off, got {text!r}")
    return text == "on"


def _align(text: str) -> bool:
    if text not in ("on", "off"):
        raise ConfigError(f"--hip-align-window takes on or off, got {text!r}")
    return text == "on"


# `--hip-host-keys auto` (the default) reads stage-0 keys from the host from this context on, over
# a full-precision host tier. H200, the same machine start, Llama-3.1-8B shapes through the CLI
# under 24 GiB: 0.85x streaming's decode rate at 128K (`hip_cli_speed_128k_host_keys.json`: the
# misses' small fetches cost more than the halved bytes save), 1.56x at 512K
# (`hip_cli_speed_512k_hip_host_keys_ab.json` beside `hip_cli_speed_512k_hip_slab.json`); a
# straight line through the two crosses near 180K. A quantized tier's rows hold keys and values
# together, so host keys scored on every key would read more than streaming the packed slice
# (693 MB against ~540 MB a 4-head int4 slice at 1M, CPU count:
# `hip_decode_profile_cpu_1m_lean_int4_host_keys.json`): auto leaves them off there, unless
# stage 0 reads its probes alone (`--hip-probes on`: 173 MB, of it ~140 the block cache's fetch,
# `hip_decode_profile_cpu_1m_lean_int4_probes.json`), which also lets the plan give the freed
# staging memory to block caches that cover a refresh interval.
HOST_KEYS_FROM = 256 * 1024


def host_keys(options: Mapping[str, Any], context: int | None) -> bool:
    """Whether stage-0 reruns read host keys (`HipConfig.host_scoring`) for a request of
    `context` tokens (None: not known): as asked, or under auto from `HOST_KEYS_FROM` tokens on
    a full-precision host tier, or on a quantized one with probe scoring. The plan and the
    kernel both ask, with the same context."""
    asked = options.get("hip_host_keys")
    if asked is not None:
        return bool(asked)
    tier_ok = options.get("kv_quant") is None or bool(options.get("hip_probes"))
    return context is not None and context >= HOST_KEYS_FROM and tier_ok


def _plan(inputs: PlanInputs, options: Mapping[str, Any], plan_with: PlanWith) -> Placement:
    """HiP's slicing and chunk search (`kvtier.sparse.planning.plan_hip`): whole layers first when
    the `auto` policy has no group given, with the largest block cache that fits."""
    preset = resolve_preset(str(options["hip_preset"]), inputs.cfg, inputs.context)
    config = _config(options, preset)

    def plan_at(config: HipConfig, chunk_size: int | None) -> HipPlacement:
        return plan_hip(
            inputs.cfg,
            inputs.context,
            plan_with,
            gpu_budget=inputs.gpu_budget,
            preset=config,
            dtype_bytes=inputs.dtype_bytes,
            layers_first=inputs.kv == "auto" and inputs.head_group is None,
            chunk_size=chunk_size,
            hardware=inputs.hardware,
            staging_idle_in_decode=host_keys(options, inputs.context) and inputs.staging_freed_in_decode,
        )

    hip = plan_at(config, inputs.chunk_size)
    if inputs.gpu_budget is not None:  # room left on a GPU that holds every slice: whole-chunk pruning
        chunk = hip.plan.chunk_size
        hip, config = whole_chunk_pruning(
            inputs.cfg, inputs.context, hip, config, inputs.dtype_bytes, lambda c: plan_at(c, chunk)
        )
    # What the kernel allocates from the store's memory when that is a server's lent pages
    # (`HipKernel.place_caches`): the RoPE table, then each slice's decode rows and, for one
    # attended through staging, its block cache, in slice order (the store places slices as
    # `place_slices` does; a packed cache stages its device-resident slices too).
    plan = hip.plan
    places = place_slices(plan.num_slices, plan.resident_slices, frozenset(), packing=plan.packed is not None)
    streamed = set(places.staged)
    buffers = hip_method_buffers(
        inputs.cfg,
        replace(config, cache_tokens=hip.cache_tokens),
        plan.group_size,
        inputs.dtype_bytes,
        inputs.context,
        [s in streamed for s in range(plan.num_slices)],
    )
    return Placement(
        plan, hip.cache_tokens, hip.reserve_bytes, method_buffers=buffers, prune_bytes=config.prune_bytes
    )


def _exact_at(options: Mapping[str, Any], cfg: ModelConfig, context: int) -> bool:
    """Whether the preset a request of `context` tokens resolves to keeps every key there
    (`HipConfig.exact_tokens`: 3,328 tokens for `fast` and `lean`)."""
    preset = resolve_preset(str(options["hip_preset"]), cfg, context)
    return context <= _config(options, preset).exact_tokens


def _build(ctx: BuildContext) -> PolicyParts:
    asked = str(ctx.options["hip_preset"])
    preset = resolve_preset(asked, ctx.cfg, ctx.context)
    refresh = ctx.options.get("hip_refresh")
    hip = _config(ctx.options, preset)
    on_host = host_keys(ctx.options, ctx.context)
    kernel, unrotated = make_hip_kernel(
        ctx.cfg,
        ctx.device,
        preset,
        capacity=ctx.context,
        cache_tokens=ctx.hip_cache_tokens,
        refresh=hip.refresh,
        host_scoring=on_host,
        probe_scoring=bool(ctx.options.get("hip_probes")),
        prune_bytes=ctx.hip_prune_bytes,
        query_strides=hip.query_strides,
        align_window=hip.align_window,
        exact_chunk=hip.exact_chunk,
        stage0_block_q=hip.stage0_block_q,
        stage0_landmarks=hip.stage0_landmarks,
        prompt_landmarks=hip.prompt_landmarks,
    )
    cache = "" if ctx.hip_cache_tokens is None else f", block cache {ctx.hip_cache_tokens} tokens/slice"
    if ctx.hip_cache_tokens in SMALL_CACHE_TOKEN_STEPS:
        cache += " (a stopgap: steps fetch what it misses)"
    auto = f" ({AUTO_PRESET})" if asked == AUTO_PRESET else ""
    every = "" if refresh is None else f", refresh {refresh}"
    strides = ctx.options.get("hip_strides")
    every += "" if strides is None else f", query strides {strides}"
    every += ", window at stage-0 chunks" if hip.align_window else ""
    every += f", chunks of up to {hip.exact_chunk} tokens scored on every key" if hip.exact_chunk else ""
    every += f", stage 0 once per {hip.stage0_block_q} queries" if hip.stage0_block_q else ""
    every += ", stage 0 on landmark keys" if hip.stage0_landmarks else ""
    every += " (its last token's too)" if hip.prompt_landmarks else ""
    keys = ", stage 0 on host keys" if on_host else ""
    keys += ", stage 0 on its probes" if ctx.options.get("hip_probes") else ""
    describe = f"hip {preset}{auto}{every}{cache}{keys}"
    return PolicyParts(kernel=kernel, rotate_keys=not unrotated, describe=describe)


HIP = register(
    MethodEntry(
        "hip",
        "attention",
        "InfiniteHiP-style sparse attention (chunk pruning + block-sparse attention), extends context",
        _build,
        takes=(
            "hip_preset",
            "hip_refresh",
            "hip_host_keys",
            "hip_probes",
            "hip_strides",
            "hip_align_window",
            "hip_exact",
            "hip_stage0",
            "hip_landmarks",
        ),
        plan=_plan,
        composes_with=("kv_quant",),
        borrows_pages=True,  # block caches, decode buffers, RoPE table: its reserve_bytes
        exact_at=_exact_at,
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
        + ", or as a list such as 64/8/4 (default: the preset's; the first interval is stage 0's, "
        "which reads every key of an offloaded slice). Longer intervals decode faster and follow "
        "the context less closely: measure with bench/hip_decode_fidelity.py",
    ),
    Option(
        "hip_host_keys",
        "--hip-host-keys",
        _on_off,
        "on: a decode step that reruns HiP's stage 0 on an offloaded slice reads the slice's "
        "keys from host memory (half the bytes of streaming it whole) and the rest through the "
        "block cache; same output. auto (the default): on from 256K tokens without --kv-quant, "
        "or with it and --hip-probes on (H200: 1.56x streaming's decode rate at 512K, 0.85x at 128K)",
    ),
    Option(
        "hip_strides",
        "--hip-strides",
        _strides,
        "queries mean-pooled per score in each of HiP's pruning stages, joined by '/' (default: "
        "the preset's, 4/4/1): pooling the last stage's queries (4/4/2) halves what it scores, a "
        "lossy speed-up to measure on `kvtier eval` before use",
    ),
    Option(
        "hip_probes",
        "--hip-probes",
        _probes,
        "on (CUDA, experimental): a decode step that runs HiP's stage 0 scores only the keys its "
        "bisection probes, with the prefill's Triton kernel; with host keys it reads them in place "
        "from pinned host memory (full-precision or KIVI rows), ~1/16 of the keys at 256-token "
        "chunks. Scores sum in another order, so a near-tie may keep another chunk. off: the "
        "default, until measured on a GPU",
    ),
    Option(
        "hip_align_window",
        "--hip-align-window",
        _align,
        "on (experimental): decode's recent-token window starts at a stage-0 chunk boundary, so "
        "stage 0 scores whole chunks and every selection of a stage has one size (fewer host "
        "syncs; a layer's decode graphs never decline for sizes); up to a chunk (256 tokens) "
        "more recent tokens attended, a different lossy output. off: the default, until its "
        "speed and NIAH are measured on a GPU",
    ),
    Option(
        "hip_exact",
        "--hip-exact",
        _exact,
        "N (experimental): HiP's prefill scores the pruning stages of chunks of up to N tokens "
        "(8: lean's last stage) on every key of a chunk, one tensor-core product a tile, instead "
        "of the bisection's probes; each chunk's true maximum, so another selection (H100, "
        "SmolLM2 16K: 1.27x lean's prefill, RULER 35.5 against 34.7). off: the default, until "
        "its 512K speed is measured chunk by chunk",
    ),
    Option(
        "hip_stage0",
        "--hip-stage0",
        _stage0,
        "N (experimental): HiP's prefill runs its first pruning stage, whose key reads grow with "
        "the context, once per N queries (a multiple of 64; 256: once per 4 query blocks), the "
        "later stages per block; a block past a group's first never takes the last few hundred "
        "tokens before its window as candidates, so another selection (H100, 512K: fast 1.07x). "
        "off: the default, until RULER runs with it",
    ),
    Option(
        "hip_landmarks",
        "--hip-landmarks",
        _landmarks,
        "on (experimental): HiP's prefill scores its first pruning stage on one landmark key a "
        "chunk, the key the next 512 queries attended most when its chunk was prefilled "
        "(hip-attention's later scan stage), in one dense product instead of a bisection per "
        "query block; another selection. all: the prompt's last token's too (its step reads "
        "landmark rows, not every key; found fewer needles). off: the default, until scored on RULER",
    ),
)
