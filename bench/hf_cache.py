"""HF transformers' own model over kvtier's tiered store (`kvtier.hf.TieredCache`), against HF's
layer-wise offload (`DynamicCache(offloading=True)`) and kvtier's own runner, in one run.

One set of weights (a preset's shapes with random weights, default llama-3-8b, or an HF folder
given with --model; bf16 on CUDA) is loaded by kvtier and shared with an HF
`AutoModelForCausalLM` built on the meta device, so the weights are in GPU memory once. The process is capped
to `--gpu-memory` (as `kvtier generate --gpu-memory` caps it). For each context, each system:
prefill tok/s (chunked where the system allows it), decode s/token (median of the steps after
the first), peak GPU memory, or the error it stopped with.

    python bench/hf_cache.py --contexts 32K,128K --gpu-memory 24GiB --kv auto     # the H200 run
    python bench/hf_cache.py --preset smollm2-135m --contexts 1K --kv head --decode-steps 4 \
        --systems hf-kvtier,hf-offloaded,hf-dynamic,kvtier --name hf_cache_cpu        # CPU check

Systems (`--systems`): `hf-kvtier` (HF model + TieredCache, prompt fed by `prefill_in_chunks`
in the plan's chunks), `hf-offloaded` (HF model + `DynamicCache(offloading=True)`: one forward,
then `--hf-chunk` chunks if that runs out of memory; CUDA only), `hf-dynamic` (HF's default
cache, one forward) and `kvtier` (`kvtier.LLM.generate` with the same method spec).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, write_results
from kvtier import LLM, SamplingParams
from kvtier.errors import KvtierError
from kvtier.loading.presets import PRESETS
from kvtier.units import parse_count, parse_size

SYSTEMS = ("hf-kvtier", "hf-offloaded", "hf-dynamic", "kvtier")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def fresh_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def peaks(device: torch.device) -> dict[str, int | None]:
    """Peak bytes allocated to tensors and reserved by the caching allocator since the last
    `fresh_peak`; the cap applies to the reserved ones (what fragmentation adds)."""
    reserved = int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None
    return {"peak_gpu_bytes": peak(device), "peak_reserved_bytes": reserved}


def oom_text(e: torch.OutOfMemoryError) -> str:
    """The error's first line, whole: it says how much PyTorch had allocated and reserved."""
    return str(e).splitlines()[0]


