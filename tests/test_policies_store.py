"""Lossy KV policies as the store and planner take them: clear configuration errors, a
synthetically filled store that looks prefilled, and the planner's bytes per policy against the
store's own counters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.methods import build_policy
from kvtier.model.llama import CausalLM
from kvtier.planner.placement import KVPlan
from kvtier.policies import PolicyParts
from kvtier.policies.evict import WindowEvictor
from kvtier.policies.head_sparsity import HeadStreamingEvictor
from kvtier.policies.quant import Fp8Codec, KiviCodec
from tests.policy_store import CPU, PROMPT, make_store, options

# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,match",
    [
        (options(kv_quant="int3"), "unknown --kv-quant"),
        (options(evict="lru", kv_budget=8), "unknown --evict"),
        (options(attention="flash"), "unknown --attention"),
        (options(evict="h2o"), "needs --kv-budget"),
        (options(kv_budget=64), "applies only"),
        (options(evict="h2o", kv_budget=64, attention="quest"), "cannot be combined"),
        (options(kv_quant="int4", evict="window", kv_budget=64), "cannot be combined"),
        (options(evict="streaming", kv_budget=4), "too small"),
        (options(head_sparsity=0.5), "pass the model"),
    ],
)
def test_bad_options_raise_config_errors(
    gqa: tuple[CausalLM, ModelConfig], kw: dict[str, Any], match: str
) -> None:
    _, cfg = gqa
    with pytest.raises(ConfigError, match=match):
        build_policy(cfg, device=CPU, **kw)


def test_budget_and_offload_are_checked_at_store_construction(gqa: tuple[CausalLM, ModelConfig]) -> None:
    _, cfg = gqa
    parts = build_policy(cfg, device=CPU, **options(evict="window", kv_budget=100))
    common: dict[str, Any] = dict(device=CPU, dtype=torch.float32, options=StoreOptions(block_size=8))
    with pytest.raises(ConfigError, match="not below the context capacity"):
        TieredKVStore(cfg, KVPlan("gpu", 2, 3, 16, 0, 0), capacity=64, **common, **parts.store_kwargs())


# -- the bytes of each policy -----------------------------------------------------------------


@pytest.mark.parametrize("method", ["int4", "heads"])
def test_synthetic_fill_gives_packed_rows_and_compact_heads(
    gqa: tuple[CausalLM, ModelConfig], tmp_path: Path, method: str
) -> None:
    """Benchmarks fill long contexts synthetically; the filled store must look like a prefilled one."""
    from kvtier.kv.synthetic import fill_synthetic

    model, cfg = gqa
    codec = KiviCodec(bits=4, group=8, residual=16)
    scores = torch.arange(6.0).view(3, 2)
    parts = (
        PolicyParts(codec=codec)
        if method == "int4"
        else PolicyParts(evictor=HeadStreamingEvictor(scores, 0.5, sinks=4, recent=20))
    )
    store = make_store(cfg, KVPlan("head", 1, 0, 16, 2, 128), parts, capacity=128)
    fill_synthetic(store, 100)
    h2d = store.account.h2d_bytes
    store.begin_step(1)
    assert torch.isfinite(model(torch.tensor([1]), store)).all()
    store.end_step()
    token = 2 * cfg.head_dim * 4
    if method == "int4":
        assert store.packed is not None and store.packed.coded == codec.frozen_tokens(100) == 80
        row = codec.row_bytes(1, cfg.head_dim)
        assert store.account.h2d_bytes - h2d == 6 * (10 * row + 20 * token)
    else:
        assert sorted(store.slice_length) == [24] * 3 + [101] * 3
        assert store.account.h2d_bytes - h2d == 3 * 100 * token


@pytest.mark.parametrize(
    "method", ["lossless", "int4", "int8", "fp8", "int4-gpu", "heads", "window", "heads-auto"]
)
def test_planner_predicts_the_bytes_each_policy_stores_and_moves(
    gqa: tuple[CausalLM, ModelConfig], method: str
) -> None:
    """`kvtier.planner.lossy` and the store's own counters agree, policy by policy."""
    from kvtier.planner.lossy import lossy_kv

    model, cfg = gqa
    codecs: dict[str, Any] = {
        "int4": KiviCodec(bits=4, group=8, residual=16),
        "int8": KiviCodec(bits=8, group=4, residual=4),
        "fp8": Fp8Codec(),
    }
    scores = torch.arange(6.0).view(3, 2)
    codec = codecs.get(method.removesuffix("-gpu"))
    parts, evicted, kept = PolicyParts(codec=codec), 0, None
    if method.startswith("heads"):
        parts, evicted, kept = PolicyParts(evictor=HeadStreamingEvictor(scores, 0.5, 4, 20)), 3, 24
    if method == "window":
        parts, evicted, kept = PolicyParts(evictor=WindowEvictor(budget=16, sinks=0)), 6, 16
    plan = KVPlan(
        "auto" if method == "heads-auto" else "head", 1, 1 if method == "heads-auto" else 0, 25, 2, 72
    )
    if method == "int4-gpu":  # everything resident: packed rows in GPU memory
        plan = KVPlan("gpu", 1, cfg.num_layers * cfg.num_kv_heads, 25, 0, 0)
    store = make_store(cfg, plan, parts)
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3))
    for s in range(0, PROMPT, 25):
        store.begin_step(min(25, PROMPT - s))
        model(ids[s : s + 25], store)
        store.end_step()
    for _ in range(3):
        n = store.length
        want = lossy_kv(cfg, plan, n, dtype_bytes=4, codec=codec, evicted_slices=evicted, kept_tokens=kept)
        h2d = store.account.h2d_bytes
        store.begin_step(1)
        model(torch.tensor([5]), store)
        assert store.account.h2d_bytes - h2d == want.pcie_per_decode
        assert store.stored_bytes() == {"gpu": want.gpu_stored, "host": want.host_stored}
        assert len(store.hosts) - len(store.on_device) == want.streamed_slices
        store.end_step()
