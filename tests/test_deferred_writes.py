"""A decode step's write-backs deferred to the next step's start (`HostWrites.defer`, what
the server's tiered runs use) give the same logits and the same host tier as writing them at
once, over whole-slice staging and over sequence blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.engine.llm import LLM
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.planner.placement import KVPlan
from tests.hf_reference import make_hf_model

CPU = torch.device("cpu")
PROMPT, DECODE = 40, 5
PLANS = {
    "head": KVPlan("head", 1, 0, 16, 2, 48),  # every slice streamed, whole
    "auto-blocks": KVPlan("auto", 1, 2, 16, 3, 24),  # 2 resident, the rest in 24-token blocks
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder: Path = tmp_path_factory.mktemp("gqa")
    make_hf_model("llama-gqa", folder)  # 3 layers, 4 query heads, 2 KV heads, vocab 211
    return LLM(str(folder), device="cpu", dtype="fp32", kv="gpu")


def host_rows(store: TieredKVStore, end: int) -> dict[int, torch.Tensor]:
    """Each streamed slice's first `end` host tokens [end, 2, G, D]."""
    lay = store.layout
    rows = {}
    for sid, host in store.hosts.items():
        dst = torch.empty(end, 2, lay.group_size, lay.head_dim, dtype=lay.dtype)
        host.read_into(dst, 0, end)
        rows[sid] = dst
    return rows


def run(
    llm: LLM, plan: KVPlan, defer: bool
) -> tuple[list[torch.Tensor], TieredKVStore, list[dict[int, torch.Tensor]]]:
    """Prefill in chunks, greedy decode; the logits, the store, and after each decode step
    what each streamed slice's host tier holds at that step's token (NaN before the step)."""
    cfg, model = llm.model_config, llm.loaded.model
    store = TieredKVStore(
        cfg, plan, device=CPU, dtype=torch.float32, capacity=PROMPT + DECODE, options=StoreOptions(8)
    )
    store.writes.defer = defer
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(4))
    logits = []
    for s in range(0, PROMPT, plan.chunk_size):
        store.begin_step(min(plan.chunk_size, PROMPT - s))
        logits.append(model(ids[s : s + plan.chunk_size], store))
        store.end_step()
    newest = []
    lay = store.layout
    nan = torch.full((1, 2, lay.group_size, lay.head_dim), float("nan"))
    for _ in range(DECODE):
        store.begin_step(1)
        for host in store.hosts.values():  # NOTE: what the step's write-back must overwrite
            host.write(store.length, nan)
        logits.append(model(logits[-1][-1].argmax().view(1), store))
        store.end_step()
        newest.append({sid: rows[-1].clone() for sid, rows in host_rows(store, store.length).items()})
    return logits, store, newest


@pytest.mark.parametrize("name", sorted(PLANS))
def test_deferred_write_backs_change_nothing_but_when(llm: LLM, name: str) -> None:
    plan = PLANS[name]
    now, store_now, newest_now = run(llm, plan, defer=False)
    later, store_later, newest_later = run(llm, plan, defer=True)
    assert store_now.hosts, "the plan streams slices"
    for step_now, step_later in zip(newest_now, newest_later, strict=True):
        for sid, row in step_now.items():  # a decode step's rows reach the host tier only later
            assert torch.isfinite(row).all() and torch.isnan(step_later[sid]).all()
    for a, b in zip(now, later, strict=True):
        assert torch.equal(a, b)
    store_later.begin_step(1)  # flushes the last step's rows
    end = store_now.length
    rows_now, rows_later = host_rows(store_now, end), host_rows(store_later, end)
    for sid in rows_now:
        assert torch.equal(rows_now[sid], rows_later[sid])
