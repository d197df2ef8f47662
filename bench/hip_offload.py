"""HiP sparse attention over offloaded KV (issue 6 item 4) vs lossless offload, on a CUDA GPU.

llama-3-8b preset (random weights, bf16), GPU capped with set_per_process_memory_fraction. Each
context is filled with structured KV (`--kv-fill`: no repetition, planted needles; runs before
2026-12-03 used one repeated random extent) into a head-wise offloaded store, then `--steps` real
decode steps run per method: "dense" (lossless: every step streams every slice) and HiP presets
(only stage-0 refresh steps stream a slice; the steps between read a GPU block cache). Reported:
mean and p50 decode s/token, refresh-step vs cached-step time, H2D bytes per token, block-cache
hit rate and GPU bytes, peak GPU memory; then prefill tokens/s of one chunk appended at the
largest context (HiP vs dense). A table is printed last; $OUT/hip_offload.json holds the rows.

    python bench/hip_offload.py --contexts 128K,512K,1M --presets fast,flash
    python bench/hip_offload.py --smoke            # CPU, tiny model: proves the script runs
"""

from __future__ import annotations

import os

# HiP's block caches and buffers come and go in many sizes; without expandable segments the
# allocator's fragments alone pushed a 128K run past the 24 GB cap (H200).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KV_FILLS, fill_store, median, write_results
from bench.hip_decode_profile import STEP_KINDS, first_due, merged_kernels, run_profiled
from kvtier.attention.interface import DenseKernel, SliceKernel
from kvtier.config import ModelConfig
from kvtier.errors import CapacityError
from kvtier.kv.store import TieredKVStore
from kvtier.loading.presets import preset_config
from kvtier.loading.weights import random_model
from kvtier.model.llama import CausalLM
from kvtier.planner.hardware import hardware_preset
from kvtier.planner.placement import KVPlan, plan_kv
from kvtier.sparse import HIP_PRESETS, HipConfig, HipKernel, make_hip_kernel
from kvtier.sparse.rope_ext import table_bytes
from kvtier.units import parse_count, parse_size


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall time of fn() (GPU work included on CUDA) and its result."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def hip_config(preset: str, context: int, smoke: bool, cache_tokens: int | None = None) -> HipConfig:
    """The preset's config; in smoke mode shrunk to the context (`HipConfig.scaled`).
    `cache_tokens`: the GPU block cache of a streamed slice (None: a whole refresh interval)."""
    base = HIP_PRESETS[preset]
    if not smoke:
        return replace(base, cache_tokens=cache_tokens)
    return HipConfig.scaled(context, refresh=base.refresh, cache_block=8, cache_tokens=cache_tokens)


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
    choice = MethodChoice(
        attention="hip",
        hip_preset=method.removeprefix("hip-"),
        kv_quant=args.kv_quant,
        hip_host_keys=args.host_scoring,  # as the kernel: with host keys caches take the staging bytes
    )
    placed = plan_for(inputs, choice)
    return placed.plan, placed.cache_tokens