def hf_model(llm: LLM, spec: str) -> Any:
    """An HF causal LM of `spec`'s config (a preset or an HF folder) whose parameters *are*
    kvtier's (no copy)."""
    import transformers

    if spec in PRESETS:
        fields = dict(PRESETS[spec])
        cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        cfg = transformers.AutoConfig.from_pretrained(spec)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.load_state_dict(llm.model.state_dict(), assign=True, strict=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # NOTE: the RoPE buffers are not parameters; built on the device (5.24 dropped `device=`).
    with llm.device:
        model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    return model.eval()


def decode_loop(
    model: Any, token: torch.Tensor, steps: int, device: torch.device, **cache: Any
) -> tuple[list[float], list[int]]:
    """`steps` greedy forwards of one token; their times and the tokens."""
    times, tokens = [], []
    for _ in range(steps):
        dt, out = timed(device, lambda: model(token, use_cache=True, **cache))
        token = out.logits[:, -1:].argmax(-1)
        times.append(dt)
        tokens.append(int(token))
    return times, tokens


def run_hf_kvtier(
    model: Any, ids: torch.Tensor, args: argparse.Namespace, device: torch.device, row: dict[str, Any]
) -> None:
    """Fills `row`; the plan and its GPU terms go in first, so a run that fails keeps them."""
    import kvtier.hf
    from kvtier.planner.memory import GPU_RESERVE_BYTES, hf_activation_bytes, weight_bytes

    n = ids.shape[1]
    cache = kvtier.hf.TieredCache(
        model, kv=args.kv, gpu_memory=args.gpu_memory, context=n + args.decode_steps + 1
    )
    key = kvtier.hf.cache_keyword(model)
    p, cfg, b = cache.plan, cache.model_config, torch.empty((), dtype=cache.dtype).element_size()
    row["plan"] = cache.describe()
    row["planned_gpu_bytes"] = {
        "weights": weight_bytes(cfg, b),
        "activations": hf_activation_bytes(cfg, p.chunk_size, b, group_size=p.group_size, context=p.context),
        "kv": p.gpu_kv_bytes,
        "reserve": GPU_RESERVE_BYTES,
    }
    try:
        with torch.inference_mode():

            def prefill() -> Any:
                kvtier.hf.prefill_in_chunks(model, cache, ids)
                return model(ids[:, -1:], use_cache=True, **{key: cache})

            dt, out = timed(device, prefill)
            row.update(prefill_tok_s=n / dt, prefill_mode=f"chunks of {cache.plan.chunk_size}")
            times, tokens = decode_loop(
                model, out.logits[:, -1:].argmax(-1), args.decode_steps, device, **{key: cache}
            )
        row.update(decode_s_per_token=median(times[1:] or times), decode_steps_s=times, tokens=tokens)
        row["store_peak_bytes"] = dict(cache.store.account.peak)
    finally:
        cache.close()


def cache_keyword(model: Any) -> str:
    from kvtier.hf import cache_keyword as keyword

    return keyword(model)


def prefill_dynamic(model: Any, ids: torch.Tensor, chunk: int, cache: dict[str, Any]) -> Any:
    out = None
    for s in range(0, ids.shape[1], chunk):
        out = model(ids[:, s : s + chunk], use_cache=True, logits_to_keep=1, **cache)
    return out


def run_hf_dynamic(
    model: Any, ids: torch.Tensor, args: argparse.Namespace, device: torch.device, offloading: bool
) -> dict[str, Any]:
    from transformers import DynamicCache

    if offloading and device.type != "cuda":
        return {"skipped": "DynamicCache(offloading=True) needs CUDA"}
    # NOTE: HF's own SDPA path and masks, as without kvtier (a TieredCache switched it to "kvtier").
    model.set_attn_implementation("sdpa")
    n = ids.shape[1]
    row: dict[str, Any] = {}
    key = cache_keyword(model)
    modes = [("one forward", n)] + ([(f"chunks of {args.hf_chunk}", args.hf_chunk)] if offloading else [])
    for mode, chunk in modes:
        cache = {key: DynamicCache(config=model.config, offloading=offloading)}
        try:
            with torch.inference_mode():
                dt, out = timed(device, lambda: prefill_dynamic(model, ids, chunk, cache))
                row.update(prefill_tok_s=n / dt, prefill_mode=mode)
                token = out.logits[:, -1:].argmax(-1)
                times, tokens = decode_loop(model, token, args.decode_steps, device, **cache)
            row.update(decode_s_per_token=median(times[1:] or times), decode_steps_s=times, tokens=tokens)
            row.update(peaks(device))  # NOTE: before the finally below resets the peaks
            return row
        except torch.OutOfMemoryError as e:
            row[f"oom_{mode}"] = oom_text(e)
            row.update(peaks(device))
        finally:
            cache.clear()  # NOTE: frees the KV before the next mode or system
            fresh_peak(device)
    row["oom"] = "every prefill mode ran out of memory"
    return row


def run_kvtier(llm: LLM, ids: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.decode_steps + 1, ignore_eos=True)
    out = llm.generate(ids[0].tolist(), params, method=args.kv)[0]
    s = out.stats
    return {
        "plan": s.plan,
        "prefill_tok_s": s.prompt_tokens / s.prefill_s,
        "prefill_mode": f"chunks of {s.plan.get('chunk_size')}",
        "decode_s_per_token": s.decode_s / max(1, s.generated_tokens - 1),
        "tokens": out.token_ids[1:],
        "store_peak_bytes": s.peak_bytes,
    }


def run(system: str, llm: LLM, model: Any, ids: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    device = llm.device
    fresh_peak(device)
    row: dict[str, Any] = {"system": system, "context": ids.shape[1]}
    try:
        if system == "hf-kvtier":
            run_hf_kvtier(model, ids, args, device, row)
        elif system in ("hf-offloaded", "hf-dynamic"):
            row.update(run_hf_dynamic(model, ids, args, device, offloading=system == "hf-offloaded"))
        else:
            row.update(run_kvtier(llm, ids, args))
        if "peak_gpu_bytes" not in row:
            row.update(peaks(device))
    except torch.OutOfMemoryError as e:
        row["oom"] = oom_text(e)
        row.update(peaks(device))  # the peaks up to the failed allocation
    except KvtierError as e:
        row["error"] = str(e)
    fresh_peak(device)
    return row


def compare(rows: list[dict[str, Any]]) -> None:
    """The issue's targets per context: hf-kvtier decode vs hf-offloaded (>= 5x faster) and vs
    kvtier's own runner (within 1.3x)."""
    by = {(r["context"], r["system"]): r for r in rows}
    for (context, system), r in by.items():
        if system != "hf-kvtier" or "decode_s_per_token" not in r:
            continue
        for other, key in (("hf-offloaded", "speedup_vs_hf_offloaded"), ("kvtier", "slowdown_vs_kvtier")):
            o = by.get((context, other), {}).get("decode_s_per_token")
            if o:
                ratio = (
                    o / r["decode_s_per_token"] if other == "hf-offloaded" else r["decode_s_per_token"] / o
                )
                r[key] = ratio
        k = by.get((context, "kvtier"), {}).get("tokens")
        if k is not None:
            r["same_tokens_as_kvtier"] = k == r.get("tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3-8b", choices=sorted(PRESETS))
    ap.add_argument("--model", default=None, help="an HF folder instead of --preset")
    ap.add_argument("--contexts", default="32K,128K")
    ap.add_argument("--gpu-memory", default="24GiB", help="process cap and planner budget (CUDA)")
    ap.add_argument(
        "--kv", default="auto", help="method spec for hf-kvtier and kvtier: auto, head, int4, ..."
    )
    ap.add_argument("--systems", default="hf-kvtier,hf-offloaded,kvtier")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument(
        "--hf-chunk", type=int, default=8192, help="hf-offloaded's prefill chunk after a one-forward OOM"
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--name", default="hf_cache")
    args = ap.parse_args()
    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        ap.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    contexts = [parse_count(c, "--contexts") for c in args.contexts.split(",")]
    cuda = torch.cuda.is_available() and args.device != "cpu"
    args.gpu_memory = parse_size(args.gpu_memory, "--gpu-memory") if cuda else None
    spec = args.model or args.preset
    llm = LLM(
        spec,
        device=args.device,
        gpu_memory=args.gpu_memory,
        max_model_len=max(contexts) + args.decode_steps + 1,
    )
    model = hf_model(llm, spec)
    rows: list[dict[str, Any]] = []
    for context in contexts:
        gen = torch.Generator(device=llm.device).manual_seed(context)
        ids = torch.randint(1, llm.model_config.vocab_size, (1, context), device=llm.device, generator=gen)
        for system in systems:
            rows.append(run(system, llm, model, ids, args))
            print(
                {k: v for k, v in rows[-1].items() if k not in ("decode_steps_s", "tokens", "plan")},
                flush=True,
            )
            compare(rows)
            # Rewritten after every row, so a run cut short by a time limit keeps what it measured.
            write_results(
                args.name,
                {"model": spec, "kv": args.kv, "gpu_budget_bytes": args.gpu_memory, "rows": rows},
            )
    path = write_results(
        args.name, {"model": spec, "kv": args.kv, "gpu_budget_bytes": args.gpu_memory, "rows": rows}
    )
    print(f"\nresults: {path}")
    head = f"{'peak GB':>8} {'resv GB':>8} {'prefill t/s':>11} {'decode s/t':>10}"
    print(f"{'context':>8} {'system':>13} {head}")
    for r in rows:
        failed = r.get("oom") or r.get("error") or r.get("skipped")
        if failed:
            print(f"{r['context']:>8} {r['system']:>13}   {failed[:90]}")
            continue
        keys = ("peak_gpu_bytes", "peak_reserved_bytes")
        gb, resv = (f"{r[k] / 1e9:.2f}" if r.get(k) else "-" for k in keys)  # None on the CPU
        speed = f"{r['prefill_tok_s']:>11.0f} {r['decode_s_per_token']:>10.4f}"
        print(f"{r['context']:>8} {r['system']:>13} {gb:>8} {resv:>8} {speed}")


if __name__ == "__main__":
    main()
