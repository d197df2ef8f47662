"""`kvtier plan`'s report: the method table, max contexts, the recommended plan and its roofline."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.config import ModelConfig
from kvtier.errors import CapacityError
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

    def inputs(self, context: int | None = None) -> PlanInputs:
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
        )

    def plan(self, context: int, codec: PackedFormat | None = None) -> KVPlan:
        """kvtier's lossless plan at `context` with these budgets (`codec`: sized packed)."""
        return self.inputs(context).plan(codec)

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


def build_report(req: PlanRequest) -> PlanReport:
    """Compute the table, every method's max context and kvtier's plan for `req`."""
    cfg, ctx, b = req.cfg, req.context, req.dtype_bytes
    rows = {
        m: method_memory(
            cfg, m, ctx, dtype_bytes=b, chunk=req.baseline_chunk, activation_model=req.activation_model
        )
        for m in METHODS[:-1]
    }
    plan_for: Callable[[int], KVPlan] = functools.lru_cache(maxsize=None)(req.plan)
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
        plan: KVPlan | None = plan_for(ctx)
    except CapacityError as e:
        longest = max_contexts["auto"]
        hint = f"the longest context that fits is {longest:,} tokens" if longest else "no context fits"
        return PlanReport(req, rows, max_contexts, None, f"{e} ({hint})", None, None)
    assert plan is not None
    rows["auto"] = method_memory(cfg, "auto", ctx, dtype_bytes=b, plan=plan)
    decode = decode_time(
        cfg,
        ctx,
        req.hardware,
        b,
        pcie_bytes=plan.pcie_bytes_per_decode_token,
        streamed_pieces=plan.streamed_slices * plan.blocks_per_slice,
    )
    streamed_fraction = plan.streamed_slices / plan.num_slices
    prefill = prefill_time(cfg, ctx, plan.chunk_size, req.hardware, b, streamed_fraction)
    return PlanReport(req, rows, max_contexts, plan, None, decode, prefill)


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
            "block_size": req.block_size,
            "gpu_kv_gb": _gb(plan.gpu_kv_bytes),
            "host_kv_gb": _gb(plan.host_kv_bytes - disk),
            "disk_kv_gb": _gb(disk),
            "pcie_gb_per_decode_token": _gb(plan.pcie_bytes_per_decode_token),
            "decode_s_per_token": rep.decode.total_s,
            "decode_bound": rep.decode.bound,
            "prefill_s": rep.prefill_s,
            "max_context": rep.max_contexts["auto"],
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
            "prefill_flop_per_pcie_byte": prefill_intensity(req.cfg, chunk, req.context, req.dtype_bytes),
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
            f"  decode: {rec['pcie_gb_per_decode_token']:.3f} GB over PCIe per token, "
            f"~{rec['decode_s_per_token']:.4g} s/token ({rec['decode_bound']}-bound); "
            f"prefill ~{rec['prefill_s']:.4g} s",
        ]
    roof = doc["roofline"]
    lines += [
        "",
        f"roofline {roof['gpu']}: {roof['tflops']:.0f} TFLOP/s, HBM {roof['hbm_gb_per_s']:.0f} GB/s, "
        f"PCIe {roof['pcie_gb_per_s']:.1f} GB/s -> ridge "
        f"{roof['pcie_ridge_flop_per_byte']:.0f} FLOP/PCIe byte",
        f"  prefill chunk {roof['prefill_chunk']:,} at {req.context:,}: "
        f"{roof['prefill_flop_per_pcie_byte']:.0f} FLOP/B; smallest compute-bound chunk "
        f"{roof['min_compute_bound_chunk']:,}",
        f"  decode: {roof['decode_flop_per_byte']:.2f} FLOP/B read (memory-bound)",
    ]
    return "\n".join(lines)


def _gb(n: float) -> float:
    return round(n / 1e9, 4)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
