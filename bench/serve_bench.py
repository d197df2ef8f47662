"""`kvtier serve`'s engine on the CPU: continuous batching vs one request at a time, and TTFT
with and without a prefix-cache hit (device tier and host tier), on the embedded SmolLM2-135M.

    .venv/bin/python bench/serve_bench.py [--requests 32] [--max-tokens 32] [--threads 1]

Runs the `ServeEngine` step loop in this thread (no HTTP), so the numbers are the engine's.
Prints a table and writes bench/results/serve_cpu.json (machine, date, command, numbers).
"""

from __future__ import annotations

import argparse
import os
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

TOPICS = ["rivers", "owls", "copper", "tea", "clocks", "glaciers", "bees", "lanterns"]


def prompts(n: int) -> list[str]:
    return [f"Write a short poem about {TOPICS[i % 8]} and the number {i}." for i in range(n)]


def serve_all(engine: ServeEngine, ids: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """Submit every request at once and step until all finish; throughput and latencies."""
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    tokens = [0] * len(ids)

    def sink_for(i: int) -> Any:
        def sink(d: Delta) -> None:
            now = time.perf_counter()
            first.setdefault(i, now)
            tokens[i] += len(d.token_ids)
            if d.finish_reason is not None:
                done[i] = now

        return sink

    t0 = time.perf_counter()
    for i, p in enumerate(ids):
        engine.submit(p, params, sink_for(i))
    engine.run_until_idle()
    wall = time.perf_counter() - t0
    return {
        "wall_s": round(wall, 3),
        "generated_tokens": sum(tokens),
        "tokens_per_s": round(sum(tokens) / wall, 2),
        "mean_ttft_s": round(sum(first[i] - t0 for i in first) / len(first), 3),
        "mean_latency_s": round(sum(done[i] - t0 for i in done) / len(done), 3),
    }


def one_at_a_time(engine: ServeEngine, ids: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """The same requests, each submitted only when the previous one finished."""
    t0 = time.perf_counter()
    total, ttfts = 0, []
    for p in ids:
        r = serve_all(engine, [p], params)
        total += int(r["generated_tokens"])
        ttfts.append(r["mean_ttft_s"])
    wall = time.perf_counter() - t0
    return {
        "wall_s": round(wall, 3),
        "generated_tokens": total,
        "tokens_per_s": round(total / wall, 2),
        "mean_ttft_s": round(sum(ttfts) / len(ttfts), 3),
    }


def ttft(engine: ServeEngine, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first token of one request, and its cached prompt tokens."""
    got: list[Delta] = []
    t0 = time.perf_counter()
    engine.submit(ids, SamplingParams(max_tokens=1), got.append)
    engine.run_until_idle()
    return time.perf_counter() - t0, got[0].cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: best on a shared CPU)")
    ap.add_argument("--prefix-repeats", type=int, default=40, help="a ~500-token shared prefix")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = [round(x, 2) for x in os.getloadavg()]  # the CPU may be shared: context for the numbers
    llm = LLM(args.model, device="cpu", dtype="fp32")
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    ids = [llm.encode(p) for p in prompts(args.requests)]

    batched = ServeEngine(llm, ServeConfig(num_pages=512, max_num_seqs=64))
    serve_all(batched, ids[:2], SamplingParams(max_tokens=2))  # warm-up
    cb = serve_all(batched, ids, params)
    single = ServeEngine(llm, ServeConfig(num_pages=512, max_num_seqs=1))
    seq = one_at_a_time(single, ids, params)

    prefix = llm.encode("Background: the river town keeps lanterns by the water. " * args.prefix_repeats)
    q1, q2 = llm.encode(" Question: what is kept?"), llm.encode(" Question: where are they?")
    # 48 pages of 16 tokens: the filler request evicts the cached prefix to the host tier.
    engine = ServeEngine(llm, ServeConfig(num_pages=48, num_host_pages=64))
    cold, _ = ttft(engine, prefix + q1)
    warm, cached = ttft(engine, prefix + q2)
    ttft(engine, llm.encode("Filler text about something else entirely. " * 50))
    host, host_cached = ttft(engine, prefix + q1)
    results: dict[str, Any] = {
        "model": llm.loaded.name,
        "device": "cpu",
        "dtype": "fp32",
        "torch_threads": args.threads,
        "load_average_at_start": load,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "continuous_batching": cb,
        "one_at_a_time": seq,
        "throughput_speedup": round(cb["tokens_per_s"] / seq["tokens_per_s"], 2),
        "ttft": {
            "prompt_tokens": len(prefix) + len(q1),
            "cold_s": round(cold, 3),
            "device_hit_s": round(warm, 3),
            "device_hit_cached_tokens": cached,
            "host_hit_s": round(host, 3),
            "host_hit_cached_tokens": host_cached,
            "host_hit_tokens_copied": engine.kv.stats.host_hits,
        },
    }
    print(f"{'mode':<22}{'wall s':>9}{'tokens':>8}{'tok/s':>9}{'mean TTFT s':>13}")
    for name, r in (("continuous batching", cb), ("one at a time", seq)):
        print(
            f"{name:<22}{r['wall_s']:>9}{r['generated_tokens']:>8}{r['tokens_per_s']:>9}{r['mean_ttft_s']:>13}"
        )
    print(f"throughput speedup: {results['throughput_speedup']}x")
    t = results["ttft"]
    print(
        f"TTFT, {t['prompt_tokens']}-token prompt: cold {t['cold_s']} s, "
        f"device prefix hit {t['device_hit_s']} s ({cached} cached), "
        f"host-tier hit {t['host_hit_s']} s ({host_cached} cached)"
    )
    print(f"wrote {write_results('serve_cpu', results)}")


if __name__ == "__main__":
    main()
