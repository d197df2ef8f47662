"""The two sides of `bench/kvpress_compare.py`, each run in its own interpreter: the kvtier side
(the project's venv: builds the prompts, runs kvtier's eviction policies over its tiered store)
and the kvpress side (a venv with `kvpress`: its presses through its text-generation pipeline).
Each imports its libraries inside its functions, so either interpreter can import this module."""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.kvpress_rows import METHODS, method_runs, result_row

EOS = 2  # <|im_end|> of SmolLM2-Instruct; kvpress's pipeline stops at generation_config.eos_token_id


# ----------------------------------------------------------------------------- kvtier side


def model_folder() -> Path:
    from kvtier.loading.embedded import embedded_gguf_path
    from kvtier.loading.gguf import gguf_to_hf_folder

    return Path(gguf_to_hf_folder(embedded_gguf_path()))


def build_prompts(lengths: list[int], samples: list[str], depths: list[float] | None) -> list[dict[str, Any]]:
    """The prompts of bench/policy_quality.py, as token ids (context, question) per sample/depth/length."""
    import transformers

    from bench.policy_quality import SAMPLES, build_prompt

    tok = transformers.AutoTokenizer.from_pretrained(model_folder())
    prompts = []
    for sample in [s for s in SAMPLES if s.name in samples]:
        for depth in depths or [sample.depth]:
            placed = replace(sample, depth=depth)
            for length in lengths:
                ctx, question = build_prompt(tok, placed, length)
                prompts.append(
                    {
                        "id": f"{sample.name}@{depth:g}/{length}",
                        "sample": sample.name,
                        "depth": depth,
                        "target": length,
                        "answer": sample.answer,
                        "context_ids": ctx,
                        "question_ids": question,
                    }
                )
    return prompts


def run_kvtier(prompts: list[dict[str, Any]], args: argparse.Namespace, sink: Path) -> list[dict[str, Any]]:
    import torch

    from bench.policy_quality import FanOut
    from kvtier.kv.store import StoreOptions, TieredKVStore
    from kvtier.loading.weights import load_safetensors_folder
    from kvtier.methods import build_policy
    from kvtier.planner.placement import KVPlan
    from kvtier.policies import PolicyParts
    from kvtier.policies.evict import SnapKVEvictor
    from kvtier.policies.scoring import ScoringKernel

    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    model, cfg = load_safetensors_folder(model_folder(), cpu, torch.float32)
    runs = method_runs("kvtier", args.budgets, args.methods)
    rows: list[dict[str, Any]] = []
    for prompt in prompts:
        ctx, question = prompt["context_ids"], prompt["question_ids"]
        capacity = len(ctx) + len(question) + args.max_new + 1
        plan = KVPlan("gpu", 1, cfg.num_layers * cfg.num_kv_heads, len(ctx), 0, 0)
        stores = []
        for method, budget in runs:
            spec = METHODS[method]
            parts = build_policy(
                cfg,
                kv_quant=None,
                evict=spec.get("evict"),
                kv_budget=budget,
                attention=None,
                head_sparsity=None,
                device=cpu,
            )
            if spec.get("evict") == "snapkv" and budget is not None:  # the observation window
                scorer = SnapKVEvictor(budget, window=int(spec["window"]))
                parts = PolicyParts(kernel=ScoringKernel(scorer), evictor=scorer, describe=parts.describe)
            stores.append(
                TieredKVStore(
                    cfg,
                    plan,
                    device=cpu,
                    dtype=torch.float32,
                    capacity=capacity,
                    options=StoreOptions(block_size=64),
                    **parts.store_kwargs(),
                )
            )
        t0 = time.time()
        with torch.inference_mode():
            for store in stores:
                store.begin_step(len(ctx))
            model(torch.tensor(ctx), FanOut(stores))
            for store in stores:
                store.end_step()
        print(f"[kvtier] {prompt['id']}: shared prefill {time.time() - t0:.0f}s", flush=True)
        for (method, budget), store in zip(runs, stores, strict=True):
            t1 = time.time()
            kept = max(store.slice_length)
            with torch.inference_mode():
                logits = None
                for t in question:  # the question: decode steps after the compression
                    store.begin_step(1)
                    logits = model(torch.tensor([t]), store)
                    store.end_step()
                assert logits is not None
                out: list[int] = []
                for _ in range(args.max_new):
                    nxt = int(logits[-1].argmax())
                    if nxt == EOS:
                        break
                    out.append(nxt)
                    store.begin_step(1)
                    logits = model(torch.tensor([nxt]), store)
                    store.end_step()
            store.close()
            row = result_row(prompt, method, budget, str(model_tok().decode(out)), kept_context_tokens=kept)
            row["seconds"] = round(time.time() - t1, 2)
            rows.append(row)
            print(f"  {method:42s} B={budget!s:5s} {row['correct']!s:5s} {row['answer']!r}", flush=True)
        sink.write_text(json.dumps(rows, indent=1))
    return rows


