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
import gc
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KV_FILLS, fill_store, write_results
from bench.hip_offload_plan import (
    cache_bytes_estimate,
    codec_of,
    engine_plan,
    make_kernel,
    make_plan,
    preset_spec,
)
from bench.hip_offload_steps import decode, prefill_chunk
from kvtier.config import ModelConfig
from kvtier.errors import CapacityError
from kvtier.kv.store import TieredKVStore
from kvtier.loading.presets import preset_config
from kvtier.loading.weights import random_model
from kvtier.model.llama import CausalLM
from kvtier.sparse import HIP_PRESETS
from kvtier.units import parse_count, parse_size


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
        "--presets",
        default="fast,flash",
        help='HiP presets (kvtier.sparse.HIP_PRESETS), each with options after "+" '
        '("fast+strides=16/4/1+exact=8"); "": none',
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
    if args.steps == 0 and not args.prefill_chunk:
        # NOTE: --steps 0 drops the decode rows; without a prefill row the run timed nothing (a
        # device call once spent its warm-ups and printed an empty table)
        ap.error("--steps 0 times prefill rows only: pass --prefill-chunk (e.g. 16384), or steps > 0")
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
        args.steps = 2 * min((HIP_PRESETS[preset_spec(p)[0]].refresh[0] for p in presets), default=16) + 2
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
