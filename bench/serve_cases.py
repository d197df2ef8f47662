"""The cases `bench/serve_gpu.py` runs over a `ServeEngine` in this thread: `c*`, n requests at
once (throughput, TTFT, TPOT, the batch stream's step and idle times), and `prefix` (time to
first token with a cached prefix in the device tier, then in the host tier). `mixed` has its
own driver, `bench/serve_mixed.py`."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from bench.serve_loop import FIRST_STEPS, GcPauses, Stream, ms_p50, step_loop, sync
from kvtier.engine.batch.sequence import Delta
from kvtier.engine.sampling import SamplingParams
from kvtier.serve.engine import ServeEngine

# name -> (concurrent requests, prompt tokens, new tokens)
CASES: dict[str, tuple[int, int, int]] = {
    "c1": (1, 1024, 128),
    "c1-32k": (1, 32768, 64),
    "c16": (16, 1024, 128),
    "c32": (32, 1024, 128),
    "c64": (64, 1024, 128),
    "c64-1k-out": (64, 1024, 1024),  # long outputs: per-step host work that grows with them shows
}
SPECIAL = ("mixed", "prefix")  # cases with their own driver (`serve_mixed.run_mixed`, `run_prefix`)


def run_case(
    engine: ServeEngine,
    n: int,
    prompt: int,
    new: int,
    vocab: int,
    seed: int,
    sampling: tuple[float, float] = (0.0, 1.0),
) -> tuple[dict[str, Any], list[list[int]]]:
    """Submit `n` requests at once, step until all finish: throughput and latencies (the
    steady part: after every request has its first token), and each request's token ids."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, vocab, (prompt,), generator=gen).tolist() for _ in range(n)]
    temperature, top_p = sampling  # (0, 1): greedy
    params = [
        SamplingParams(new, temperature=temperature, top_p=top_p, seed=seed * 1000 + i, ignore_eos=True)
        for i in range(n)
    ]
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

    sync(engine)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(p, params[i], sink_for(i))
    times: dict[str, list[Any]] = {"step": [], "tiered": []}
    with GcPauses() as gcp:
        steps, _ = step_loop(engine, times)
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
        # host ms of the first batch steps (prefill chunks, then the first decode steps)
        "first_steps_ms": [round(1e3 * t, 1) for t in times["step"][:FIRST_STEPS]],
        "gc": gcp.summary(),  # the interpreter's collections during the case (they stop the loop)
        # the batch stream: each step's span, and the idle time between steps (host-bound)
        "device_step_ms_p50": ms_p50(times.get("device_step", [])),
        "device_idle_ms_p50": ms_p50(times.get("device_idle", [])),
        "device_idle_s_total": round(sum(times.get("device_idle", [])), 3),
    }
    return row, tokens


def run_prefix(engine: ServeEngine, prefix_tokens: int, vocab: int) -> dict[str, Any]:
    """TTFT of a request whose `prefix_tokens` prefix is cached in the device tier, then in the
    host tier (after one other prompt as long as the pool pushed all of it out of the pool)."""
    page = engine.store.page_size
    if not prefix_tokens + 64 <= engine.pool_tokens < 3 * prefix_tokens:
        raise SystemExit(
            f"prefix: a pool of {engine.pool_tokens} tokens cannot show both tiers for a "
            f"{prefix_tokens}-token prefix (it must hold the prefix and be under 3x it); give "
            "--prefix-pool-tokens"
        )
    if engine.kv.host.num_slots * page < prefix_tokens:
        raise SystemExit(
            f"prefix: the host tier holds {engine.kv.host.num_slots} pages, fewer than the "
            f"{prefix_tokens}-token prefix's; give --num-host-pages to kvtier's engine"
        )
    engine.kv.reset_prefix_cache()
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(100, vocab, (prefix_tokens,), generator=gen).tolist()

    def ttft(ids: list[int]) -> float:
        s = Stream()
        sync(engine)
        t0 = time.perf_counter()
        engine.submit(ids, SamplingParams(max_tokens=2, ignore_eos=True), s)
        step_loop(engine)
        return s.times[0] - t0

    cold = ttft([*prefix, 7])
    device_hit = ttft([*prefix, 8])
    host_hits_before = engine.kv.stats.host_hits
    # One prompt that needs the whole pool evicts every cached page, the prefix's to the host
    # tier (two prefix-long prompts, as before, evicted more pages than the host tier holds).
    ttft(torch.randint(100, vocab, (engine.pool_tokens - page - 2,), generator=gen).tolist())
    host_hit = ttft([*prefix, 9])
    return {
        "prefix_tokens": prefix_tokens,
        "pool_tokens": engine.pool_tokens,
        "host_pages": engine.kv.host.num_slots,
        "ttft_cold_s": round(cold, 4),
        "ttft_device_hit_s": round(device_hit, 4),
        "ttft_host_hit_s": round(host_hit, 4),
        "host_hit_tokens": engine.kv.stats.host_hits - host_hits_before,  # of the prefix's full pages
        "prefix_page_tokens": prefix_tokens // page * page,
    }
