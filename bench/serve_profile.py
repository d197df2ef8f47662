"""Where a decode step of the server's engine spends its time, per batch size: wall time per
step with and without CUDA graphs, the GPU's busy time per step (torch.profiler over eager
steps: the kernels a graph replays), the kernels that take it, and the step's bytes against the
HBM roofline (weights once a step plus every sequence's KV, at `--hbm-gbps`).

Llama-3.1-8B shapes, random bf16 weights, random prompt ids (synthetic). A step whose wall time
is well above its GPU busy time is host-bound; one whose busy time is well above the roofline
is kernel-bound, and the kernel table says which.

    python bench/serve_profile.py --batches 1,64 --context 1024     # bench/results/serve_profile.json

`--device cpu --model <small>` runs the same code on the CPU (a check of the script: no graphs,
profiler CPU times only).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.planner.memory import weight_bytes
from kvtier.serve.engine import ServeConfig, ServeEngine


def prefill_all(engine: ServeEngine) -> None:
    """Step until every submitted request has its whole prompt in the pool."""
    engine._drain(block=False)
    sched = engine.scheduler
    while any(s.num_computed < len(s.prompt) for s in sched.running + list(sched.waiting)):
        engine.step()


def timed_steps(engine: ServeEngine, steps: int, cuda: bool) -> float:
    """Mean wall seconds of `steps` decode steps (after 3 untimed ones)."""
    for _ in range(3):
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


Kernels = list[dict[str, Any]]


def profile_steps(engine: ServeEngine, steps: int, cuda: bool, top: int) -> tuple[float, Kernels]:
    """(device busy seconds per step, the `top` kernels by time per step) over eager steps."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    busy_us = 0.0
    for e in prof.key_averages():
        # NOTE: device_time_total of a kernel (no children on the device) is its own time; CPU
        # operators also carry their kernels' device time, so only kernels are summed.
        us = float(getattr(e, "self_device_time_total", 0.0) or 0.0) if cuda else float(e.self_cpu_time_total)
        if us <= 0 or (cuda and e.device_type != DeviceType.CUDA):
            continue  # NOTE: an operator (aten::mm) carries its kernels' time too: count kernels once
        busy_us += us
        rows.append({"name": e.key[:90], "calls_per_step": e.count / steps, "ms_per_step": us / steps / 1e3})
    rows.sort(key=lambda r: -r["ms_per_step"])
    return busy_us / steps / 1e6, [{**r, "ms_per_step": round(r["ms_per_step"], 4)} for r in rows[:top]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batches", default="1,64", help="batch sizes, comma-separated")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of every sequence")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=14, help="kernels listed per batch size")
    ap.add_argument("--hbm-gbps", type=float, default=4200.0, help="the roofline's HBM rate")
    ap.add_argument("--tflops", type=float, default=790.0, help="the prefill floor's matmul rate")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-fuse", action="store_true", help="separate q/k/v and gate/up matmuls")
    ap.add_argument("--name", default="serve_profile")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    cuda = args.device.startswith("cuda")
    dtype = "bf16" if cuda else "fp32"
    llm = LLM(args.model, device=args.device, dtype=dtype, fuse_projections=not args.no_fuse)
    cfg = llm.model_config
    itemsize = 2 if cuda else 4
    rows: dict[str, Any] = {}
    for batch in batches:
        engine = ServeEngine(
            llm,
            ServeConfig(
                max_num_seqs=max(batches),
                max_num_batched_tokens=max(8192, args.context),
                static_decode=True,
                cuda_graphs=cuda,
                num_pages=None if cuda else 4 * max(batches) * (args.context // 16 + 64),
            ),
        )
        gen = torch.Generator().manual_seed(batch)
        # Enough new tokens for every timed and profiled step (2 x (3 + steps) + 3), no more: a
        # request longer than the pool would be a tiered run, outside the batch profiled here.
        room = llm.max_model_len_for(llm.method) - args.context
        params = SamplingParams(max_tokens=min(room, 2 * args.steps + 16), ignore_eos=True)
        for _ in range(batch):
            ids = torch.randint(100, cfg.vocab_size, (args.context,), generator=gen).tolist()
            engine.submit(ids, params, lambda d: None)
        prefill: dict[str, Any] | None = None
        if batch >= 8 or batch * args.context >= 4096:
            # The first step is prefill chunks alone (up to --max-num-batched-tokens of prompts):
            # its device time against the matmul floor of its tokens.
            engine._drain(block=False)
            tokens = min(batch * args.context, 8192)
            t0 = time.perf_counter()
            busy, kernels = profile_steps(engine, 1, cuda, args.top)
            # NOTE: the layers' weights only: embedding rows are looked up, logits are of last tokens
            layer_params = cfg.num_parameters() - 2 * cfg.vocab_size * cfg.hidden_size
            floor = 2 * tokens * layer_params / (args.tflops * 1e12)
            prefill = {
                "tokens": tokens,
                "wall_ms_profiled": round(1e3 * (time.perf_counter() - t0), 3),
                "device_busy_ms": round(1e3 * busy, 3),
                "matmul_floor_ms": round(1e3 * floor, 3),
                "top_kernels": kernels,
            }
        prefill_all(engine)
        if len(engine.scheduler.running) != batch:
            raise SystemExit(
                f"B={batch}: only {len(engine.scheduler.running)} requests run in the batch "
                f"(a pool of {engine.pool_tokens} tokens)"
            )
        decoder = engine.decoder
        assert decoder is not None
        row: dict[str, Any] = {}
        if cuda:
            decoder.graphs = True
            row["graphs_ms_per_step"] = round(1e3 * timed_steps(engine, args.steps, cuda), 3)
        decoder.graphs = False
        row["eager_ms_per_step"] = round(1e3 * timed_steps(engine, args.steps, cuda), 3)
        busy, kernels = profile_steps(engine, 3, cuda, args.top)
        kv = batch * (args.context + 8) * cfg.kv_bytes_per_token(itemsize)
        floor = (weight_bytes(cfg, itemsize) + kv) / (args.hbm_gbps * 1e9)
        row |= {
            "device_busy_ms_per_step": round(1e3 * busy, 3),
            "hbm_floor_ms_per_step": round(1e3 * floor, 3),
            "kv_bytes_per_step": kv,
            "top_kernels": kernels,
        }
        if prefill is not None:
            row["prefill_step"] = prefill
        rows[f"B{batch}"] = row
        shown = "  ".join(f"{k} {v}" for k, v in row.items() if k not in ("top_kernels", "prefill_step"))
        print(f"B={batch}: {shown}", flush=True)
        for k in kernels[:6]:
            print(f"    {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<6g} {k['name']}", flush=True)
        if prefill is not None:
            shown = "  ".join(f"{k} {v}" for k, v in prefill.items() if k != "top_kernels")
            print(f"  prefill step: {shown}", flush=True)
            for k in prefill["top_kernels"][:6]:
                print(f"    {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<6g} {k['name']}", flush=True)
        engine.shutdown()
        # NOTE: `decoder` holds the engine's graphs and pool too: drop both before the next
        # engine sizes its pool from free memory
        del engine, decoder
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    path = write_results(
        args.name,
        {
            "model": f"{args.model} (random weights)",
            "data": "synthetic: prompts of random token ids",
            "context": args.context,
            "fused_projections": not args.no_fuse,
            "hbm_gbps_assumed": args.hbm_gbps,
            "batches": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
