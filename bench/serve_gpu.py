"""`kvtier serve`'s engine on a GPU: one stream and many concurrent streams (issue 18's targets).

Llama-3.1-8B shapes (128K context) with random bf16 weights (a preset: no download), prompts
of random token ids (synthetic data), greedy decoding with `ignore_eos`. Runs the `ServeEngine`
step loop in this thread (no HTTP), so the numbers are the engine's. For each case: output tokens/s, time to
first token (TTFT) and time per output token (TPOT, per request: (last - first) / (n - 1)),
p50 and mean, plus the engine's decode-graph counters.

    python bench/serve_gpu.py                                  # every case, CUDA graphs on
    python bench/serve_gpu.py --cases c1,c64 --no-graphs       # the same steps, eager

Writes bench/results/serve_gpu.json (or --name).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.engine.batch.sequence import Delta
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.serve.engine import ServeConfig, ServeEngine

# name -> (concurrent requests, prompt tokens, new tokens)
CASES: dict[str, tuple[int, int, int]] = {
    "c1": (1, 1024, 128),
    "c1-32k": (1, 32768, 64),
    "c16": (16, 1024, 128),
    "c64": (64, 1024, 128),
}


def run_case(
    engine: ServeEngine, n: int, prompt: int, new: int, vocab: int, seed: int
) -> tuple[dict[str, Any], list[list[int]]]:
    """Submit `n` requests at once, step until all finish: throughput and latencies (the
    steady part: after every request has its first token), and each request's token ids."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, vocab, (prompt,), generator=gen).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    count = [0] * n
    tokens: list[list[int]] = [[] for _ in range(n)]
    stamps: list[tuple[float, int]] = []  # (time, tokens) of every delta

    def sink_for(i: int) -> Any:
        def sink(d: Delta) -> None:
            now = time.perf_counter()
            if d.token_ids:
                first.setdefault(i, now)
                last[i] = now
            count[i] += len(d.token_ids)
            tokens[i].extend(d.token_ids)
            stamps.append((now, len(d.token_ids)))

        return sink

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(p, params, sink_for(i))
    steps = 0
    engine._drain(block=False)
    while engine.has_work:
        engine.step()
        steps += 1
        engine._drain(block=False)
    wall = time.perf_counter() - t0
    ttft = [first[i] - t0 for i in range(n)]
    tpot = [(last[i] - first[i]) / (count[i] - 1) for i in range(n) if count[i] > 1]
    # Once every request has its first token: decode steps of the whole batch only.
    all_started, end = max(first.values()), max(last.values())
    steady = sum(k for t, k in stamps if t > all_started)
    row: dict[str, Any] = {
        "requests": n,
        "prompt_tokens": prompt,
        "new_tokens": new,
        "generated_tokens": sum(count),
        "wall_s": round(wall, 3),
        "steps": steps,
        "output_tokens_per_s": round(sum(count) / wall, 1),
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_mean_s": round(statistics.fmean(ttft), 4),
        "tpot_p50_ms": round(1e3 * statistics.median(tpot), 3),
        "tpot_mean_ms": round(1e3 * statistics.fmean(tpot), 3),
        "steady_decode_s": round(end - all_started, 3),
        "steady_output_tokens_per_s": round(steady / (end - all_started), 1) if end > all_started else None,
    }
    return row, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="llama-3.1-8b", help="preset or HF folder (default: Llama-3.1-8B shapes)"
    )
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--gpu-memory", default=None, help="the server's GPU budget (default: the whole GPU)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--no-graphs", action="store_true", help="decode steps eagerly (no CUDA graphs)")
    ap.add_argument("--name", default="serve_gpu")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    llm = LLM(args.model, device="cuda", dtype="bf16", gpu_memory=args.gpu_memory)
    cfg = ServeConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cuda_graphs=not args.no_graphs,
    )
    t0 = time.perf_counter()
    engine = ServeEngine(llm, cfg)
    vocab = llm.model_config.vocab_size
    run_case(engine, 2, 64, 4, vocab, seed=99)  # warm-up: kernels compile, first graphs
    results: dict[str, Any] = {
        "model": f"{args.model} (random bf16 weights)",
        "data": "synthetic: prompts of random token ids, greedy, ignore_eos",
        "gpu_memory": args.gpu_memory or "whole GPU",
        "pool_pages": engine.store.num_pages,
        "page_size": engine.store.page_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "cuda_graphs": not args.no_graphs,
        "engine_start_s": round(time.perf_counter() - t0, 2),
        "cases": {},
    }
    if engine.decoder is not None and engine.decoder.graphs:
        # The graphs replay the eager kernels: the same schedule gives the same token ids
        # (the prefix cache is emptied first, so both runs prefill alike).
        engine.kv.reset_prefix_cache()
        _, with_graphs = run_case(engine, 8, 300, 24, vocab, seed=7)
        engine.decoder.graphs = False
        engine.kv.reset_prefix_cache()
        _, eager = run_case(engine, 8, 300, 24, vocab, seed=7)
        engine.decoder.graphs = True
        results["graphs_equal_eager_tokens"] = with_graphs == eager
        print(f"graph replays give the eager path's token ids: {with_graphs == eager}", flush=True)
    path = None
    for i, name in enumerate(cases):
        n, prompt, new = CASES[name]
        torch.cuda.reset_peak_memory_stats()
        row, _ = run_case(engine, n, prompt, new, vocab, seed=i)
        row["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        results["cases"][name] = row
        print(
            f"{name:<8} {row['output_tokens_per_s']:>9} tok/s  TTFT p50 {row['ttft_p50_s']:.3f} s  "
            f"TPOT p50 {row['tpot_p50_ms']:.2f} ms  steady {row['steady_output_tokens_per_s']} tok/s  "
            f"peak {row['peak_gpu_gb']} GB",
            flush=True,
        )
        decoder = engine.decoder
        results["graph_captures"] = decoder.captures if decoder is not None else 0
        results["graph_replays"] = decoder.replays if decoder is not None else 0
        path = write_results(args.name, results)  # after every case: a cut-short run keeps its rows
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
