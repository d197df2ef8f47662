"""`kvtier plan`'s report: the method table, max contexts, the recommended plan and its roofline."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvtier.config import ModelConfig
from kvtier.errors import CapacityError
from kvtier.planner.cpu_split import decode_step_s, split_rates
from kvtier.planner.hardware import Hardware
from kvtier.planner.inputs import PlanInputs
from kvtier.planner.memory import GPU_RESERVE_BYTES
from kvtier.planner.methods import METHODS, PAPER_CHUNK, MethodMemory, max_context, method_memory
from kvtier.planner.packed import PackedFormat
from kvtier.planner.placement import KVPlan
from kvtier.planner.roofline import (
    StepTime,
    decode_intensity,
    decode_time,
    min_compute_bound_chunk,
    prefill_intensity,
    prefill_time,
)

GiB = 1024**3


@dataclass(frozen=True)
class PlanRequest:
    """What `kvtier plan` was asked. Budgets in bytes; chunk_size None = roofline default."""

    cfg: ModelConfig
    model: str
    context: int
    gpu_budget: int
    host_budget: int
    disk_budget: int
    dtype_bytes: int
    hardware: Hardware
    chunk_size: int | None = None
    group_size: int | None = None
    policy: str = "auto"
    block_size: int = 256
    activation_model: str = "runner"
    cpu_attention: str | int = "auto"

    def inputs(self, context: int | None = None, cpu_attention: str | int | None = None) -> PlanInputs:
        """`plan_for`'s inputs for this request at `context` (default: the asked one); the disk
        extends the host tier."""
        return PlanInputs(
            self.cfg,
            self.context if context is None else context,
            hardware=self.hardware,
            dtype_bytes=self.dtype_bytes,
            gpu_budget=self.gpu_budget,
            host_budget=self.host_budget + self.disk_budget,
            kv=self.policy,
            head_group=self.group_size,
            chunk_size=self.chunk_size,
            block_size=self.block_size,
            cpu_attention=self.cpu_attention if cpu_attention is None else cpu_attention,
        )

    def plan(self, context: int, codec: PackedFormat | None = None) -> KVPlan:
        """kvtier's lossless plan at `context` with these budgets (`codec`: sized packed)."""
        return self.inputs(context).plan(codec)

    def fits(self, context: int) -> KVPlan:
        """The plan at `context` without choosing CPU slices (which do not change what fits)."""
        return self.inputs(context, cpu_attention="off").plan()

    @property
    def baseline_chunk(self) -> int:
        """Prefill chunk of the paper's chunked baselines: --chunk-size, else the paper's 10K."""
        return self.chunk_size or PAPER_CHUNK


@dataclass(frozen=True)
class PlanReport:
    """Everything `kvtier plan` prints. `plan` is None when the context fits nowhere (`error` says why)."""

    request: PlanRequest
    rows: dict[str, MethodMemory]  # the baselines, and "auto" when there is a plan
    max_contexts: dict[str, int]
    plan: KVPlan | None
    error: str | None
    decode: StepTime | None
    prefill_s: float | None
    cpu: dict[str, Any] | None = None  # `cpu_report`: the CPU-attention split


def build_report(req: PlanRequest) -> PlanReport:
    """Compute the table, every method's max context and kvtier's plan for `req`."""
    cfg, ctx, b = req.cfg, req.context, req.dtype_bytes
    rows = {
        m: method_memory(
            cfg, m, ctx, dtype_bytes=b, chunk=req.baseline_chunk, activation_model=req.activation_model
        )
        for m in METHODS[:-1]
    }
    plan_for: Callable[[int], KVPlan] = functools.lru_cache(maxsize=None)(req.fits)
    max_contexts = {
        m: max_context(
            cfg,
            m,
            gpu_budget=req.gpu_budget,
            host_budget=req.host_budget,
            dtype_bytes=b,
            chunk=req.baseline_chunk,
            activation_model=req.activation_model,
            plan_for=plan_for,
        )
        for m in METHODS
    }
    try:
        plan: KVPlan | None = req.plan(ctx)
    except CapacityError as e:
        longest = max_contexts["auto"]
        hint = f"the longest context that fits is {longest:,} tokens" if longest else "no context fits"
        return PlanReport(req, rows, max_contexts, None, f"{e} ({hint})", None, None)
    assert plan is not None
    rows["auto"] = method_memory(cfg, "auto", ctx, dtype_bytes=b, plan=plan)
    hw, cpu_s = req.hardware, 0.0
    rates = split_rates(hw) if plan.cpu_slices else None
    if rates is not None:  # the link and the CPU at their rates while both read host memory
        hw = replace(hw, pcie_bw=rates.pcie_bw)
        cpu_s = plan.cpu_slices * ctx * plan.slice_token_bytes / rates.cpu_bw
    decode = decode_time(
        cfg,
        ctx,
        hw,
        b,
        pcie_bytes=plan.pcie_bytes_per_decode_token,
        streamed_pieces=(plan.streamed_slices - plan.cpu_slices) * plan.blocks_per_slice + plan.cpu_slices,
        cpu_s=cpu_s,
    )
    streamed_fraction = plan.streamed_slices / plan.num_slices if plan.num_slices else 0.0
    prefill = prefill_time(cfg, ctx, plan.chunk_size, req.hardware, b, streamed_fraction)
    return PlanReport(req, rows, max_contexts, plan, None, decode, prefill, cpu_report(req, plan))


