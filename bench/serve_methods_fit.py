"""Which requests naming a method a server under a GPU budget can serve, by length (issue 18).

On the H200 of 2026-12-05 a 304-token HiP request failed on `kvtier serve --gpu-memory 24GiB`
with Llama-3.1-8B shapes: HiP's decode memory, sized by its preset, was more than the GPU memory
the server keeps for stores of their own, and the batch kept every pool page
(`bench/results/gpu_smoke_serve.json`). This sends each request alone to the `ServeEngine`
(in this thread, no HTTP) and records whether it finished or its error, the pool pages it
borrowed, its wall time and the process's peak GPU memory against the budget.

    python bench/serve_methods_fit.py --gpu-memory 24GiB
    python bench/serve_methods_fit.py --device cpu --model <small HF folder> --cases "hip@64"  # a check

Random bf16 weights of a preset (no download), prompts of random token ids (synthetic data),
greedy, `--exact-lossless off` (so a short HiP request runs HiP). Writes
bench/results/serve_methods_fit.json (or --name).
"""

from __future__ import annotations

import argparse
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
from kvtier.loading.resolve import read_model_config
from kvtier.methods import parse_choice
from kvtier.serve.engine import ServeConfig, ServeEngine
from kvtier.units import parse_count

CASES = "hip,hip_preset=fast@304;hip@4400;hip@16K;hip@128K;quest,kv_budget=2048@128K;int4@128K;hip@256K"


def serve_one(engine: ServeEngine, spec: str, tokens: int, new: int, seed: int) -> dict[str, Any]:
    """One request of `tokens` random ids naming `spec`, alone: finished or its error."""
    ids = torch.randint(
        1, engine.llm.model_config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)
    )
    lent: list[int] = []
    out: list[Delta] = []
    placed: dict[str, Any] = {"path": "batch or its own store"}
    owned = engine.own_store_requests

    def sink(d: Delta) -> None:
        lent.append(engine.kv.pool.num_lent)
        for run in engine._tiered.values():  # alone: at most one
            kernel = getattr(run.store, "kernel", None)
            cache = getattr(getattr(kernel, "cfg", None), "cache_tokens", None)
            placed.update(
                path="tiered",
                group_size=run.plan.group_size,
                resident_slices=run.plan.resident_slices,
                num_slices=run.plan.num_slices,
                hip_cache_tokens=cache,
            )
        out.append(d)

    cuda = engine.device.type == "cuda"
    closing = sum(not f.done() for f, _ in engine._closing_runs)
    allocated = round(torch.cuda.memory_allocated(engine.device) / 1e9, 3) if cuda else None
    t0 = time.perf_counter()
    engine.submit(
        ids.tolist(), SamplingParams(max_tokens=new, ignore_eos=True), sink, method=parse_choice(spec)
    )
    engine.run_until_idle()
    seconds = time.perf_counter() - t0
    errors = [d.error for d in out if d.error]
    generated = sum(len(d.token_ids) for d in out)
    return {
        "method": spec,
        "prompt_tokens": tokens,
        "ok": not errors and generated == new,
        "generated": generated,
        "error": errors[0] if errors else None,
        "lent_pages_max": max(lent, default=0),
        "own_store": engine.own_store_requests > owned,
        "placement": placed,
        "seconds": round(seconds, 2),
        # sent at once after the one before, as a server sees them: that one's store may still
        # be being freed (on its launcher thread), and the plan must count what it holds
        "stores_being_freed_at_submit": closing,
        "allocated_at_submit_gb": allocated,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="preset or HF folder")
    ap.add_argument("--gpu-memory", default="24GiB", help="the server's GPU budget")
    ap.add_argument("--cases", default=CASES, help="';'-separated METHOD@TOKENS")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--name", default="serve_methods_fit")
    args = ap.parse_args()
    cases = [
        (spec, parse_count(n, "--cases")) for spec, _, n in (c.rpartition("@") for c in args.cases.split(";"))
    ]
    for spec, _ in cases:
        parse_choice(spec)  # NOTE: a typo fails here, not after loading the model
    longest = max(n for _, n in cases) + args.new_tokens
    trained = int(read_model_config(args.model).max_position_embeddings)
    cuda = args.device.startswith("cuda")
    llm = LLM(
        args.model,
        device=args.device,
        dtype="bf16" if cuda else "fp32",
        gpu_memory=args.gpu_memory if cuda else None,
        max_model_len=longest if longest > trained else None,
        exact_lossless=False,
    )
    engine = ServeEngine(llm, ServeConfig())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rows: list[dict[str, Any]] = []
    end: dict[str, Any] = {}  # what stays allocated with no request left (a leak shows there)
    budget = llm.gpu_budget()

    def save() -> Path:  # after every request: a run cut short keeps its rows
        peak = torch.cuda.max_memory_reserved() if cuda else 0
        return write_results(
            args.name,
            {
                "command": "bench/serve_methods_fit.py " + " ".join(sys.argv[1:]),
                "model": f"{args.model} (random weights)",
                "data": "synthetic: prompts of random token ids, greedy, ignore_eos; --exact-lossless off",
                "gpu_memory": args.gpu_memory if cuda else None,
                "pool_pages": engine.store.num_pages,
                "offload_gpu_budget": engine.offload_gpu_budget(),
                "peak_reserved_bytes": peak,
                "within_budget": budget is None or peak <= budget,
                "allocated_idle_gb": round(idle / 1e9, 3),
                **end,
                "rows": rows,
            },
        )

    idle = torch.cuda.memory_allocated(engine.device) if cuda else 0
    for i, (spec, tokens) in enumerate(cases):
        row = serve_one(engine, spec, tokens, args.new_tokens, seed=i)
        rows.append(row)
        shown = "ok" if row["ok"] else f"FAILED: {row['error']}"
        lent = row["lent_pages_max"]
        print(f"{spec:<32} {tokens:>8} lent {lent:>4} {row['seconds']:>7.1f} s  {shown}", flush=True)
        path = save()
    for freed, _ in engine._closing_runs:  # the last store, freed on the launcher thread
        freed.result(timeout=120)
    if cuda:
        left = torch.cuda.memory_allocated(engine.device)
        print(f"allocated with no request left {left / 1e9:.3f} GB, before the first {idle / 1e9:.3f} GB")
        end["allocated_at_end_gb"] = round(left / 1e9, 3)
        path = save()
    peak = torch.cuda.max_memory_reserved() if cuda else 0
    engine.shutdown()
    print(f"peak reserved {peak / 1e9:.2f} GB of {(budget or 0) / 1e9:.2f}; wrote {path}")


if __name__ == "__main__":
    main()
