"""What `bench/kvpress_compare.py` compares and records, on either side: the methods (which side
runs each, and whether it runs per budget), the row one (prompt, method, budget) run writes, and
the accuracy and markdown table over rows. Standard library only: the kvpress side imports it
from another interpreter."""

from __future__ import annotations

import re
from typing import Any

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


def first_int(text: str) -> str | None:
    """The first integer in an answer (a run is correct when it equals the needle's)."""
    found = re.search(r"\d+", text)
    return found.group() if found else None


def result_row(
    prompt: dict[str, Any], method: str, budget: int | None, answer: str, **extra: Any
) -> dict[str, Any]:
    """The row of one (prompt, method, budget) run: the prompt's facts, the answer, whether it is
    correct, and the side's `extra` fields."""
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
        "correct": first_int(answer) == prompt["answer"],
        **extra,
    }


def method_runs(side: str, budgets: list[int], methods: list[str]) -> list[tuple[str, int | None]]:
    """The (method, budget) runs of `side`: one per budget for a budget method, else one."""
    out: list[tuple[str, int | None]] = []
    for m in methods:
        spec = METHODS[m]
        if spec["side"] == side:
            out += [(m, b) for b in budgets] if spec.get("budget") else [(m, None)]
    return out


def accuracy(rows: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    acc: dict[str, dict[str, str]] = {}
    for r in rows:
        label = f"{r['method']} (B={r['budget']})" if r["budget"] is not None else r["method"]
        acc.setdefault(label, {})
        key = str(r["target"])
        ok, total = (int(x) for x in acc[label].get(key, "0/0").split("/"))
        acc[label][key] = f"{ok + bool(r['correct'])}/{total + 1}"
    return acc


def short_answer(answer: str) -> str:
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
                else ("**ok**" if hit["correct"] else "miss") + f" `{short_answer(hit['answer'])}`"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