def cpu_report(req: PlanRequest, plan: KVPlan) -> dict[str, Any] | None:
    """The CPU-attention split of a streaming plan: slices, rates and the simulated decode step
    with and without it (None when nothing is streamed)."""
    if plan.streamed_slices == 0:
        return None
    hw, shape = req.hardware, plan.slice_shape(req.cfg)
    rates = split_rates(hw)
    return {
        "mode": req.cpu_attention,
        "cpu_slices": plan.cpu_slices,
        "streamed_slices": plan.streamed_slices,
        "cpu_attention_gb_s": hw.cpu_attention_bw / 1e9,
        "contention": None if rates is None else rates.contention,
        "pcie_gb_s_while_split": None if rates is None else rates.pcie_bw / 1e9,
        "cpu_gb_s_while_split": None if rates is None else rates.cpu_bw / 1e9,
        "decode_s_link_only": decode_step_s(req.cfg, shape, hw, req.dtype_bytes, 0),
        "decode_s_split": decode_step_s(req.cfg, shape, hw, req.dtype_bytes, plan.cpu_slices),
    }


def report_json(rep: PlanReport) -> dict[str, Any]:
    """The `--json` document; sizes in GB = 1e9 bytes."""
    methods = {
        name: {
            "weights_gb": _gb(r.weights),
            "kv_gpu_gb": _gb(r.kv_gpu),
            "activations_gb": _gb(r.activations),
            "total_gpu_gb": _gb(r.total_gpu),
            "kv_total_gb": _gb(r.kv_total),
            "max_context": rep.max_contexts[name],
        }
        for name, r in rep.rows.items()
    }
    req, plan = rep.request, rep.plan
    recommended: dict[str, Any] | None = None
    if plan is not None and rep.decode is not None:
        disk = max(plan.host_kv_bytes - req.host_budget, 0)
        recommended = {
            "policy": plan.policy,
            "group_size": plan.group_size,
            "num_groups": plan.num_groups(req.cfg),
            "resident_slices": plan.resident_slices,
            "num_slices": plan.num_slices,
            "chunk_size": plan.chunk_size,
            "staging_buffers": plan.staging_buffers,
            "staging_tokens": plan.staging_tokens,
            "window_slices": plan.window_slices,
            "window_tokens": plan.window_tokens,
            "window_kv_gb": _gb(plan.window_kv_bytes),
            "block_size": req.block_size,
            "gpu_kv_gb": _gb(plan.gpu_kv_bytes),
            "host_kv_gb": _gb(plan.host_kv_bytes - disk),
            "disk_kv_gb": _gb(disk),
            "pcie_gb_per_decode_token": _gb(plan.pcie_bytes_per_decode_token),
            "decode_s_per_token": rep.decode.total_s,
            "decode_bound": rep.decode.bound,
            "prefill_s": rep.prefill_s,
            "max_context": rep.max_contexts["auto"],
            "cpu_slices": plan.cpu_slices,
            "cpu_attention": rep.cpu,
        }
    hw = req.hardware
    chunk = plan.chunk_size if plan else req.baseline_chunk
    return {
        "model": req.model,
        "context": req.context,
        "units": "GB = 1e9 bytes",
        "activation_model": req.activation_model,
        "gpu_reserve_gb": _gb(GPU_RESERVE_BYTES),
        "methods": methods,
        "recommended": recommended,
        "error": rep.error,
        "roofline": {
            "gpu": hw.name,
            "tflops": hw.flops / 1e12,
            "hbm_gb_per_s": hw.hbm_bw / 1e9,
            "pcie_gb_per_s": hw.pcie_bw / 1e9,
            "pcie_ridge_flop_per_byte": hw.pcie_ridge,
            "prefill_chunk": chunk,
            "prefill_flop_per_pcie_byte": _finite(
                prefill_intensity(req.cfg, chunk, req.context, req.dtype_bytes)
            ),
            "min_compute_bound_chunk": min_compute_bound_chunk(req.cfg, req.context, hw, req.dtype_bytes),
            "decode_flop_per_byte": decode_intensity(req.cfg, req.context, req.dtype_bytes),
        },
    }