def run_method(
    model: CausalLM, cfg: ModelConfig, method: str, context: int, args: argparse.Namespace, chunk: int
) -> dict[str, Any]:
    """Fill `context` tokens, then run decode steps, or (`chunk` > 0) time one prefill chunk."""
    dev: torch.device = args.device
    steps = 0 if chunk else args.steps if method != "dense" else args.dense_steps
    row: dict[str, Any] = {"method": method, "context": context, "phase": "prefill" if chunk else "decode"}
    row["steps"] = steps
    row["kv_quant"] = args.kv_quant
    args = argparse.Namespace(**{**vars(args), "chunk": chunk})
    total = context + steps + 2 * chunk  # prefill: two chunks, the second timed
    reserve = cache_bytes_estimate(
        cfg, method, context, args.smoke, 2 if dev.type == "cuda" else 4, args.cache_tokens
    )
    cache_tokens = args.cache_tokens
    try:
        if args.policy == "planned" and method != "dense" and not args.smoke:
            plan, cache_tokens = engine_plan(cfg, total, args, method)
        else:
            plan = make_plan(cfg, total, args, reserve)
    except CapacityError as e:
        row["skipped"] = str(e)
        return row
    keys = ("policy", "group_size", "resident_slices", "staging_tokens", "chunk_size")
    row["plan"] = {k: getattr(plan, k) for k in keys}
    row["plan"]["cache_tokens"] = cache_tokens
    if plan.staging_tokens < total and plan.streamed_slices:
        row["skipped"] = f"a slice of {total} tokens does not fit a staging buffer ({plan.staging_tokens})"
        return row
    kernel, unrotated = make_kernel(cfg, method, context, dev, args.smoke, cache_tokens, args.host_scoring)
    row["host_scoring"] = args.host_scoring
    if dev.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    store = None
    try:
        store = TieredKVStore(
            cfg,
            plan,
            device=dev,
            dtype=args.dtype,
            capacity=total,
            kernel=kernel,
            rotate_keys=not unrotated,
            codec=codec_of(args),
        )
        fill_store(store, context, args.kv_fill)
        if steps:
            row.update(decode(model, store, kernel, steps, dev, args.profile_decode))
        if chunk:
            row.update(prefill_chunk(model, store, chunk, cfg.vocab_size, dev, args.profile))
        if dev.type == "cuda":
            row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    except (torch.OutOfMemoryError, CapacityError) as e:
        row["oom" if isinstance(e, torch.OutOfMemoryError) else "skipped"] = str(e).splitlines()[0][:300]
    finally:
        if store is not None:
            store.close()
    return row


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


