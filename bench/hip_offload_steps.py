"""What `bench/hip_offload.py` times over a filled store: greedy decode steps, split into
stage-0 refresh steps and cached steps (HiP), one step of each kind profiled on request, and the
rate of a prefill chunk appended on top of the stored context."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from bench.common import median
from bench.hip_decode_profile import STEP_KINDS, first_due
from bench.profiling import merged_kernels, run_profiled
from kvtier.attention.interface import SliceKernel
from kvtier.kv.store import TieredKVStore
from kvtier.model.llama import CausalLM
from kvtier.sparse import HipKernel


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall time of fn() (GPU work included on CUDA) and its result."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def profiled_step(
    model: CausalLM, store: TieredKVStore, token: torch.Tensor, dev: torch.device
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One greedy decode step under cProfile and (on CUDA) torch.profiler: the next token, and
    the step's profiled wall time, top kernels and cProfile lines."""
    prof = cProfile.Profile()
    kernels: list[Any] = []  # the step's torch.profiler window (CUDA only)
    box: list[torch.Tensor] = []
    cuda = dev.type == "cuda"
    t = time.perf_counter()
    store.begin_step(1)
    run_profiled(lambda: box.append(model(token, store)), prof, kernels if cuda else None, cuda)
    store.end_step()
    wall = time.perf_counter() - t
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    return box[0][-1].argmax().view(1), {
        "wall_s_profiled": round(wall, 4),
        "kernels": merged_kernels(kernels, 20) if kernels else [],
        "cprofile": [x for x in text.getvalue().splitlines() if x.strip()],
    }


def decode(
    model: CausalLM,
    store: TieredKVStore,
    kernel: SliceKernel,
    steps: int,
    dev: torch.device,
    profile: bool = False,
) -> dict[str, Any]:
    """`steps` greedy decode steps from a random token; times split into refresh/cached steps.
    `profile` (HiP): one more refresh interval, its first step of each kind (the first stage it
    reruns, or none) under cProfile and torch.profiler (`profiled_step`; `profiles` in the row)."""
    hip = kernel if isinstance(kernel, HipKernel) else None
    token = torch.tensor([1], device=dev)
    h2d0 = store.account.h2d_bytes
    times: list[float] = []
    refresh: list[bool] = []
    profiles: dict[str, Any] = {}
    for i in range(steps + (hip.cfg.refresh[0] if profile and hip else 0)):
        kind = STEP_KINDS[first_due(i, hip.cfg.refresh)] if hip else "stage0"
        if i >= steps:  # one more refresh interval, a step of each kind profiled
            assert hip is not None
            if kind in profiles:
                store.begin_step(1)
                token = model(token, store)[-1].argmax().view(1)
                store.end_step()
                continue
            token, profiles[kind] = profiled_step(model, store, token, dev)
            profiles[kind]["step"] = i
            continue
        before = hip.stats.decode_recomputes[0] if hip else 0
        store.begin_step(1)
        dt, logits = timed(dev, lambda: model(token, store))
        store.end_step()
        token = logits[-1].argmax().view(1)
        times.append(dt)
        refresh.append(hip is None or hip.stats.decode_recomputes[0] > before)
    ref_t = [t for t, r in zip(times, refresh, strict=True) if r]
    cached_t = [t for t, r in zip(times, refresh, strict=True) if not r]
    out: dict[str, Any] = {
        "decode_s_per_token": statistics.fmean(times),
        "decode_p50_s": median(times),
        "refresh_steps": len(ref_t),
        "refresh_step_s": statistics.fmean(ref_t) if ref_t else None,
        "cached_step_s": statistics.fmean(cached_t) if cached_t else None,
        "h2d_bytes_per_token": (store.account.h2d_bytes - h2d0) / max(1, steps),
        "decode_steps_s": times,
    }
    if profiles:
        out["profiles"] = profiles
    if hip is not None:
        out["hit_rate"] = hip.stats.hit_rate
        out["cache"] = asdict(hip.stats.cache)
        out["gpu_cache_bytes"] = hip.gpu_cache_bytes() + hip.attend_buffer_bytes()
        # One stage-0 refresh per refresh[0] steps: the long-run mean whatever --steps covers.
        r0 = hip.cfg.refresh[0]
        if ref_t and cached_t:
            out["amortized_s_per_token"] = (
                statistics.fmean(ref_t) + (r0 - 1) * statistics.fmean(cached_t)
            ) / r0
    else:
        out["amortized_s_per_token"] = statistics.fmean(times)
    return out


def prefill_chunk(
    model: CausalLM, store: TieredKVStore, chunk: int, vocab: int, dev: torch.device, profile: bool
) -> dict[str, Any]:
    """Tokens/s of a prefill chunk of `chunk` tokens appended on top of the stored context: two
    chunks run, the second is the row's rate (the first may compile Triton kernels for a slicing
    the warm-up did not have). `profile`: the second under torch.profiler, its GPU kernel summary
    added to the row."""
    gen = torch.Generator(device=dev).manual_seed(1)
    none = torch.empty(0, dtype=torch.long, device=dev)
    rates, summary = [], None
    for i in range(2):
        ids = torch.randint(0, vocab, (chunk,), device=dev, generator=gen)
        store.begin_step(chunk)
        if profile and i == 1:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            from bench.prefill_profile import summarize

            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                dt, _ = timed(dev, lambda: model(ids, store, logits_at=none, mlp_chunk=chunk))
            summary = summarize(prof)
        else:
            dt, _ = timed(dev, lambda: model(ids, store, logits_at=none, mlp_chunk=chunk))
        store.end_step()
        rates.append(chunk / dt)
    row: dict[str, Any] = {"prefill_chunk": chunk, "prefill_tok_s": rates[1], "first_chunk_tok_s": rates[0]}
    if summary is not None:
        row["profile"] = summary
    return row
