"""Needle / pass-key quality of every KV policy at equal budgets, on the embedded SmolLM2-135M.

Protocol (Quest's): the context (instruction, filler, needle, filler) is prefilled in one chunk,
then the question is fed token by token as decode steps, then up to `--max-new` tokens are
generated greedily; correct = the first integer of the answer equals the needle's. So neither
eviction nor Quest sees the question before it decides what to keep or read.

The prefill is shared: one model forward whose attention fans out to every policy's store. With
the prompt in one chunk every policy attends densely during prefill (codecs and evictors act at
`end_step`), so each store receives exactly the KV it would get alone; the hidden states come
from the lossless store. Decoding is separate per policy.

    .venv/bin/python bench/policy_quality.py --lengths 2048 4096 --budget 512 \
        --out bench/results/policy_quality_smollm2.json

NOTE: torch's default thread count spin-waits when the cores are shared; one thread was ~12x
faster per decode step on the 2 shared cores this ran on.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.methods import build_policy
from kvtier.planner.placement import KVPlan
from kvtier.policies import PolicyParts
from kvtier.policies.quest import QuestKernel

CPU = torch.device("cpu")
INTRO = "There is important info hidden inside a lot of irrelevant text. Find it and memorize it.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass(frozen=True)
class Sample:
    name: str
    needle: str
    question: str
    answer: str
    depth: float  # where the needle sits in the filler, 0..1


SAMPLES = (
    Sample(
        "lucky-42",
        "The lucky number is 42. Remember it. 42 is the lucky number. ",
        "\nWhat is the lucky number? The lucky number is",
        "42",
        0.5,
    ),
    Sample(
        "passkey-68423",
        "The pass key is 68423. Remember it. 68423 is the pass key. ",
        "\nWhat is the pass key? The pass key is",
        "68423",
        0.3,
    ),
)

POLICIES: dict[str, dict[str, object]] = {
    "lossless": {},
    "int8": {"kv_quant": "int8"},
    "int4": {"kv_quant": "int4"},
    "fp8": {"kv_quant": "fp8"},
    "streaming": {"evict": "streaming", "budget": True},
    "h2o": {"evict": "h2o", "budget": True},
    "snapkv": {"evict": "snapkv", "budget": True},
    "window": {"evict": "window", "budget": True},
    "quest": {"attention": "quest", "budget": True},
    "quest-page4": {"attention": "quest", "budget": True, "page": 4},
    "head-sparsity-50": {"head_sparsity": 0.5, "budget": True},
}


class FanOut:
    """An `Attention` that appends to every store and returns the first store's output."""

    def __init__(self, stores: list[TieredKVStore]) -> None:
        self.stores = stores

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.stores[0](layer, q, k, v)
        for store in self.stores[1:]:
            store(layer, q, k, v)
        return out


