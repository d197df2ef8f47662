"""What the server's batch tests share: a tiny GQA model, prompts, a sequence run alone through
the single-sequence tiered store, and the engine's streamed deltas collected."""

from __future__ import annotations

from pathlib import Path
from queue import Queue

import pytest
import torch

from kvtier.engine.batch.sequence import Delta
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.planner.placement import KVPlan
from kvtier.serve.engine import ServeEngine
from tests.hf_reference import make_hf_model

CPU = torch.device("cpu")
GPU_PLAN = KVPlan("gpu", group_size=2, resident_slices=3, chunk_size=64, staging_buffers=0, staging_tokens=0)


def gqa_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """The tests' model: 3 layers, 4 query heads, 2 KV heads, vocab 211, fp32 on the CPU."""
    folder: Path = tmp_path_factory.mktemp("gqa")
    make_hf_model("llama-gqa", folder)
    return LLM(str(folder), device="cpu", dtype="fp32", kv="gpu")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 211, (n,), generator=g).tolist() for n in (5, 23, 12, 40)]


def alone(llm: LLM, ids: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """Greedy prefill + decode of one sequence through the single-sequence tiered store."""
    store = TieredKVStore(
        llm.model_config, GPU_PLAN, device=CPU, dtype=torch.float32, capacity=64, options=StoreOptions(8)
    )
    store.begin_step(len(ids))
    logits = [llm.loaded.model(torch.tensor(ids), store)[-1]]
    store.end_step()
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        store.begin_step(1)
        logits.append(llm.loaded.model(torch.tensor(tokens[-1:]), store)[-1])
        store.end_step()
        tokens.append(int(logits[-1].argmax()))
    return logits, tokens


def collect(engine: ServeEngine, ids: list[int], params: SamplingParams) -> Queue[Delta]:
    q: Queue[Delta] = Queue()
    engine.submit(ids, params, q.put)
    return q


def tokens_of(q: Queue[Delta]) -> tuple[list[int], str | None]:
    out: list[int] = []
    reason = None
    while not q.empty():
        d = q.get()
        out.extend(d.token_ids)
        reason = d.finish_reason or reason
    return out, reason
