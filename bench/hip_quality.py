"""Pass-key retrieval with the embedded SmolLM2-135M-Instruct (8K trained context): dense vs HiP.

Drives the model through `TieredKVStore` (gpu plan) with either the dense kernel or `HipKernel`
(context extension on: keys stored un-rotated, streaming positions in attention, relative /
chunk-indexed positions in pruning). Greedy, no chat template. Appends one record per sample
to the output JSON as it goes, so a long run that is stopped keeps what it finished.

    .venv/bin/python bench/hip_quality.py --lengths 4096 16384 --methods dense hip --samples 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine
from kvtier.attention.interface import DenseKernel, SliceKernel
from kvtier.config import ModelConfig
from kvtier.engine.runner import prefill
from kvtier.kv.store import TieredKVStore
from kvtier.loading.embedded import embedded_gguf_path
from kvtier.loading.gguf import gguf_to_hf_folder
from kvtier.loading.weights import load_safetensors_folder
from kvtier.model.llama import CausalLM
from kvtier.planner.placement import plan_kv
from kvtier.sparse import HipKernel, make_hip_kernel

CPU = torch.device("cpu")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HEAD = "There is important info hidden inside a lot of irrelevant text. Find it and memorize it.\n"
TAIL = "\nWhat is the pass key? The pass key is"
KEYS = (68423, 30917, 52786, 71294, 19650)
DEPTHS = (0.5, 0.2, 0.8, 0.35, 0.65)
# HiP variants: HipConfig overrides on top of --preset.
METHODS: dict[str, dict[str, object]] = {
    "hip": {},  # published defaults, context extension on
    "hip-noext": {"extend": False},  # keys rotated at true positions by the store
    "hip-softmax": {"head_score": "softmax"},  # not published: per-head softmax chunk scores
    "hip-perhead": {"per_head": True},  # one selection per KV head (HIP_HEAD_REDUCE=0)
}


def passkey_prompt(tokenizer: Any, length: int, depth: float, key: int) -> str:
    """The pass-key prompt of about `length` tokens with the key at `depth` (0 = start)."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = len(tokenizer(HEAD + needle + TAIL)["input_ids"])
    per = len(tokenizer(FILLER * 10)["input_ids"]) / 10
    n = max(2, int((length - fixed) / per))
    before = int(n * depth)
    return HEAD + FILLER * before + needle + FILLER * (n - before) + TAIL


def generate(
    model: CausalLM,
    cfg: ModelConfig,
    ids: torch.Tensor,
    kernel: SliceKernel,
    rotate: bool,
    chunk: int,
    n: int,
    group: int | None = None,
) -> tuple[list[int], float, float]:
    """Chunked prefill (the engine's loop: HiP gets the prompt's last token as a step of its own
    unless `last_query_alone=false`) + greedy decode of `n` tokens; returns tokens, prefill s,
    decode s. `group`: KV heads per store slice, so per HiP selection (None: a whole layer)."""
    ctx = ids.numel() + n
    policy = "auto" if group else "gpu"  # auto, unlimited: every slice of `group` heads resident
    plan = plan_kv(
        cfg, ctx, policy=policy, gpu_budget=None, dtype_bytes=4, chunk_size=chunk, group_size=group
    )
    store = TieredKVStore(
        cfg, plan, device=CPU, dtype=torch.float32, capacity=ctx, kernel=kernel, rotate_keys=rotate
    )
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = prefill(model, store, ids, chunk).logits[None]
        t1 = time.perf_counter()
        out: list[int] = []
        for _ in range(n):
            tok = logits[-1].argmax()
            out.append(int(tok))
            store.begin_step(1)
            logits = model(tok.view(1), store)
            store.end_step()
    store.close()
    return out, t1 - t0, time.perf_counter() - t1