def build_prompt(tok: object, sample: Sample, tokens: int) -> tuple[list[int], list[int]]:
    """Context ids of about `tokens` tokens (question included), and the question's ids."""

    def enc(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    fixed = len(enc(INTRO + sample.needle + sample.question))
    reps = max(2, (tokens - fixed) // len(enc(FILLER)))
    before = round(reps * sample.depth)
    context = INTRO + FILLER * before + sample.needle + FILLER * (reps - before)
    return enc(context), enc(sample.question)


def kv_stats(store: TieredKVStore, parts: PolicyParts) -> dict[str, int]:
    lay = store.layout
    stored = sum(store.slice_length) * lay.token_bytes
    out = {
        "stored_kv_bytes": stored,
        "gpu_allocated": store.account.allocated["gpu"],
        "host_allocated": store.account.allocated["host"],
        "gpu_peak": store.account.peak["gpu"],
    }
    codec = parts.codec
    if codec is not None and hasattr(codec, "packed_bytes"):
        heads = lay.num_layers * lay.num_kv_heads
        out["packed_kv_bytes"] = codec.packed_bytes(store.length, heads, lay.head_dim, 4)
    return out


def _short(answer: object) -> str:
    text = str(answer).replace("<|im_end|>", " <eos>").split("<|im_start|>")[0]
    return text.strip().replace("\n", " ").replace("|", "/")[:18]


def render(rows: list[dict[str, object]]) -> str:
    """A markdown table: one row per policy, a column per (sample, length); memory at 4K-ish."""
    cols = sorted({(str(r["sample"]), int(str(r["tokens"]))) for r in rows}, key=lambda c: (c[1], c[0]))
    for r in rows:
        budgeted = "budget" in POLICIES.get(str(r["policy"]), {})
        r["label"] = f"{r['policy']} (B={r['budget']})" if budgeted else r["policy"]
    policies = list(dict.fromkeys(str(r["label"]) for r in rows))
    head = [
        "policy",
        *[f"{s} @ {n}" for s, n in cols],
        f"KV stored @ {max(c[1] for c in cols)} (MiB)",
        "GPU-tier alloc (MiB)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    longest = max(c[1] for c in cols)
    mib = 1 << 20
    for p in policies:
        cells = [p]
        for s, n in cols:
            hit = next((r for r in rows if r["label"] == p and r["sample"] == s and r["tokens"] == n), None)
            cells.append(
                "-"
                if hit is None
                else ("**ok**" if hit["correct"] else "miss") + f" `{_short(hit['answer'])}`"
            )
        big = [r for r in rows if r["label"] == p and r["tokens"] == longest]
        if big:
            top = big[0]
            stored = int(str(top.get("packed_kv_bytes", top["stored_kv_bytes"])))
            cells += [
                f"{stored / mib:.1f}" + (" packed" if "packed_kv_bytes" in top else ""),
                f"{int(str(top['gpu_allocated'])) / mib:.1f}",
            ]
        else:
            cells += ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--samples", nargs="+", default=[s.name for s in SAMPLES])
    ap.add_argument("--max-new", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("bench/results/policy_quality_smollm2.json"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on shared cores)")
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    ap.add_argument("--append", action="store_true", help="add rows to --out instead of replacing it")
    args = ap.parse_args()
    if args.table:
        print(render(json.loads(args.out.read_text())["rows"]))
        return
    torch.set_num_threads(args.threads)

    import transformers

    from kvtier.loading.embedded import embedded_gguf_path
    from kvtier.loading.gguf import gguf_to_hf_folder
    from kvtier.loading.weights import load_safetensors_folder

    folder = gguf_to_hf_folder(embedded_gguf_path())
    model, cfg = load_safetensors_folder(folder, CPU, torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    before = json.loads(args.out.read_text()) if args.append else {}
    rows: list[dict[str, object]] = before.get("rows", [])
    # every command whose rows the file holds, this one last
    commands = [*before.get("commands", []), " ".join(["bench/policy_quality.py", *sys.argv[1:]])]
    for sample in [s for s in SAMPLES if s.name in args.samples]:
        for length in args.lengths:
            ctx, question = build_prompt(tok, sample, length)
            total = len(ctx) + len(question)
            capacity = total + args.max_new + 1
            plan = KVPlan("gpu", 1, cfg.num_layers * cfg.num_kv_heads, len(ctx), 0, 0)
            parts_by_name, stores = {}, []
            for name in args.policies:
                spec = dict(POLICIES[name])
                budget = args.budget if spec.pop("budget", False) else None
                parts = build_policy(
                    cfg,
                    kv_quant=spec.get("kv_quant"),  # type: ignore[arg-type]
                    evict=spec.get("evict"),  # type: ignore[arg-type]
                    kv_budget=budget,
                    attention=spec.get("attention"),  # type: ignore[arg-type]
                    head_sparsity=spec.get("head_sparsity"),  # type: ignore[arg-type]
                    device=CPU,
                    model=model,
                )
                if "page" in spec:  # Quest with smaller pages: a tighter bound, more metadata
                    page = int(str(spec["page"]))
                    parts = replace(
                        parts,
                        kernel=QuestKernel(budget or 0, page=page),
                        describe=f"{parts.describe} page {page}",
                    )
                parts_by_name[name] = parts
                opts = StoreOptions(block_size=64)
                stores.append(
                    TieredKVStore(
                        cfg,
                        plan,
                        device=CPU,
                        dtype=torch.float32,
                        capacity=capacity,
                        options=opts,
                        **parts.store_kwargs(),
                    )
                )
            t0 = time.time()
            ids = torch.tensor(ctx)
            for store in stores:
                store.begin_step(len(ctx))
            model(ids, FanOut(stores))
            for store in stores:
                store.end_step()
            prefill_s = time.time() - t0
            print(f"{sample.name} {total} tokens: shared prefill {prefill_s:.0f}s", flush=True)
            for name, store in zip(args.policies, stores, strict=True):
                parts = parts_by_name[name]
                mem = kv_stats(store, parts)
                t1 = time.time()
                logits = None
                for t in question:
                    store.begin_step(1)
                    logits = model(torch.tensor([t]), store)
                    store.end_step()
                out: list[int] = []
                assert logits is not None
                for _ in range(args.max_new):
                    nxt = int(logits[-1].argmax())
                    out.append(nxt)
                    store.begin_step(1)
                    logits = model(torch.tensor([nxt]), store)
                    store.end_step()
                text = str(tok.decode(out))
                found = re.search(r"\d+", text)
                row = {
                    "sample": sample.name,
                    "tokens": total,
                    "target": length,
                    "policy": name,
                    "describe": parts.describe,
                    "budget": args.budget,
                    "answer": text,
                    "correct": bool(found and found.group() == sample.answer),
                    "decode_s": round(time.time() - t1, 2),
                    **mem,
                }
                if isinstance(parts.kernel, QuestKernel) and parts.kernel.total_tokens:
                    row["quest_read_fraction"] = round(
                        parts.kernel.read_tokens / parts.kernel.total_tokens, 4
                    )
                rows.append(row)
                print(f"  {name:18s} {row['correct']!s:5s} {text!r}", flush=True)
                store.close()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            result = {"commands": commands, "model": "SmolLM2-135M-Instruct", "rows": rows}
            args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
