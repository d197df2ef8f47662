"""GPU and host memory of each KV method at a context, and each method's maximum context.

Methods (the paper's Table 10 rows, plus kvtier's own plan):

    standard  all KV on the GPU, whole prompt in one forward pass
    chunked   all KV on the GPU, chunked prefill
    kv4       4-bit KV on the GPU (scales and zero points not counted, as in the paper)
    layer     layer-wise offload: ping-pong buffers of two layers' KV, whole prompt at once
    head      head-wise offload (HeadInfer): ping-pong buffers of one KV head, chunked prefill
    auto      kvtier: `plan_kv`'s resident slices + staging buffers, chunked prefill

The baseline rows use `activation_model` ("runner": `activation_bytes`, what kvtier's runner
would hold; "paper": `paper_activation_bytes`, which reproduces Table 10). `auto` always uses
the runner model, since that is what the plan was made with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.config import ModelConfig
from kvtier.errors import CapacityError, ConfigError
from kvtier.planner.memory import (
    GPU_RESERVE_BYTES,
    activation_bytes,
    kv_token_bytes,
    paper_activation_bytes,
    weight_bytes,
)
from kvtier.planner.placement import KVPlan

METHODS = ("standard", "chunked", "kv4", "layer", "head", "auto")
ACTIVATION_MODELS = ("runner", "paper")
PAPER_CHUNK = 10240  # the paper's "10K" prefill chunk
MAX_SEARCH_TOKENS = 2**34


@dataclass(frozen=True)
class MethodMemory:
    """Bytes one method needs at one context. `total_gpu` excludes the CUDA reserve (as the paper)."""

    method: str
    context: int
    weights: int
    kv_gpu: int
    activations: int
    kv_total: int  # all KV, wherever it lives
    kv_host: int  # the part of kv_total in host memory

    @property
    def total_gpu(self) -> int:
        return self.weights + self.kv_gpu + self.activations


def method_memory(
    cfg: ModelConfig,
    method: str,
    context: int,
    *,
    dtype_bytes: int = 2,
    chunk: int = PAPER_CHUNK,
    activation_model: str = "runner",
    plan: KVPlan | None = None,
) -> MethodMemory:
    """Memory of `method` at `context` tokens; `chunk` is the prefill chunk of chunked methods.

    For "auto" pass the `KVPlan` made for this context; its chunk and sizes are used.
    """
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    if activation_model not in ACTIVATION_MODELS:
        raise ConfigError(f"unknown activation model {activation_model!r}; use runner or paper")
    kv_all = cfg.kv_bytes(context, dtype_bytes)  # windowed layers: their window
    weights = weight_bytes(cfg, dtype_bytes)
    if method == "auto":
        if plan is None:
            raise ConfigError("method 'auto' needs the KVPlan made by plan_kv")
        act = activation_bytes(cfg, plan.chunk_size, dtype_bytes, group_size=plan.group_size, context=context)
        resident = plan.resident_slices * plan.capacity_tokens * plan.slice_token_bytes + plan.window_kv_bytes
        return MethodMemory(
            method,
            context,
            weights,
            plan.gpu_kv_bytes,
            act,
            resident + plan.host_kv_bytes,
            plan.host_kv_bytes,
        )
    tokens = min(chunk, context) if method in ("chunked", "head") else context
    group = 1 if method == "head" else cfg.num_kv_heads
    if activation_model == "paper":
        act = paper_activation_bytes(cfg, tokens, dtype_bytes)
    else:
        act = activation_bytes(cfg, tokens, dtype_bytes, group_size=group, context=context)
    if method == "kv4":
        return MethodMemory(method, context, weights, kv_all // 4, act, kv_all // 4, 0)
    if method == "layer":
        gpu = 2 * context * kv_token_bytes(cfg, cfg.num_kv_heads, dtype_bytes)
        return MethodMemory(method, context, weights, gpu, act, kv_all, kv_all)
    if method == "head":
        gpu = 2 * context * kv_token_bytes(cfg, 1, dtype_bytes)
        return MethodMemory(method, context, weights, gpu, act, kv_all, kv_all)
    return MethodMemory(method, context, weights, kv_all, act, kv_all, 0)


def max_context(
    cfg: ModelConfig,
    method: str,
    *,
    gpu_budget: int,
    host_budget: int,
    dtype_bytes: int = 2,
    chunk: int = PAPER_CHUNK,
    activation_model: str = "runner",
    reserve_bytes: int = GPU_RESERVE_BYTES,
    plan_for: Callable[[int], KVPlan] | None = None,
) -> int:
    """Largest context (tokens) `method` fits in the budgets; 0 if not even one token fits.

    Baselines need total_gpu + reserve <= gpu_budget and kv_host <= host_budget. For "auto" pass
    `plan_for(context)`, which plans with the same budgets and raises CapacityError when they are
    too small. Binary search: every method's need grows with the context.
    """

    def fits(n: int) -> bool:
        if method == "auto":
            if plan_for is None:
                raise ConfigError("method 'auto' needs plan_for")
            try:
                plan_for(n)
            except CapacityError:
                return False
            return True
        m = method_memory(
            cfg, method, n, dtype_bytes=dtype_bytes, chunk=chunk, activation_model=activation_model
        )
        return m.total_gpu + reserve_bytes <= gpu_budget and m.kv_host <= host_budget

    if not fits(1):
        return 0
    lo, hi = 1, MAX_SEARCH_TOKENS
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
