"""Host (CPU) time to issue one step, per layer and per attention slice step.

The planner keeps prefill chunks long enough that the GPU's work outlasts the host's issuing
of it (`kvtier.planner.roofline.min_host_hidden_chunk`); this script measures the two numbers it
needs on the machine at hand. It builds a few-layer model of llama-3-8b's shapes, fills a short
cache, and times how long `model(...)` takes to *return* (kernels queued, not finished) for a
decode step and a prefill chunk, under the `gpu` policy (one attention call per layer) and the
`head` policy (one streamed slice step per KV head):

    layer_overhead = issue(gpu) / layers
    slice_overhead = (issue(head) - issue(gpu)) / (layers x kv_heads - layers)

Prints a table last and writes $OUT/host_overhead.json. On the H200:

    python bench/host_overhead.py

`--smoke` runs on the CPU (no streams, so only a check that the script works).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, write_results
from kvtier.kv.store import TieredKVStore
from kvtier.loading.presets import preset_config
from kvtier.loading.weights import random_model
from kvtier.planner.placement import plan_kv


def issue_times(
    model: Any, cfg: Any, policy: str, dev: torch.device, dtype: torch.dtype, args: Any
) -> dict[str, float]:
    """Median host seconds for `model(...)` to return: decode step and prefill chunk."""
    total = args.context + args.chunk
    plan = plan_kv(cfg, total, policy=policy, gpu_budget=None, dtype_bytes=2, chunk_size=args.chunk)
    store = TieredKVStore(cfg, plan, device=dev, dtype=dtype, capacity=total)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    ids = torch.randint(0, cfg.vocab_size, (args.context,), device=dev)
    none = torch.empty(0, dtype=torch.long, device=dev)
    for s in range(0, args.context, args.chunk):
        store.begin_step(min(args.chunk, args.context - s))
        model(ids[s : s + args.chunk], store, logits_at=none, mlp_chunk=args.chunk)
        store.end_step()
    out: dict[str, float] = {}
    for name, n in (("decode", 1), ("prefill_chunk", args.chunk)):
        part = ids[:n]
        times = []
        for _ in range(args.reps + 1):
            sync()
            # NOTE: the step is never ended, so every repetition sees the same shapes: a new key
            # length would make cuDNN build a graph, which is not per-step host work.
            store.begin_step(n)
            t = time.perf_counter()
            model(part, store, logits_at=none, mlp_chunk=args.chunk)
            times.append(time.perf_counter() - t)
            sync()
        out[name] = median(times[1:])
    store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cfg = preset_config("llama-3-8b")
    if args.smoke:
        cfg = dataclasses.replace(cfg, hidden_size=256, intermediate_size=512, head_dim=32, vocab_size=512)
        args.context, args.chunk, args.reps = 256, 64, 3
    cfg = dataclasses.replace(cfg, num_layers=args.layers)
    model = random_model(cfg, dev, dtype)
    gpu = issue_times(model, cfg, "gpu", dev, dtype, args)
    head = issue_times(model, cfg, "head", dev, dtype, args)
    layers, slices = cfg.num_layers, cfg.num_layers * cfg.num_kv_heads
    rows: list[dict[str, Any]] = []
    for step in ("decode", "prefill_chunk"):
        rows.append(
            {
                "step": step,
                "gpu_issue_s": gpu[step],
                "head_issue_s": head[step],
                "layer_overhead_s": gpu[step] / layers,
                "slice_overhead_s": (head[step] - gpu[step]) / (slices - layers),
            }
        )
    path = write_results("host_overhead", {"layers": layers, "kv_heads": cfg.num_kv_heads, "rows": rows})
    print(f"results: {path}")
    print(f"{'step':>14} {'gpu ms':>8} {'head ms':>8} {'per layer us':>13} {'per slice us':>13}")
    for r in rows:
        print(
            f"{r['step']:>14} {r['gpu_issue_s'] * 1e3:>8.2f} {r['head_issue_s'] * 1e3:>8.2f} "
            f"{r['layer_overhead_s'] * 1e6:>13.0f} {r['slice_overhead_s'] * 1e6:>13.0f}"
        )


if __name__ == "__main__":
    main()
