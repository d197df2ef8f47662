"""What a CUDA graph over a decode step's dense layer work would save the host (issue 23).

With CPU-attended slices the host's work between one layer's CPU results and the next layer's
query stands on the CPU's critical path: ~1.5-1.9 ms a layer on the H200 machine
(`bench/tiered_store.py --trace-cpu`, int4_512k_g2_cpu32_timeline_unpack.json), most of it the
layer's norms, projections and MLP issued one operator at a time. This measures that part
alone: a model of `--model`'s shapes (`--layers` layers, random weights, projections fused as
`LLM` runs them) decodes one token with attention replaced by the identity on q, so no KV is
read and only the dense work runs; eagerly, and replayed from one CUDA graph captured once. Per
layer: the host's issue time (until the call returns) and the wall time (GPU work included).

    python bench/layer_graph.py --model llama-3-8b --layers 8

`--smoke` runs the eager half on the CPU with a small model (a check that the script works).
Results: $OUT/layer_graph.json (else bench/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, write_results
from kvtier.loading.presets import preset_config
from kvtier.loading.weights import random_model
from kvtier.model.fuse import fuse_projections_


def identity_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention replaced by its query [T, H_q, D]: the layer's dense work runs, no KV is read."""
    return q


def times(fn: Callable[[], Any], reps: int, cuda: bool) -> tuple[float, float]:
    """Median (issue seconds, wall seconds) of fn() over `reps` calls after one warm-up."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    issue, wall = [], []
    for _ in range(reps + 1):
        sync()
        t = time.perf_counter()
        fn()
        issue.append(time.perf_counter() - t)
        sync()
        wall.append(time.perf_counter() - t)
    return median(issue[1:]), median(wall[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--name", default="layer_graph")
    args = ap.parse_args()
    cuda = not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = preset_config(args.model)
    if args.smoke:
        cfg = dataclasses.replace(cfg, hidden_size=256, intermediate_size=512, head_dim=32, vocab_size=512)
        args.reps = 3
    cfg = dataclasses.replace(cfg, num_layers=args.layers)
    model = random_model(cfg, dev, dtype)
    fuse_projections_(model)
    token = torch.ones(1, dtype=torch.long, device=dev)
    none = torch.empty(0, dtype=torch.long, device=dev)  # no logits: the layers alone

    def step() -> torch.Tensor:
        with torch.inference_mode():
            return model(token, identity_attention, logits_at=none)

    def row(mode: str, fn: Callable[[], Any]) -> dict[str, Any]:
        issue, wall = times(fn, args.reps, cuda)
        return {"mode": mode, "issue_s": issue, "wall_s": wall}

    rows = [row("eager", step)]
    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: autotuning, allocations
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        rows.append(row("graph", graph.replay))
    for r in rows:
        r["issue_s_per_layer"] = r["issue_s"] / cfg.num_layers
        r["wall_s_per_layer"] = r["wall_s"] / cfg.num_layers
    path = write_results(args.name, {"model": args.model, "layers": cfg.num_layers, "rows": rows})
    print(f"results: {path}")
    print(f"{'mode':>6} {'issue us/layer':>15} {'wall us/layer':>14}")
    for r in rows:
        print(f"{r['mode']:>6} {r['issue_s_per_layer'] * 1e6:>15.0f} {r['wall_s_per_layer'] * 1e6:>14.0f}")


if __name__ == "__main__":
    main()
