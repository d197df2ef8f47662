"""Shared by the policy tests: a run of the tiny GQA model through a store with policy parts."""

from __future__ import annotations

from typing import Any

import torch

from kvtier.config import ModelConfig
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.model.llama import CausalLM
from kvtier.planner.placement import KVPlan
from kvtier.policies import PolicyParts

CPU = torch.device("cpu")
PROMPT, DECODE = 60, 6


def options(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(kv_quant=None, evict=None, kv_budget=None, attention=None, head_sparsity=None)
    base.update(kw)
    return base


def run(
    model: CausalLM,
    cfg: ModelConfig,
    parts: PolicyParts,
    group: int = 2,
    chunk: int = PROMPT,
    decode: int = DECODE,
    streamed: bool = False,
) -> tuple[list[torch.Tensor], TieredKVStore]:
    """Prefill in chunks, then greedy decode; every step's logits and the store. `streamed`:
    every slice in host memory (head-wise offload), else every slice resident."""
    slices = cfg.num_layers * cfg.num_kv_heads // group
    plan = (
        KVPlan("head", group, 0, chunk, 2, PROMPT + DECODE)
        if streamed
        else KVPlan("gpu", group, slices, chunk, 0, 0)
    )
    store = make_store(cfg, plan, parts)
    return drive_store(model, cfg, store, chunk, decode), store


def drive_store(
    model: CausalLM, cfg: ModelConfig, store: TieredKVStore, chunk: int = PROMPT, decode: int = DECODE
) -> list[torch.Tensor]:
    """The run's prompt prefilled through `store` in chunks, then greedy decode: each step's logits."""
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3))
    logits = []
    for s in range(0, PROMPT, chunk):
        store.begin_step(min(chunk, PROMPT - s))
        logits.append(model(ids[s : s + chunk], store))
        store.end_step()
    for _ in range(decode):
        store.begin_step(1)
        logits.append(model(logits[-1][-1].argmax().view(1), store))
        store.end_step()
    return logits


def make_store(
    cfg: ModelConfig, plan: KVPlan, parts: PolicyParts, capacity: int = PROMPT + DECODE
) -> TieredKVStore:
    """A float32 CPU store of 8-token blocks with the policy's parts."""
    return TieredKVStore(
        cfg,
        plan,
        device=CPU,
        dtype=torch.float32,
        capacity=capacity,
        options=StoreOptions(block_size=8),
        **parts.store_kwargs(),
    )
