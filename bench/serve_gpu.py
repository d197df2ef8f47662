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

import gc
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from bench.serve_cases import CASES, SPECIAL, run_case, run_prefix
from bench.serve_gpu_args import parser
from bench.serve_mixed import run_mixed
from kvtier.engine.llm import LLM
from kvtier.errors import ConfigError
from kvtier.loading.resolve import read_model_config
from kvtier.methods import parse_choice
from kvtier.serve.engine import ServeConfig, ServeEngine
from kvtier.serve.server import freeze_heap
from kvtier.units import parse_size


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


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
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