_TOK: Any = None


def model_tok() -> Any:
    global _TOK
    if _TOK is None:
        import transformers

        _TOK = transformers.AutoTokenizer.from_pretrained(model_folder())
    return _TOK


# ----------------------------------------------------------------------------- kvpress side


def run_kvpress(prompts: list[dict[str, Any]], args: argparse.Namespace, sink: Path) -> list[dict[str, Any]]:
    import torch
    from kvpress import KeyRerotationPress, SnapKVPress, StreamingLLMPress
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    folder = args.model_folder
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(folder)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")  # type: ignore[call-overload]
    current: dict[str, Any] = {}

    def preprocess(context: str, **_: Any) -> dict[str, Any]:
        # The pipeline's own preprocess would wrap the context in the chat template; feed the
        # exact token ids of the kvtier side instead (prompt construction is not under test).
        return {
            "context_ids": torch.tensor([current["context_ids"]]),
            "questions_ids": [torch.tensor([current["question_ids"]])],
        }

    pipe.preprocess = preprocess
    runs = method_runs("kvpress", args.budgets, args.methods)
    rows: list[dict[str, Any]] = []
    for prompt in prompts:
        current.update(prompt)
        n = len(prompt["context_ids"])
        for method, budget in runs:
            spec = METHODS[method]
            ratio = 0.0 if budget is None else 1 - (budget + 0.5) / n
            press: Any = None
            if spec.get("press") == "snapkv":
                press = SnapKVPress(compression_ratio=ratio, window_size=int(spec["window"]))
            elif spec.get("press") == "streaming":
                press = StreamingLLMPress(compression_ratio=ratio)
            elif spec.get("press") == "streaming-rerotate":
                press = KeyRerotationPress(press=StreamingLLMPress(compression_ratio=ratio))
            cache = DynamicCache()
            t1 = time.time()
            with torch.inference_mode():
                answer = pipe(
                    "(context given as token ids)",
                    question="",
                    press=press,
                    cache=cache,
                    max_new_tokens=args.max_new,
                )["answer"]
            kept = cache.get_seq_length()  # the pipeline trims the answer back off the cache
            assert kept == (budget if budget is not None else n), (method, budget, kept)
            row = result_row(prompt, method, budget, answer, kept_context_tokens=kept)
            row["compression_ratio"] = round(ratio, 6)
            row["seconds"] = round(time.time() - t1, 2)
            rows.append(row)
            print(f"  {method:42s} B={budget!s:5s} {row['correct']!s:5s} {answer!r}", flush=True)
        print(f"[kvpress] {prompt['id']} done", flush=True)
        sink.write_text(json.dumps(rows, indent=1))
    return rows


def versions() -> dict[str, str]:
    import torch
    import transformers

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        from importlib.metadata import version

        out["kvpress"] = version("kvpress")
    except Exception:  # not installed on the kvtier side
        pass
    return out
