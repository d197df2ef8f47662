"""How well a lossy method keeps decoding: a teacher-forced continuation, scored token by token.

NIAH and pass-key answers are a few tokens long, so they never see what a HiP decode does
between refreshes (a stage-0 rerun every 32 steps with `lean`, 96 with `flash`). Here a prompt of
`--context` tokens is prefilled, then the true next `--tokens` tokens are fed one decode step at
a time (teacher forcing: every method sees the same inputs), and each step's prediction of the
next true token is scored: its negative log-likelihood, whether its argmax is the true token,
and whether it is the first method's (the reference, lossless `auto` by default) argmax, in
buckets of `--bucket` steps (a stale selection shows as agreement falling between refreshes).

Texts (`--text`), from the essays bundled with the eval (`kvtier.eval.haystack.prose_text`):
- `copy`: the first `--copy-span` tokens of the essays, then the same tokens again, cut inside
  the second copy; the continuation is the rest of it. Predicting it means reading the first
  copy `--copy-span` tokens back, far outside HiP's window: the selection has to follow the
  source as it moves a token a step.
- `copy-entries`: the same with generated numbered entries (`bench.smoke_checks.prose`) as the
  text, as long as `--copy-span` asks: a copy from past lean's 32K stage-0 budget needs > 64K.
- `essays`: the essays themselves, continued where the prompt ends (local context dominates).

`--budget-scale K` divides the presets' stage budgets by K (sinks, window and chunks kept), so
that at a few thousand tokens HiP's stage 0 keeps a share of the middle like the one it keeps
at 1M (32K of ~1M); the JSON says so.

    python bench/hip_decode_fidelity.py --device cpu --budget-scale 8 \
        --methods "auto;hip,hip_preset=lean;hip,hip_preset=lean,hip_refresh=flash"
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from tqdm import tqdm

from bench.common import write_results


def texts(
    tokenizer: Any, kind: str, context: int, tokens: int, copy_span: int
) -> tuple[list[int], list[int]]:
    """The prompt ids [context] and the continuation ids [tokens] of a text kind."""
    from kvtier.eval.haystack import prose_text

    if kind == "copy-entries":  # numbered entries, as many as the copy needs (~2.6 tokens a word)
        from bench.smoke_checks import prose

        text = prose(int(copy_span / 2.2) + 200, seed=3)
    else:
        text = prose_text()
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if kind.startswith("copy"):
        if len(ids) < copy_span:
            raise SystemExit(f"{kind}: {len(ids)} tokens of text, fewer than --copy-span")
        last = 2 * copy_span - tokens
        if not copy_span < context <= last:
            raise SystemExit(f"--context must lie in ({copy_span}, {last}] for --text {kind}")
        ids = ids[:copy_span] * 2
    if context + tokens > len(ids):
        raise SystemExit(f"{kind}: {len(ids)} tokens of text, fewer than --context + --tokens")
    return ids[:context], ids[context : context + tokens]


def scale_budgets(k: int) -> dict[str, Any]:
    """Divide every HiP preset's stage budgets by k (in place: the stores read HIP_PRESETS)."""
    from kvtier.sparse import HIP_PRESETS

    for name, cfg in list(HIP_PRESETS.items()):
        budgets = tuple(max(c, b // k) for b, c in zip(cfg.budgets, cfg.chunk_sizes, strict=True))
        HIP_PRESETS[name] = replace(cfg, budgets=budgets, wide_budget=max(cfg.wide_budget // k, budgets[-1]))
    return {n: {"budgets": c.budgets, "wide_budget": c.wide_budget} for n, c in HIP_PRESETS.items()}


def run_method(llm: Any, spec: str, prompt: list[int], cont: list[int]) -> dict[str, Any]:
    """Prefill `prompt`, feed `cont` one decode step at a time; each prediction of the next
    true token: its log-probability, argmax, and the step's seconds."""
    from kvtier.engine.runner import prefill
    from kvtier.engine.tiered import plan_and_store

    method = llm.resolve_method(spec)
    plan, store, parts = plan_and_store(llm, len(prompt) + len(cont), method, len(cont))
    model, dev = llm.loaded.model, llm.device
    logprob, argmax, seconds = [], [], []
    try:
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = prefill(model, store, torch.tensor(prompt, device=dev), plan.chunk_size).logits
            prefill_s = time.perf_counter() - t0
            for i, true in enumerate(tqdm(cont, desc=spec, leave=False, file=sys.stderr)):
                lp = torch.log_softmax(logits.float(), dim=-1)
                logprob.append(float(lp[true]))
                argmax.append(int(lp.argmax()))
                if i + 1 == len(cont):
                    break
                t = time.perf_counter()
                store.begin_step(1)
                logits = model(torch.tensor([true], device=dev), store)[-1]
                store.end_step()
                seconds.append(time.perf_counter() - t)
    finally:
        store.close()
    return {"method": spec, "plan": parts.describe, "prefill_s": round(prefill_s, 2),
            "decode_step_s": round(sum(seconds) / max(len(seconds), 1), 4),
            "logprob": logprob, "argmax": argmax}  # fmt: skip


def score(row: dict[str, Any], ref: dict[str, Any], cont: list[int], bucket: int) -> dict[str, Any]:
    """NLL, accuracy against the true tokens and agreement with the reference, overall and by
    buckets of `bucket` steps."""
    n = len(cont)

    def part(lo: int, hi: int) -> dict[str, float]:
        lp, am, ra = row["logprob"][lo:hi], row["argmax"][lo:hi], ref["argmax"][lo:hi]
        return {
            "nll": round(-sum(lp) / len(lp), 4),
            "accuracy": round(sum(a == t for a, t in zip(am, cont[lo:hi], strict=True)) / len(lp), 4),
            "agreement": round(sum(a == b for a, b in zip(am, ra, strict=True)) / len(lp), 4),
        }

    whole = part(0, n)
    spans = [(lo, min(lo + bucket, n)) for lo in range(0, n, bucket)]
    buckets = [{"steps": [lo, hi], **part(lo, hi)} for lo, hi in spans]
    return {**whole, "perplexity": round(math.exp(whole["nll"]), 3), "by_bucket": buckets}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--methods", default="auto;hip,hip_preset=lean;hip,hip_preset=lean,hip_refresh=flash",
                    help="';'-separated method specs; the first is the reference")  # fmt: skip
    ap.add_argument("--text", choices=("copy", "copy-entries", "essays"), default="copy")
    ap.add_argument("--context", type=int, default=7000)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--copy-span", type=int, default=3700)
    ap.add_argument("--bucket", type=int, default=32)
    ap.add_argument("--budget-scale", type=int, default=1)
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--max-model-len", default=None, help="past the model's trained length (e.g. 80K)")
    ap.add_argument("--name", default="hip_decode_fidelity")
    args = ap.parse_args()
    from kvtier import LLM

    budgets = scale_budgets(args.budget_scale) if args.budget_scale > 1 else None
    from kvtier.units import parse_count

    longest = None if args.max_model_len is None else parse_count(args.max_model_len)
    kw = {"device": args.device, "gpu_memory": args.gpu_memory, "max_model_len": longest}
    llm = LLM(args.model, **{k: v for k, v in kw.items() if v is not None})
    prompt, cont = texts(llm.tokenizer, args.text, args.context, args.tokens, args.copy_span)
    rows = [run_method(llm, spec, prompt, cont) for spec in args.methods.split(";")]
    ref = rows[0]
    out = []
    for row in rows:
        scored = score(row, ref, cont, args.bucket)
        out.append({k: v for k, v in row.items() if k not in ("logprob", "argmax")} | scored)
        print(f"{row['method']:50s} nll {scored['nll']:.4f} acc {scored['accuracy']:.3f} "
              f"agree {scored['agreement']:.3f}  by {args.bucket}: "
              + " ".join(f"{b['agreement']:.2f}" for b in scored["by_bucket"]), flush=True)  # fmt: skip
    header = {"model": args.model or "embedded SmolLM2-135M", "device": str(llm.device), "text": args.text,
              "context": args.context, "tokens": args.tokens, "copy_span": args.copy_span,
              "budget_scale": args.budget_scale, "scaled_budgets": budgets, "reference": ref["method"],
              "rows": out}  # fmt: skip
    print(write_results(args.name, header))


if __name__ == "__main__":
    main()
