"""`kvtier serve`'s engine on a GPU: one stream and many concurrent streams (issue 18's targets).

Llama-3.1-8B shapes (128K context) with random bf16 weights (a preset: no download), prompts
of random token ids (synthetic data), greedy decoding with `ignore_eos`. Runs the `ServeEngine`
step loop in this thread (no HTTP), so the numbers are the engine's. For each case: output tokens/s, time to
first token (TTFT) and time per output token (TPOT, per request: (last - first) / (n - 1)),
p50 and mean, plus the engine's decode-graph counters.

    python bench/serve_gpu.py                                  # every case, CUDA graphs on
    python bench/serve_gpu.py --cases c1,c64 --no-graphs       # the same steps, eager
    python bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed,prefix   # issue 18's last targets

`mixed`: one long request (`--long-tokens`, default 256K, too long for the pool: served over a
tiered store, its slices streamed from the host tier on a stream of its own) plus `c32`'s 32
short streams, submitted once the long request decodes: the short streams' TPOT (compare with
`c32` alone), the long request's decode s/token against its PCIe floor (its decode bytes over
`--pcie-gbps`), peak GPU memory. `prefix`: a `--prefix-tokens` (32K) prompt, then the same
prefix + 64 new tokens: time to first token with the prefix in the device tier, then again after
other prompts have pushed its pages to the host tier (a pool of `--prefix-pool-tokens`).

Writes bench/results/serve_gpu.json (or --name). `--device cpu --model <small>` runs the same
code on the CPU at small sizes (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from bench.serve_loop import FIRST_STEPS, GcPauses, Stream, ms_p50, step_loop, sync
from bench.serve_mixed import run_mixed
from kvtier.engine.batch.sequence import Delta
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError
from kvtier.loading.resolve import read_model_config
from kvtier.methods import parse_choice
from kvtier.serve.engine import ServeConfig, ServeEngine
from kvtier.serve.server import freeze_heap
from kvtier.units import parse_count, parse_size

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


def embedded_tokenizer(folder: str | None = None) -> Any:
    """The embedded SmolLM2's tokenizer: from `folder` (its tokenizer files), else converted
    from the embedded GGUF (once, cached)."""
    from transformers import AutoTokenizer

    from kvtier.loading.embedded import embedded_gguf_path
    from kvtier.loading.gguf import gguf_to_hf_folder

    if folder is None:
        cache = os.environ.get("KVTIER_CACHE_DIR") or str(Path.home() / ".cache" / "kvtier")
        folder = str(gguf_to_hf_folder(embedded_gguf_path(), cache))
    return AutoTokenizer.from_pretrained(folder)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="llama-3.1-8b", help="preset or HF folder (default: Llama-3.1-8B shapes)"
    )
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--gpu-memory", default=None, help="the server's GPU budget (default: the whole GPU)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--num-pages", type=int, default=None, help="the page pool (default: what the budget leaves)"
    )
    ap.add_argument("--no-graphs", action="store_true", help="decode steps eagerly (no CUDA graphs)")
    ap.add_argument("--no-fuse", action="store_true", help="separate q/k/v and gate/up matmuls")
    ap.add_argument(
        "--tiered-lookahead-layers",
        type=int,
        default=ServeConfig.tiered_lookahead_layers,
        help="how far a tiered run's launcher may run ahead of the device (0: unpaced)",
    )
    ap.add_argument(
        "--tiered-share",
        type=float,
        default=ServeConfig.tiered_share,
        help="share of the page pool tiered runs may borrow for their buffers (0: the reserve only)",
    )
    ap.add_argument(
        "--offload-reserve",
        default=None,
        help="GPU memory kept for requests over stores of their own (as kvtier serve's; default: "
        "a quarter of the pool's room, at most 4 GiB)",
    )
    ap.add_argument(
        "--tiered-keep-tokens",
        type=int,
        default=ServeConfig.tiered_keep_tokens,
        help="tokens per --max-num-seqs sequence the batch keeps before tiered runs may borrow pages",
    )
    ap.add_argument(
        "--tiered-release-after-prefill",
        action="store_true",
        help="free the allocator's unused cached blocks once a tiered run's prefill ends",
    )
    ap.add_argument("--long-tokens", type=parse_count, default=256 * 1024, help="mixed: the long prompt")
    ap.add_argument("--long-new-tokens", type=int, default=16, help="mixed: the long request's new tokens")
    ap.add_argument(
        "--long-method",
        default=None,
        help="mixed: a method the long request names, e.g. hip or quest,kv_budget=2k (default: lossless)",
    )
    ap.add_argument("--pcie-gbps", type=float, default=54.8, help="mixed: the host->GPU rate of the floor")
    ap.add_argument(
        "--mixed-timeout", type=float, default=240.0, help="mixed: seconds to wait for the long prefill"
    )
    ap.add_argument(
        "--mixed-profile-steps",
        default=None,
        help="mixed: FIRST,LAST batch steps whose device ops are tabled (the shorts join at 0); "
        "off by default, as the profiler slows the steps it records",
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="the interpreter's thread switch interval in seconds (sys.setswitchinterval; "
        "Python's default 0.005): how long a thread may wait for the GIL the launcher holds",
    )
    ap.add_argument(
        "--trace", action="store_true", help="mixed: those steps' Chrome trace to $OUT/<name>_trace.json.gz"
    )
    ap.add_argument("--prefix-tokens", type=parse_count, default=32 * 1024)
    ap.add_argument(
        "--prefix-pool-tokens",
        type=parse_count,
        default=None,
        help="prefix: a page pool of its own (default: the main pool if it holds the prefix and is "
        "under 3x it, else 2.5x --prefix-tokens)",
    )
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a check of the script at small sizes")
    ap.add_argument("--small", action="store_true", help="cases at 1/16 of their prompt and new tokens")
    ap.add_argument(
        "--tokenizer",
        default="none",
        help="a preset has no tokenizer, so no step decodes text; 'embedded' (or a folder holding "
        "its tokenizer files) gives the engine SmolLM2's (ids past its vocabulary decode to "
        "nothing), as a served HF folder would have one",
    )
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=ServeConfig.decode_steps,
        help="decode tokens a decode-only batch step computes before reading them back",
    )
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="the c* cases' sampling (0: greedy, the default)"
    )
    ap.add_argument("--top-p", type=float, default=1.0, help="the c* cases' top_p (with --temperature)")
    ap.add_argument(
        "--no-freeze",
        action="store_true",
        help="leave the start-up heap to the garbage collector (kvtier serve freezes it)",
    )
    ap.add_argument("--name", default="serve_gpu")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.small:
        for k, (n, prompt, new) in CASES.items():
            CASES[k] = (n, max(8, prompt // 16), max(2, new // 16))
    # prefix last: it frees the engine for a pool of its own
    cases = [c for c in cases if c != "prefix"] + ["prefix"] * ("prefix" in cases)
    unknown = [c for c in cases if c not in CASES and c not in SPECIAL]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join([*CASES, *SPECIAL])}")
    if args.long_method is not None:
        try:
            parse_choice(args.long_method)  # NOTE: a typo fails here, not after loading the model
        except ConfigError as e:
            ap.error(f"--long-method: {e}")
    dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    # The mixed case's long request may run past the model's trained context (synthetic ids).
    trained = int(read_model_config(args.model).max_position_embeddings)
    long_len = args.long_tokens + args.long_new_tokens if "mixed" in cases else 0
    max_len = long_len if long_len > trained else None
    llm = LLM(
        args.model,
        device=args.device,
        dtype=dtype,
        gpu_memory=args.gpu_memory,
        max_model_len=max_len,
        fuse_projections=not args.no_fuse,
    )
    cuda = llm.device.type == "cuda"
    described = f"{args.model} (random {dtype} weights)" if llm.tokenizer is None else args.model
    if args.tokenizer != "none":
        llm.tokenizer = embedded_tokenizer(None if args.tokenizer == "embedded" else args.tokenizer)
    cfg = ServeConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_pages=args.num_pages,
        cuda_graphs=not args.no_graphs,
        tiered_lookahead_layers=args.tiered_lookahead_layers,
        tiered_share=args.tiered_share,
        tiered_keep_tokens=args.tiered_keep_tokens,
        tiered_release_after_prefill=args.tiered_release_after_prefill,
        decode_steps=args.decode_steps,
        offload_reserve=None if args.offload_reserve is None else parse_size(args.offload_reserve),
    )
    t0 = time.perf_counter()
    engine = ServeEngine(llm, cfg)
    if not args.no_freeze:
        freeze_heap()  # as `kvtier serve` does before it listens
    vocab = llm.model_config.vocab_size
    run_case(engine, 2, 64, 4, vocab, seed=99)  # warm-up: kernels compile, first graphs
    run_case(engine, 1, CASES["c1"][1], 8, vocab, seed=98)  # and c1's shapes (its first run was slow)
    results: dict[str, Any] = {
        "model": described,
        "tokenizer": args.tokenizer,
        "sampling": {"temperature": args.temperature, "top_p": args.top_p},
        "decode_steps": args.decode_steps,
        "heap_frozen": not args.no_freeze,
        "data": "synthetic: prompts of random token ids, greedy, ignore_eos",
        "gpu_memory": args.gpu_memory or "whole GPU",
        "pool_pages": engine.store.num_pages,
        "page_size": engine.store.page_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "cuda_graphs": not args.no_graphs,
        "fused_projections": not args.no_fuse,
        "engine_start_s": round(time.perf_counter() - t0, 2),
        # NOTE: hardware queues CUDA maps streams onto (default 8): a tiered run's stream waiting
        # on its slice loads could hold up a batch stream that shares its queue
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default (8)"),
        "tiered_lookahead_layers": args.tiered_lookahead_layers,
        "tiered_share": args.tiered_share,
        "offload_reserve": args.offload_reserve or "default",
        "tiered_keep_tokens": args.tiered_keep_tokens,
        "tiered_release_after_prefill": args.tiered_release_after_prefill,
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
    own_pool = False
    for i, name in enumerate(cases):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        if name == "mixed":
            steps = args.mixed_profile_steps
            window = tuple(int(x) for x in steps.split(",")) if steps else None
            out_dir = os.environ.get("OUT", "bench/results")
            row = run_mixed(
                engine,
                args.long_tokens,
                args.long_new_tokens,
                vocab,
                args.pcie_gbps,
                args.mixed_timeout,
                CASES["c32"],
                profile_steps=window,  # type: ignore[arg-type]
                trace=f"{out_dir}/{args.name}_trace.json.gz" if args.trace else None,
                long_method=args.long_method,
            )
        elif name == "prefix":
            pool = args.prefix_pool_tokens
            if pool is None and not args.prefix_tokens + 64 <= engine.pool_tokens < 3 * args.prefix_tokens:
                pool = args.prefix_tokens * 5 // 2
            own_pool = pool is not None and pool != engine.pool_tokens
            if own_pool:
                # NOTE: a pool of its own; the main engine's is freed first, so both fit the budget
                # (the prefix case is therefore the last one run).
                counters = (engine.decoder.captures, engine.decoder.replays) if engine.decoder else (0, 0)
                results["graph_captures"], results["graph_replays"] = counters
                decoder = None  # NOTE: it holds the engine's graphs and pool too
                del engine
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                engine = ServeEngine(llm, replace(cfg, num_pages=(pool or 0) // cfg.page_size))
            row = run_prefix(engine, args.prefix_tokens, vocab)
        else:
            n, prompt, new = CASES[name]
            row, _ = run_case(engine, n, prompt, new, vocab, seed=i, sampling=(args.temperature, args.top_p))
        row["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None
        results["cases"][name] = row
        print(f"{name:<8} " + "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        if name != "prefix" or not own_pool:
            decoder = engine.decoder
            results["graph_captures"] = decoder.captures if decoder is not None else 0
            results["graph_replays"] = decoder.replays if decoder is not None else 0
        path = write_results(args.name, results)  # after every case: a cut-short run keeps its rows
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
