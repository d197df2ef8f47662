"""`kvtier plan --kv-quant / --head-sparsity / --attention hip`: the plan under an opt-in method,
beside the lossless one (which it may fit where lossless does not)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvtier.errors import CapacityError, ConfigError
from kvtier.methods import MethodChoice, plan_for
from kvtier.methods.duo import DUO_RECENT, DUO_SINKS
from kvtier.methods.hip import host_keys as uses_host_keys
from kvtier.planner.memory import round_up
from kvtier.planner.placement import KVPlan
from kvtier.planner.report import PlanRequest
from kvtier.sparse import hip_config, resolve_preset


def lossy_lines(
    req: PlanRequest, plan: KVPlan | None, kv_quant: str | None, head_sparsity: float | None
) -> dict[str, Any] | None:
    """The plan's bytes under `--kv-quant` / `--head-sparsity` (None when neither is given).
    `plan` is the lossless plan (None when it does not fit: a packed cache may still)."""
    if kv_quant is None and head_sparsity is None:
        return None
    if kv_quant is not None and head_sparsity is not None:
        raise ConfigError("--kv-quant and --head-sparsity cannot be combined yet: plan one at a time")
    from kvtier.planner.lossy import lossy_kv

    cfg, ctx, b = req.cfg, req.context, req.dtype_bytes
    base = lossy_kv(cfg, plan, ctx, dtype_bytes=b) if plan is not None else None
    if kv_quant is not None:
        # Planned again, packed: the same budget keeps more slices resident.
        choice = MethodChoice(kv=req.policy, head_group=req.group_size, kv_quant=kv_quant)
        plan = plan_for(req.inputs(), choice).plan
        codec = choice.codec()
        method, got = f"--kv-quant {kv_quant}", lossy_kv(cfg, plan, ctx, dtype_bytes=b, codec=codec)
    else:
        assert head_sparsity is not None
        if not 0.0 < head_sparsity < 1.0:
            raise ConfigError(f"--head-sparsity must be a fraction between 0 and 1, got {head_sparsity}")
        # Planned again: the streaming heads' slices stay compact on the GPU, only the others are
        # placed, so the host tier holds just the retrieval heads' KV.
        choice = MethodChoice(kv=req.policy, head_group=req.group_size, head_sparsity=head_sparsity)
        plan = plan_for(req.inputs(), choice).plan
        method = f"--head-sparsity {head_sparsity:g}"
        kept = DUO_SINKS + DUO_RECENT
        got = lossy_kv(cfg, plan, ctx, dtype_bytes=b, evicted_slices=plan.compact_slices, kept_tokens=kept)
    split_s = None
    if plan.cpu_slices and kv_quant is not None:  # the CPU attends packed rows at its packed rate
        from kvtier.attention.row_formats import native_row_format
        from kvtier.planner.cpu_split import decode_step_s

        packed_hw = req.hardware.over_packed(native_row_format(codec))
        if plan.unpack_scratches == 2:  # packed loads unpack off the link's stream
            packed_hw = replace(packed_hw, unpack_bw=0.0)
        split_s = decode_step_s(cfg, plan.slice_shape(cfg), packed_hw, b, plan.cpu_slices)
    return {
        "method": method,
        "resident_slices": plan.resident_slices,
        "num_slices": plan.num_slices,
        "cpu_slices": plan.cpu_slices,
        "streamed_slices": plan.streamed_slices,
        # packed loads unpack on a stream of their own (a second row scratch: `KVPlan.unpack_scratches`)
        "unpack_stream": plan.packed is not None and plan.unpack_scratches == 2,
        "simulated_split_decode_s": split_s,
        "gpu_kv_with_staging_gb": plan.gpu_kv_bytes / 1e9,
        "gpu_kv_gb": got.gpu_stored / 1e9,
        "host_kv_gb": got.host_stored / 1e9,
        "pcie_gb_per_token": got.pcie_per_decode / 1e9,
        "lossless_pcie_gb_per_token": None if base is None else base.pcie_per_decode / 1e9,
        "decode_floor_s": got.pcie_per_decode / req.hardware.pcie_bw,
    }


def hip_lines(
    req: PlanRequest,
    attention: str,
    preset: str,
    kv_quant: str | None = None,
    head_sparsity: float | None = None,
    refresh: str | None = None,
    host_keys: bool | None = None,
    probes: bool = False,
    strides: str | None = None,
) -> dict[str, Any] | None:
    """The plan under a sparse attention method with a planner hook (None for dense), over
    `kv_quant`'s packed KV when given (`refresh`: HiP's decode refresh intervals by name, None:
    the preset's; `host_keys`: `--hip-host-keys`, None: auto; `probes`: `--hip-probes on`;
    `strides`: `--hip-strides`, None: the preset's):
    slices, block cache per offloaded slice, the method's GPU bytes, host KV and its prefill
    chunk. A method it does not combine with is a ConfigError."""
    if attention != "hip":
        given = {"--hip-host-keys": host_keys is not None, "--hip-probes": probes, "--hip-strides": strides}
        for flag, asked in given.items():
            if asked:
                raise ConfigError(f"{flag} applies only with --attention hip")
        return None
    choice = MethodChoice(
        kv=req.policy,
        head_group=req.group_size,
        attention=attention,
        hip_preset=preset,
        hip_refresh=refresh,
        hip_host_keys=host_keys,
        hip_probes=probes,
        hip_strides=strides,
        kv_quant=kv_quant,
        head_sparsity=head_sparsity,
    )
    hip = plan_for(req.inputs(), choice)
    plan = hip.plan
    resolved = resolve_preset(preset, req.cfg, req.context)
    return {
        "preset": resolved,
        "refresh": refresh,
        "strides": strides,
        # HiP's pruning batch where the plan raised it for a whole prefill chunk (None: 256 MiB)
        "prune_mib": None if hip.prune_bytes is None else hip.prune_bytes >> 20,
        # HiP drops nothing up to this many tokens of prompt plus output (`HipConfig.exact_tokens`)
        "exact_tokens": hip_config(resolved, refresh).exact_tokens,
        "runs_lossless": choice.exact_at(req.cfg, req.context),
        "host_keys": attention == "hip" and uses_host_keys(choice.options(), req.context),
        "probes": probes,
        "kv_quant": kv_quant,
        "host_kv_gb": plan.host_kv_bytes / 1e9,
        "group_size": plan.group_size,
        "resident_slices": plan.resident_slices,
        "num_slices": plan.num_slices,
        "per_layer": plan.group_size == req.cfg.num_kv_heads,
        "cache_tokens_per_slice": hip.cache_tokens,
        "hip_gpu_gb": hip.reserve_bytes / 1e9,
        "gpu_kv_with_staging_gb": plan.gpu_kv_bytes / 1e9,
        "chunk_size": plan.chunk_size,
    }


def quest_lines(
    req: PlanRequest, attention: str, budget: int | None, page: int | None, kv_quant: str | None = None
) -> dict[str, Any] | None:
    """The plan under `--attention quest` (None for another attention): the store's plan within
    the budget less Quest's page bounds, which stay on the GPU for every slice past its dense
    layers; a decode step then reads only the pages its heads select (about `budget` tokens a KV
    head), from the host for streamed slices. ConfigError without `--kv-budget`."""
    if attention != "quest":
        if page is not None:
            raise ConfigError("--quest-page applies only with --attention quest")
        return None
    if budget is None:
        raise ConfigError("--attention quest reads --kv-budget tokens a KV head per step: give --kv-budget N")
    if kv_quant is not None:
        raise ConfigError("--attention quest cannot be planned with --kv-quant: one at a time")
    choice = MethodChoice(
        kv=req.policy, head_group=req.group_size, attention="quest", kv_budget=budget, quest_page=page or 16
    )
    placed = plan_for(req.inputs(), choice)
    plan = placed.plan
    return {
        "method": f"--attention quest --kv-budget {budget} --quest-page {choice.quest_page}",
        "resident_slices": plan.resident_slices,
        "num_slices": plan.num_slices,
        "page_bounds_gb": placed.reserve_bytes / 1e9,
        "gpu_kv_with_staging_gb": plan.gpu_kv_bytes / 1e9,
        "host_kv_gb": plan.host_kv_bytes / 1e9,
        "chunk_size": plan.chunk_size,
    }


def format_quest(quest: dict[str, Any]) -> str:
    """`quest_lines` as the plain report prints it."""
    return (
        f"\nwith {quest['method']}: {quest['resident_slices']}/{quest['num_slices']} slices resident, "
        f"page bounds {quest['page_bounds_gb']:.2f} GB on the GPU, GPU KV with staging "
        f"{quest['gpu_kv_with_staging_gb']:.2f} GB, host KV {quest['host_kv_gb']:.2f} GB, prefill "
        f"chunk {quest['chunk_size']:,}; a decode step reads about --kv-budget tokens a KV head"
    )


def format_lossy(lossy: dict[str, Any]) -> str:
    """`lossy_lines` as the plain report prints it."""
    lossless = lossy["lossless_pcie_gb_per_token"]
    return (
        f"\nwith {lossy['method']}: {lossy['resident_slices']}/{lossy['num_slices']} slices "
        f"resident, GPU KV {lossy['gpu_kv_gb']:.2f} GB ({lossy['gpu_kv_with_staging_gb']:.2f} "
        f"with staging), host KV {lossy['host_kv_gb']:.2f} GB, PCIe per decode token "
        f"{lossy['pcie_gb_per_token']:.2f} GB "
        f"({'lossless does not fit' if lossless is None else f'lossless {lossless:.2f} GB'}), "
        f"decode floor {lossy['decode_floor_s']:.3f} s/token"
        + ("; packed loads unpack off the link's stream" if lossy.get("unpack_stream") else "")
        + (
            f"; cpu attention: {lossy['cpu_slices']}/{lossy['streamed_slices']} streamed slices on "
            f"the CPU over packed rows, simulated decode {lossy['simulated_split_decode_s']:.3f} s/token"
            if lossy.get("simulated_split_decode_s") is not None
            else ""
        )
    )


def format_hip(hip: dict[str, Any]) -> str:
    """`hip_lines` as the plain report prints it."""
    cache = hip["cache_tokens_per_slice"]
    selection = "one selection per layer" if hip["per_layer"] else "one selection per slice"
    packed = f" over --kv-quant {hip['kv_quant']}" if hip["kv_quant"] else ""
    refresh = "" if hip["refresh"] is None else f", refresh {hip['refresh']}"
    refresh += "" if hip.get("strides") is None else f", query strides {hip['strides']}"
    keys = ", stage 0 on host keys" if hip["host_keys"] else ""
    keys += (
        " read by probe" if hip["host_keys"] and hip["probes"] else ", probe scoring" if hip["probes"] else ""
    )
    mib = hip.get("prune_mib")
    prune = "" if mib is None else f" ({mib:,} MiB of it to prune a prefill chunk's blocks at once)"
    return (
        f"\nwith --attention hip ({hip['preset']}{refresh}{keys}){packed}: {hip['num_slices']} slices of "
        f"{hip['group_size']} KV heads ({selection}), "
        f"{hip['resident_slices']} resident; block cache per offloaded slice: "
        f"{'a whole refresh interval' if cache is None else f'{cache} tokens'}; prefill chunk "
        f"{hip['chunk_size']:,}; HiP's GPU bytes {hip['hip_gpu_gb']:.2f} GB{prune}, GPU KV with staging "
        f"{hip['gpu_kv_with_staging_gb']:.2f} GB, host KV {hip['host_kv_gb']:.2f} GB; it drops "
        f"nothing up to {hip['exact_tokens']:,} tokens"
        + (": at this context it runs lossless (on CUDA; --exact-lossless)" if hip["runs_lossless"] else "")
    )


def evict_lines(
    req: PlanRequest,
    evict: str | None,
    budget: int | None,
    new_tokens: int | None,
    others: bool = False,
    budget_used: bool = False,
) -> dict[str, Any] | None:
    """The plan under `--evict` with `--kv-budget` (None without --evict): every slice stays on
    the GPU holding what it keeps plus a prefill chunk (`KVPlan.compact_tokens`; SnapKV, which
    evicts in prefill only, plus the `new_tokens` it decodes), nothing on the host or the link.
    `others`: another method is planned beside it (one at a time: a ConfigError);
    `budget_used`: that method took `--kv-budget` (Quest's)."""
    if evict is None:
        if budget is not None and not budget_used:
            raise ConfigError("--kv-budget is the budget of --evict NAME or --attention quest: add one")
        if new_tokens is not None:
            raise ConfigError("--max-new-tokens plans an evictor's new tokens: add --evict NAME")
        return None
    if others:
        raise ConfigError(
            "--evict cannot be planned with --kv-quant, --head-sparsity or --attention: one at a time"
        )
    if budget is None:
        raise ConfigError(f"--evict {evict} keeps --kv-budget tokens a KV head: give --kv-budget N")
    if new_tokens is not None and new_tokens > req.context:
        raise ConfigError(f"--max-new-tokens {new_tokens} is more than --context {req.context}")
    choice = MethodChoice(kv=req.policy, head_group=req.group_size, evict=evict, kv_budget=budget)
    inputs = replace(req.inputs(), new_tokens=new_tokens)
    try:
        plan = plan_for(inputs, choice).plan
    except CapacityError as e:
        if new_tokens is None:
            plan_for(replace(inputs, new_tokens=0), choice)  # NOTE: raises if the tokens are not why
            raise CapacityError(
                f"{e} (--evict {evict} keeps every generated token, and without --max-new-tokens the "
                "plan counts the whole context: give --max-new-tokens N)"
            ) from e
        raise
    return {
        "method": f"--evict {evict} --kv-budget {budget}",
        "max_new_tokens": new_tokens,
        "tokens_per_slice": plan.compact_tokens,
        "keeps_new_tokens": plan.compact_tokens > round_up(budget + plan.chunk_size, req.block_size),
        "num_slices": plan.num_slices,
        "chunk_size": plan.chunk_size,
        "gpu_kv_gb": plan.gpu_kv_bytes / 1e9,
        "host_kv_gb": plan.host_kv_bytes / 1e9,
        "pcie_gb_per_token": plan.pcie_bytes_per_decode_token / 1e9,
    }


def format_evict(evict: dict[str, Any]) -> str:
    """`evict_lines` as the plain report prints it."""
    told = evict["max_new_tokens"]
    new = "" if told is None else f", {told:,} new tokens"
    kept = f"its budget, a {evict['chunk_size']:,}-token chunk"
    kept += " and the new tokens" if evict["keeps_new_tokens"] else ""
    return (
        f"\nwith {evict['method']}{new}: all {evict['num_slices']} slices on the GPU, "
        f"{evict['tokens_per_slice']:,} tokens each ({kept}), "
        f"GPU KV {evict['gpu_kv_gb']:.2f} GB, host KV {evict['host_kv_gb']:.2f} GB, "
        f"PCIe per decode token {evict['pcie_gb_per_token']:.2f} GB"
    )
