"""Shared by the HiP offload tests: the tiny GQA model (conftest's `gqa`) prefilled and decoded
through a store of PROMPT + DECODE tokens whose slices are resident ("gpu") or streamed head by
head ("head"), with a HiP kernel of budgets small enough to prune its context (`TINY`)."""

from __future__ import annotations

from typing import Any

import torch

from kvtier.config import ModelConfig
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.model.llama import CausalLM
from kvtier.planner.placement import KVPlan
from kvtier.sparse import HipKernel, make_hip_kernel
from tests.hf_reference import drive

CPU = torch.device("cpu")
PROMPT, DECODE, CHUNK = 120, 20, 16
REFRESH0 = 6  # stage-0 refreshes at decode steps 0, 6, 12, 18
# Budgets that prune a 120-token context (3 stages), small blocks so a block cache has many.
TINY: dict[str, object] = {
    "sink": 2,
    "window": 6,
    "block_q": 4,
    "chunk_sizes": (8, 4, 2),
    "budgets": (32, 16, 8),
    "wide_budget": 8,
    "query_strides": (2, 2, 1),
    "refresh": (REFRESH0, 3, 1),
    "cache_block": 4,
}
SLICES = 6  # 3 layers x 2 KV heads, one head per slice
TOKEN_BYTES = 2 * 16 * 4  # K and V of one head of 16 dims, float32


def plan(policy: str) -> KVPlan:
    if policy == "gpu":
        return KVPlan(
            policy="gpu",
            group_size=1,
            resident_slices=SLICES,
            chunk_size=CHUNK,
            staging_buffers=0,
            staging_tokens=0,
        )
    return KVPlan(
        policy="head",
        group_size=1,
        resident_slices=0,
        chunk_size=CHUNK,
        staging_buffers=2,
        staging_tokens=PROMPT + DECODE,
    )


def kernel_for(cfg: ModelConfig, **overrides: object) -> HipKernel:
    kernel, _ = make_hip_kernel(cfg, CPU, "default", **{**TINY, **overrides})
    assert isinstance(kernel, HipKernel)
    return kernel


def make_store(cfg: ModelConfig, policy: str, kernel: HipKernel, codec: Any = None) -> TieredKVStore:
    """A store of PROMPT + DECODE tokens under `plan(policy)` with the HiP kernel (and `codec`)."""
    return TieredKVStore(
        cfg,
        plan(policy),
        device=CPU,
        dtype=torch.float32,
        capacity=PROMPT + DECODE,
        options=StoreOptions(block_size=5, extent_blocks=4),
        kernel=kernel,
        rotate_keys=not kernel.needs_unrotated_keys,
        codec=codec,
    )


def run(
    model: CausalLM, cfg: ModelConfig, policy: str, kernel: HipKernel, seed: int = 7, codec: Any = None
) -> tuple[list[torch.Tensor], list[int], TieredKVStore, int]:
    """Chunked prefill + greedy decode; returns logits, tokens, the store and H2D bytes of decode."""
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(seed))
    store = make_store(cfg, policy, kernel, codec)
    prefill, _ = drive(model, store, ids, CHUNK, 0)
    h2d = store.account.h2d_bytes
    tail, tokens = _decode(model, store, prefill[-1])
    return prefill + tail, tokens, store, store.account.h2d_bytes - h2d


def _decode(
    model: CausalLM, store: TieredKVStore, last: torch.Tensor
) -> tuple[list[torch.Tensor], list[int]]:
    logits, tokens = [], []
    for _ in range(DECODE):
        tok = last[-1].argmax()
        tokens.append(int(tok))
        store.begin_step(1)
        last = model(tok.view(1), store)
        logits.append(last)
        store.end_step()
    return logits, tokens


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


# Streamed slice tokens of the refresh steps (whole slices at decode steps 0, 6, 12, 18).
REFRESH_BYTES = sum(PROMPT + k for k in range(0, DECODE, REFRESH0)) * SLICES * TOKEN_BYTES
