"""Profile one prefill chunk of an offloaded store: where do head-wise slices lose time?

Prefills `--context - --chunk` tokens, then runs the last chunk under torch.profiler and
reports wall time, GPU busy time per stream (compute, H2D, D2H), the GPU's idle time on the
compute stream and the top kernels. Writes $OUT/prefill_profile_<policy>.json and a Chrome
trace (open in https://ui.perfetto.dev). On the H200 (llama-3-8b, 24 GB cap):

    python bench/prefill_profile.py --policy head --context 32K
    python bench/prefill_profile.py --policy layer --context 32K

`--smoke` runs a tiny random model on the CPU to check the script.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.config import ModelConfig
from kvtier.kv.store import TieredKVStore
from kvtier.loading.presets import preset_config
from kvtier.loading.weights import random_model
from kvtier.planner.hardware import hardware_preset
from kvtier.planner.placement import plan_kv
from kvtier.units import parse_count, parse_size


def tiny_config() -> ModelConfig:
    return ModelConfig.from_hf_dict(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
            "max_position_embeddings": 4096,
        }
    )


def summarize(prof: Any) -> dict[str, Any]:
    """GPU busy time per stream and the top kernels, from the profiler's device events."""
    busy: dict[int, float] = defaultdict(float)
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    kernels: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        stream = getattr(ev, "device_resource_id", 0)
        t0 = ev.time_range.start
        t1 = ev.time_range.end
        busy[stream] += (t1 - t0) / 1e6
        spans[stream].append((t0, t1))
        kernels[ev.name] += (t1 - t0) / 1e6
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    gaps = {}
    for stream, sp in spans.items():
        sp.sort()
        gaps[stream] = sum(max(0.0, b[0] - a[1]) for a, b in itertools.pairwise(sp)) / 1e6
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:20]
    return {
        "busy_s_per_stream": dict(busy),
        "idle_s_between_ops_per_stream": gaps,
        "top_kernels_s": dict(top),
        # host side: the ops with the most self CPU time (calls, seconds); a sync shows as
        # cudaStreamSynchronize / cudaMemcpyAsync / aten::item / aten::_local_scalar_dense
        "top_host_ops": {a.key: [a.count, round(a.self_cpu_time_total / 1e6, 4)] for a in host},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", default="head")
    ap.add_argument("--context", default="32K")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--gpu-memory", default="24GB")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    context = parse_count(args.context)
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        cfg, context, chunk, budget = tiny_config(), 512, 128, None
    else:
        cfg, chunk = preset_config("llama-3-8b"), args.chunk
        budget = parse_size(args.gpu_memory)
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(budget / total)
    model = random_model(cfg, dev, dtype)
    plan = plan_kv(
        cfg,
        context,
        policy=args.policy,
        gpu_budget=budget,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        chunk_size=chunk,
        hardware=hardware_preset("h200"),
    )
    store = TieredKVStore(cfg, plan, device=dev, dtype=dtype, capacity=context)
    ids = torch.randint(0, cfg.vocab_size, (context,), device=dev)
    none = torch.empty(0, dtype=torch.long, device=dev)

    def step(s: int) -> None:
        part = ids[s : s + chunk]
        store.begin_step(part.shape[0])
        model(part, store, logits_at=none, mlp_chunk=chunk)
        store.end_step()

    starts = list(range(0, context, chunk))
    for s in starts[:-1]:
        step(s)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        step(starts[-1])
        sync()
        wall = time.perf_counter() - t
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"prefill_trace_{args.policy}.json"))
    summary = summarize(prof)
    summary.update(
        policy=args.policy,
        context=context,
        chunk=chunk,
        wall_s=wall,
        slices=plan.num_slices,
        group_size=plan.group_size,
        cpu_ops=len(prof.events()),
    )
    write_results(f"prefill_profile_{args.policy}", summary)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(f"\n{args.policy}: last chunk of {chunk} at {context}: wall {wall * 1e3:.1f} ms")
    print(f"  {plan.num_slices} slices of {plan.group_size} KV heads, {summary['cpu_ops']} profiled events")
    for stream, b in summary["busy_s_per_stream"].items():
        idle = summary["idle_s_between_ops_per_stream"][stream]
        print(f"  stream {stream}: busy {b * 1e3:.1f} ms, idle between ops {idle * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