def format_report(rep: PlanReport) -> str:
    """The plain-text report: aligned table (GiB, as the paper), recommendation, roofline."""
    req, doc = rep.request, report_json(rep)
    disk = f", disk {_gib(req.disk_budget)}" if req.disk_budget else ""
    header = ("method", "weights", "KV GPU", "activ.", "GPU tot", "KV tot")
    lines = [
        f"{req.model}: {req.context:,} tokens, GPU {_gib(req.gpu_budget)}, "
        f"host {_gib(req.host_budget)}{disk}, {req.dtype_bytes}-byte dtype, "
        f"activations: {req.activation_model} model",
        "",
        f"{header[0]:<9}" + "".join(f"{h:>9}" for h in header[1:]) + f"{'max context':>15}",
    ]
    for name, r in rep.rows.items():
        cells = (r.weights, r.kv_gpu, r.activations, r.total_gpu, r.kv_total)
        lines.append(
            f"{name:<9}" + "".join(f"{c / GiB:9.3f}" for c in cells) + f"{rep.max_contexts[name]:>15,}"
        )
    if "auto" not in rep.rows:
        lines.append(f"{'auto':<9}{'(does not fit)':>45}{rep.max_contexts['auto']:>15,}")
    reserve = _gib(GPU_RESERVE_BYTES)
    lines += [f"GiB = 2^30 B (the paper's 'GB'); GPU totals exclude the {reserve} CUDA reserve", ""]
    rec = doc["recommended"]
    if rec is None:
        lines.append(f"recommended: none — {rep.error}")
    else:
        groups = f"{rec['num_groups']} group(s) of {rec['group_size']} KV head(s) per layer"
        kv = f"KV {rec['gpu_kv_gb']:.2f} GB GPU, {rec['host_kv_gb']:.2f} GB host"
        kv += f", {rec['disk_kv_gb']:.2f} GB disk"
        lines += [
            f"recommended: policy {rec['policy']}, {groups}, "
            f"{rec['resident_slices']}/{rec['num_slices']} slices resident, chunk {rec['chunk_size']:,}",
            f"  staging: {rec['staging_buffers']} buffer(s) x {rec['staging_tokens']:,} tokens; {kv}",
            *(
                [
                    f"  windowed layers: {rec['window_slices']} slices resident, {rec['window_tokens']:,} "
                    f"tokens each (window + chunk), {rec['window_kv_gb']:.2f} GB of the GPU KV"
                ]
                if rec["window_slices"]
                else []
            ),
            f"  decode: {rec['pcie_gb_per_decode_token']:.3f} GB over PCIe per token, "
            f"~{rec['decode_s_per_token']:.4g} s/token ({rec['decode_bound']}-bound); "
            f"prefill ~{rec['prefill_s']:.4g} s",
        ]
        if rep.cpu is not None:
            lines.append(_cpu_line(rep.cpu))
    roof = doc["roofline"]
    lines += [
        "",
        f"roofline {roof['gpu']}: {roof['tflops']:.0f} TFLOP/s, HBM {roof['hbm_gb_per_s']:.0f} GB/s, "
        f"PCIe {roof['pcie_gb_per_s']:.1f} GB/s -> ridge "
        f"{roof['pcie_ridge_flop_per_byte']:.0f} FLOP/PCIe byte",
        f"  prefill chunk {roof['prefill_chunk']:,} at {req.context:,}: "
        + (
            "no KV crosses PCIe"
            if roof["prefill_flop_per_pcie_byte"] is None
            else f"{roof['prefill_flop_per_pcie_byte']:.0f} FLOP/B"
        )
        + "; smallest compute-bound chunk "
        f"{roof['min_compute_bound_chunk']:,}",
        f"  decode: {roof['decode_flop_per_byte']:.2f} FLOP/B read (memory-bound)",
    ]
    return "\n".join(lines)


def _cpu_line(cpu: dict[str, Any]) -> str:
    head = (
        f"  cpu attention ({cpu['mode']}): {cpu['cpu_slices']}/{cpu['streamed_slices']} streamed "
        "slices on the CPU at decode"
    )
    if cpu["contention"] is None:
        return head + " (CPU attention rate unknown: give --cpu-attention-bw)"
    return (
        f"{head}; CPU {cpu['cpu_attention_gb_s']:.1f} GB/s alone, while splitting link "
        f"{cpu['pcie_gb_s_while_split']:.1f} + CPU {cpu['cpu_gb_s_while_split']:.1f} GB/s "
        f"(contention: {cpu['contention']}); simulated decode {cpu['decode_s_split']:.4g} s/token "
        f"(link only {cpu['decode_s_link_only']:.4g})"
    )


def _finite(x: float) -> float | None:
    """x, or None where it is infinite (JSON has no infinity)."""
    return None if math.isinf(x) else x


def _gb(n: float) -> float:
    return round(n / 1e9, 4)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