def print_table(rows: list[dict[str, Any]]) -> None:
    def f(v: Any, scale: float = 1.0, nd: int = 3) -> str:
        return "-" if v is None else f"{v / scale:.{nd}f}"

    print(
        f"{'context':>8} {'method':>10} {'mean s/t':>9} {'amort s/t':>9} {'p50 s/t':>9} {'refresh s':>9} "
        f"{'cached s':>9} "
        f"{'H2D GB/t':>9} {'hit':>6} {'cache GB':>8} {'peak GB':>8}"
    )
    for r in rows:
        if "skipped" in r or "oom" in r:
            why = r.get("skipped", r.get("oom", ""))
            print(f"{r['context']:>8} {r['method']:>10}   {('skipped: ' + why)[:100]}")
            continue
        if r["phase"] == "prefill":
            print(
                f"{r['context']:>8} {r['method']:>10}   prefill chunk of {r['prefill_chunk']} tokens: "
                f"{f(r['prefill_tok_s'], nd=0)} tok/s"
            )
            continue
        print(
            f"{r['context']:>8} {r['method']:>10} {f(r['decode_s_per_token'], nd=4):>9} "
            f"{f(r.get('amortized_s_per_token'), nd=4):>9} {f(r['decode_p50_s'], nd=4):>9} "
            f"{f(r['refresh_step_s'], nd=4):>9} "
            f"{f(r['cached_step_s'], nd=4):>9} "
            f"{f(r['h2d_bytes_per_token'], 1e9):>9} {f(r.get('hit_rate')):>6} "
            f"{f(r.get('gpu_cache_bytes'), 1e9, 2):>8} {f(r.get('peak_gpu_bytes'), 1e9, 2):>8}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="128K,512K")
    ap.add_argument(
        "--presets", default="fast,flash", help='HiP presets (kvtier.sparse.HIP_PRESETS); "": none'
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="HiP decode steps (default: 2 x smallest refresh[0] + 2)"
    )
    ap.add_argument("--dense-steps", type=int, default=4, help="decode steps of lossless offload")
    ap.add_argument("--no-dense", action="store_true", help="skip lossless offload (measured elsewhere)")
    ap.add_argument(
        "--policy",
        default="head",
        choices=("head", "layer", "auto", "planned"),
        help="store slicing: one HiP selection per slice (layer: per layer, as published); "
        "planned: HiP's slices and block cache as the engine plans them",
    )
    ap.add_argument("--head-group", type=int, default=None, help="KV heads per slice (policy head)")
    ap.add_argument(
        "--cache-tokens",
        type=int,
        default=None,
        help="GPU block cache per streamed slice, tokens (default: a whole refresh interval)",
    )
    ap.add_argument("--gpu-memory", default="24GB")
    ap.add_argument(
        "--prefill-chunk",
        default="",
        help="comma-separated chunk sizes: one prefill row each at the largest context (default: none)",
    )
    ap.add_argument("--profile", action="store_true", help="profile the prefill chunks (GPU kernels)")
    ap.add_argument(
        "--profile-decode",
        action="store_true",
        help="HiP: after the timed steps, one step of each kind under cProfile and the GPU profiler",
    )
    ap.add_argument(
        "--kv-fill",
        choices=KV_FILLS,
        default="structured",
        help="the stored context's KV: structured (no repetition, planted needles; default) or "
        "synthetic (one random extent repeated, what runs before 2026-12-03 used)",
    )
    ap.add_argument(
        "--host-scoring",
        action="store_true",
        help="HiP stage-0 decode reruns score keys read from the host (HipConfig.host_scoring)",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random model, small contexts")
    ap.add_argument(
        "--kv-quant",
        default=None,
        choices=("int8", "int4", "fp8"),
        help="pack the KV (both rows: dense becomes the codec alone, HiP runs over it)",
    )
    ap.add_argument("--name", default="hip_offload")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.dtype = torch.device("cpu"), torch.float32
        args.contexts = "1K,2K" if args.contexts == ap.get_default("contexts") else args.contexts
        args.prefill_chunk = ",".join(str(min(int(c), 64)) for c in args.prefill_chunk.split(",") if c)
        args.dense_steps = min(args.dense_steps, 2)
        cfg = preset_config("smollm2-135m")
        cfg = replace(cfg, num_layers=2)  # a CPU-sized model: 2 layers x 3 KV heads
    else:
        args.device, args.dtype = torch.device("cuda"), torch.bfloat16
        args.budget = parse_size(args.gpu_memory)
        torch.cuda.set_per_process_memory_fraction(
            args.budget / torch.cuda.get_device_properties(0).total_memory
        )
        cfg = preset_config("llama-3-8b")
    presets = [p for p in args.presets.split(",") if p]  # "" : lossless offload alone
    if args.steps is None:
        # two stage-0 refreshes of the fastest preset (64 cached steps): keeps 128K + 512K of
        # dense, fast and flash within ~5 minutes on an H200 now that cached steps do not sync
        args.steps = 2 * min((HIP_PRESETS[p].refresh[0] for p in presets), default=16) + 2
        if args.smoke:
            args.steps = min(args.steps, 40)
    contexts = [parse_count(c) for c in args.contexts.split(",")]
    model = random_model(cfg, args.device, args.dtype)
    methods = ([] if args.no_dense else ["dense"]) + [f"hip-{p}" for p in presets]
    rows: list[dict[str, Any]] = []
    header = {
        "gpu_budget_bytes": getattr(args, "budget", None),
        "model": "llama-3-8b" if not args.smoke else "tiny",
        "kv_fill": args.kv_fill,
    }
    chunks = [int(c) for c in args.prefill_chunk.split(",") if c]
    # NOTE: the warm-up decodes as many steps as the timed runs (at most 34: every kind of step of
    # `fast`'s refresh cycle), so stage reruns and block-cache misses compile their Triton kernels
    # here. With 2 steps, 1M's first timed steps paid the host gather's compile (4.69 s, 0.62 s
    # against 2.27, 0.105 before it existed: hip_offload_planned_1m_int4_gather.json).
    warm_steps = max(2, min(args.steps, 34))
    warm = argparse.Namespace(
        **{**vars(args), "steps": warm_steps, "dense_steps": 1, "profile": False, "profile_decode": False}
    )
    for method in methods:  # warm-up: kernels (Triton's compile), allocator; a short context
        run_method(model, cfg, method, min(*contexts, 65536), warm, 0)
        if chunks:
            run_method(model, cfg, method, min(*contexts, 65536), warm, min(chunks))
    runs = [(c, m, 0) for c in contexts for m in methods] if args.steps else []  # --steps 0: prefill only
    # last, so a slow prefill cannot cost the decode results
    runs += [(max(contexts), m, c) for c in chunks for m in methods]
    path = None
    for context, method, chunk in runs:
        row = run_method(model, cfg, method, context, args, chunk)
        rows.append(row)
        shown = {k: v for k, v in row.items() if k not in ("decode_steps_s", "profile")}
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in shown.items()})
        path = write_results(args.name, {**header, "rows": rows})  # after every row: a crash keeps results
    print(f"\nresults: {path}")
    print_table(rows)


if __name__ == "__main__":
    main()
