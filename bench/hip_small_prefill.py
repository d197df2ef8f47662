"""HiP's prefill and decode speed on a small model, through `LLM.generate` (the CLI's path): issue
19 asks SmolLM2 HiP prefill on CUDA >= 0.5x dense at 16K, where per-slice host work used to
dominate (480-750 tok/s against dense's 12-20K).

The embedded SmolLM2-135M-Instruct, one `LLM` for every run (so Triton compiles once), prompts of
the eval's prose haystack cut to each length as token ids (the text is real; no question is
asked: this times the engine, `kvtier eval` scores it). Per (length, method): one warm-up
generate, then `--repeats` timed ones; the JSON keeps each run's stats and the medians.

    python bench/hip_small_prefill.py --lengths 4K,16K,32K --methods auto,hip,hip_preset=long
    python bench/hip_small_prefill.py --device cpu --lengths 1K --repeats 1   # a quick check

With `--gpu-memory` the runs take the tiered store's chunked prefill, as `kvtier generate
--gpu-memory` does (an 8B model's early 16K chunks, profiled beside lossless `auto`'s:
`--model llama-3-8b --lengths 48K --gpu-memory 24GiB --methods "auto;hip,hip_preset=fast"
--repeats 1 --profile`).

Results: $OUT/hip_small_prefill.json (else bench/results/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.engine.llm import LLM
from kvtier.engine.prompts import Prompt
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import CapacityError
from kvtier.eval.haystack import prose_text
from kvtier.units import parse_count


def prompt_ids(llm: LLM, length: int) -> list[int]:
    """`length` token ids of the prose haystack, repeated as often as it takes; seeded random
    ids for a model without a tokenizer (a preset's random weights)."""
    if llm.tokenizer is None:
        gen = torch.Generator().manual_seed(length)
        return torch.randint(0, llm.model_config.vocab_size, (length,), generator=gen).tolist()
    ids = llm.encode(prose_text())
    return (ids * (length // len(ids) + 1))[:length]


def profiled(llm: LLM, prompts: list[Prompt], params: SamplingParams, method: str) -> dict[str, Any]:
    """One more generate under the profiler (CUDA), of the prefill alone (one new token: the
    decode steps' kernels and host copies would mix in): GPU busy and idle time, the top kernels
    and host ops (`bench.prefill_profile.summarize`), and the prefill time under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from bench.prefill_profile import summarize

    params = replace(params, max_tokens=1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        stats = llm.generate(prompts, params, method=method)[0].stats
    return {"prefill_s_profiled": round(stats.prefill_s, 4), **summarize(prof)}


def run_case(
    llm: LLM, ids: list[int], method: str, new_tokens: int, repeats: int, profile: bool = False
) -> dict[str, Any]:
    """One warm-up and `repeats` timed generates of `ids` under `method` (`profile`: then one
    profiled, see `profiled`)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    prompts = cast(list[Prompt], [ids])
    llm.generate(prompts, params, method=method)  # warm-up: kernels compiled, caches filled
    runs: list[dict[str, Any]] = []
    for _ in range(repeats):
        stats = llm.generate(prompts, params, method=method)[0].stats
        runs.append(
            {
                "prefill_s": round(stats.prefill_s, 4),
                "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 1),
                "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
                "peak_bytes": stats.peak_bytes,
            }
        )
    plan = stats.plan
    extra = {"profile": profiled(llm, prompts, params, method)} if profile else {}
    return {
        **extra,
        "method": method,
        "prompt_tokens": len(ids),
        "new_tokens": new_tokens,
        "plan": {k: plan.get(k) for k in ("policy", "group_size", "chunk_size", "method")},
        "runs": runs,
        "prefill_tokens_per_s": statistics.median(float(r["prefill_tokens_per_s"]) for r in runs),
        "decode_tokens_per_s": statistics.median(float(r["decode_tokens_per_s"]) for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4K,16K,32K", help="prompt lengths in tokens (comma list)")
    ap.add_argument(
        "--methods",
        default="auto;hip,hip_preset=long;hip",
        help="method specs separated by ';' (default: auto;hip,hip_preset=long;hip)",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--model",
        default=None,
        help="default: the embedded SmolLM2; a preset such as smollm2-135m (random weights, random "
        "prompt ids: the same shapes without the GGUF)",
    )
    ap.add_argument(
        "--gpu-memory",
        default=None,
        help="the GPU budget, as kvtier generate's flag (default: none, where `auto` runs the batch engine)",
    )
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--profile", action="store_true", help="one more run per case under the profiler (CUDA): top kernels"
    )
    ap.add_argument("--name", default="hip_small_prefill")
    args = ap.parse_args()
    lengths = [parse_count(x, "--lengths") for x in args.lengths.split(",")]
    methods = [m for m in args.methods.split(";") if m]
    llm = LLM(
        args.model,
        device=args.device,
        max_model_len=max(lengths) + args.new_tokens + 64,
        gpu_memory=args.gpu_memory,
    )
    cases: list[dict[str, Any]] = []

    def save() -> Path:
        """Write the cases so far (after each one: a run the device call's limit cuts keeps them),
        each timed case with its speed against `auto`'s at its length."""
        timed = [c for c in cases if "error" not in c]
        dense = {c["prompt_tokens"]: c["prefill_tokens_per_s"] for c in timed if c["method"] == "auto"}
        for c in timed:
            if c["prompt_tokens"] in dense:
                c["prefill_vs_auto"] = round(c["prefill_tokens_per_s"] / dense[c["prompt_tokens"]], 3)
        return write_results(
            args.name,
            {
                "model": llm.name,
                "device": str(llm.device),
                "dtype": str(llm.dtype),
                "gpu_memory": args.gpu_memory,
                "note": "prompts: the eval's prose haystack cut to length (real text, no question); "
                "seeded random token ids for a preset without a tokenizer",
                "cases": cases,
            },
        )

    for length in lengths:
        ids = prompt_ids(llm, length)
        for method in methods:
            # what earlier cases left allocated: a request's store and caches are freed when it
            # ends, so anything here is held across requests (a 64K `fast` under 24 GiB ran out of
            # memory after `auto` in one process, 2026-12-07)
            held = torch.cuda.memory_allocated(llm.device) if llm.device.type == "cuda" else 0
            try:
                case = run_case(llm, ids, method, args.new_tokens, args.repeats, args.profile)
            except CapacityError as e:  # recorded, and the other cases still run
                print(f"{length:>7} {method:<24} failed: {e}", flush=True)
                cases.append({"method": method, "prompt_tokens": length, "error": str(e), "held_bytes": held})
                save()
                continue
            case["held_bytes"] = held
            cases.append(case)
            save()
            print(
                f"{length:>7} {method:<24} prefill {case['prefill_tokens_per_s']:>9.0f} tok/s  "
                f"decode {case['decode_tokens_per_s']:>7.1f} tok/s  plan {case['plan']}",
                flush=True,
            )
    path = save()
    print(f"wrote {path}")
    llm.close()


if __name__ == "__main__":
    main()