def overrides(items: list[str]) -> dict[str, object]:
    """`field=1`, `field=1,2,3` (a tuple) or `field=word` -> HipConfig overrides."""
    out: dict[str, object] = {}
    for item in items:
        name, _, value = item.partition("=")
        parts = value.split(",")
        if all(p.lstrip("-").isdigit() for p in parts):
            out[name] = tuple(int(p) for p in parts) if len(parts) > 1 or value.endswith(",") else int(value)
        else:
            out[name] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: one row per (length, method): pass-key accuracy and mean prefill time."""
    rows = [
        "| prompt | method | correct | outputs | mean prefill s | mean decode s |",
        "|---|---|---|---|---|---|",
    ]
    seen: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        extra = " ".join(r.get("overrides", []))
        if r.get("preset") not in (None, "default"):
            extra = f"preset {r['preset']} {extra}".strip()
        seen.setdefault((r["length"], r["method"] + (f" ({extra})" if extra else "")), []).append(r)
    for (_, method), rs in sorted(seen.items()):
        ok = sum(r["correct"] for r in rs)
        outs = "; ".join(repr(r["output"].strip()) for r in rs)
        pre = sum(r["prefill_s"] for r in rs) / len(rs)
        dec = sum(r["decode_s"] for r in rs) / len(rs)
        rows.append(
            f"| {rs[0]['prompt_tokens']} | {method} | {ok}/{len(rs)} | {outs} | {pre:.0f} | {dec:.0f} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--methods", nargs="+", default=["dense", "hip"], help=f"dense, {', '.join(METHODS)}")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--first-sample", type=int, default=0, help="start at this (key, depth) pair")
    ap.add_argument("--preset", default="default")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("bench/results/hip_quality_smollm2.json"))
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="HipConfig override, e.g. budgets=32768,8192,512",
    )
    ap.add_argument("--table", action="store_true", help="print --out as a markdown table and exit")
    ap.add_argument(
        "--group", type=int, default=None, help="KV heads per slice: per HiP selection (default: a layer)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.out.read_text())["records"]))
        return
    torch.set_num_threads(args.threads)
    folder = gguf_to_hf_folder(embedded_gguf_path())
    model, cfg = load_safetensors_folder(folder, CPU, torch.float32)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for i in range(
        args.first_sample, args.first_sample + args.samples
    ):  # samples outermost: a stopped run has every length covered
        for length in args.lengths:
            key, depth = KEYS[i % len(KEYS)], DEPTHS[i % len(DEPTHS)]
            ids = torch.tensor(tok(passkey_prompt(tok, length, depth, key))["input_ids"])
            for method in args.methods:
                kernel: SliceKernel = DenseKernel()
                rotate = True
                if method != "dense":
                    kernel, unrot = make_hip_kernel(
                        cfg, CPU, args.preset, **METHODS[method], **overrides(args.set)
                    )
                    rotate = not unrot
                toks, pre_s, dec_s = generate(
                    model, cfg, ids, kernel, rotate, args.chunk, args.new_tokens, args.group
                )
                alone = getattr(kernel, "last_query_alone", False)
                text = str(tok.decode(toks))
                rec: dict[str, Any] = {
                    "length": length,
                    "prompt_tokens": ids.numel(),
                    "method": method,
                    "preset": args.preset if method != "dense" else None,
                    "overrides": args.set
                    + (["last_alone"] if alone else [])
                    + ([f"group={args.group}"] if args.group else [])
                    if method != "dense"
                    else [],
                    "depth": depth,
                    "passkey": key,
                    "output": text,
                    "correct": str(key) in text.split(".")[0],
                    "prefill_s": round(pre_s, 1),
                    "decode_s": round(dec_s, 1),
                }
                if isinstance(kernel, HipKernel):
                    st = kernel.stats
                    rec["mean_keys_per_query_block"] = round(st.attended_keys / max(1, st.prefill_blocks), 1)
                    rec["decode_recomputes"] = st.decode_recomputes
                print(json.dumps(rec), flush=True)
                doc = json.loads(args.out.read_text()) if args.out.exists() else {"records": []}
                doc["machine"] = machine()
                doc["records"].append(rec)
                args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
