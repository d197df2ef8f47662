"""One long prompt through `LLM.generate`'s batch engine: prefill time by step size and attention
kernel, beside the tiered store's resident path (`--kv gpu`) on the same `LLM`.

On the H200 one 16K SmolLM2 prompt prefilled at 241K tok/s through the batch engine against 461K
through the tiered store (`bench/results/hip_small_prefill_paths.json`): two chunks of 8,192
against one of 16K, and flash's kernel (39 ms) against cuDNN's (21.5 ms). This separates the two.
Per (length, variant): one warm-up generate (kernels compiled, cuDNN graphs built), then
`--repeats` timed ones; prefill is the time to the first token.

    python bench/batched_prefill.py --model smollm2-135m --lengths 16K,32K
    python bench/batched_prefill.py --device cpu --model smollm2-135m --lengths 2K --repeats 1

Results: $OUT/batched_prefill.json (else bench/results/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from bench.hip_small_prefill import prompt_ids
from kvtier.engine.batched import batch_step_tokens, generate_batched
from kvtier.engine.llm import LLM
from kvtier.engine.prompts import Prompt
from kvtier.engine.sampling import SamplingParams
from kvtier.methods.spec import parse_choice
from kvtier.units import parse_count


def timed(llm: LLM, ids: list[int], params: SamplingParams, variant: str, repeats: int) -> dict[str, Any]:
    """Warm-up plus `repeats` runs of one variant: "gpu" (the tiered store's resident path),
    "planned" (the library's default: `batch_step_tokens`, cuDNN) or "<tokens>,<flash|cudnn>"."""
    prompts: list[Prompt] = [ids]
    method = parse_choice("auto")

    def once() -> tuple[float, dict[str, Any]]:
        if variant == "gpu":
            out = llm.generate(prompts, params, method="gpu")[0]
        else:
            tokens, cudnn = None, True
            if variant != "planned":
                size, kernel = variant.split(",")
                tokens, cudnn = int(size), kernel == "cudnn"
            done = generate_batched(llm, prompts, [ids], params, False, method, tokens, cudnn)
            assert done is not None, "the prompt did not fit the batch engine's pool"
            out = done[0]
        return out.stats.prefill_s, out.stats.plan

    once()
    runs = [once() for _ in range(repeats)]
    prefill = statistics.median(s for s, _ in runs)
    return {
        "variant": variant,
        "prompt_tokens": len(ids),
        "prefill_s": [round(s, 4) for s, _ in runs],
        "prefill_tokens_per_s": round(len(ids) / prefill, 1),
        "plan": runs[-1][1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a preset (random weights) or path; default: embedded")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--lengths", default="16K,32K", help="prompt lengths in tokens (comma list)")
    ap.add_argument(
        "--variants",
        default="gpu;planned;8192,flash;8192,cudnn;16384,flash;16384,cudnn;32768,cudnn",
        help="';'-separated: gpu, planned, or <step tokens>,<flash|cudnn>",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="batched_prefill")
    args = ap.parse_args()
    lengths = [parse_count(x, "--lengths") for x in args.lengths.split(",")]
    llm = LLM(args.model, device=args.device, max_model_len=max(lengths) + 64)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cases = []
    for length in lengths:
        ids = prompt_ids(llm, length)
        planned = batch_step_tokens(llm, [ids], params, parse_choice("auto"))
        for variant in [v for v in args.variants.split(";") if v]:
            case = {**timed(llm, ids, params, variant, args.repeats), "planned_step_tokens": planned}
            cases.append(case)
            print(f"{length:>7} {variant:<14} {case['prefill_tokens_per_s']:>10.0f} tok/s", flush=True)
    path = write_results(
        args.name,
        {
            "model": args.model or "embedded SmolLM2-135M-Instruct",
            "device": str(llm.device),
            "note": "random prompt ids for a preset; prefill = time to the first token, median",
            "cases": cases,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
