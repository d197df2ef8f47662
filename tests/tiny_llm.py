"""A greedy run of the tiny GQA model's HF folder (conftest's `tiny`) through `LLM` (`tokens`),
for the tests that reach methods through the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier import LLM, SamplingParams

PROMPT = list(range(3, 60))


def tokens(folder: Path, **kw: Any) -> tuple[list[int], str]:
    """Six greedy tokens of PROMPT under `LLM(folder, **kw)` on the CPU, and the plan's method."""
    llm = LLM(str(folder), device="cpu", chunk_size=16, **kw)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))[0]
    return out.token_ids, out.stats.plan["method"]
