"""DuoAttention-style head sparsity is planned for what it keeps: the streaming heads' slices
stay compact on the GPU and only the retrieval heads' slices are placed (host tier, staging)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import ModelConfig
from kvtier.errors import CapacityError, ConfigError
from kvtier.loading.presets import preset_config
from kvtier.methods import parse_choice, plan_for
from kvtier.model.llama import CausalLM
from kvtier.planner.compact import CompactSlices
from kvtier.planner.hardware import hardware_preset
from kvtier.planner.inputs import PlanInputs
from kvtier.planner.memory import round_up
from kvtier.planner.placement import plan_kv
from kvtier.policies import PolicyParts
from kvtier.policies.head_sparsity import HeadStreamingEvictor, head_scores
from tests.policy_store import DECODE, PROMPT, drive_store, make_store


def test_a_million_tokens_fit_the_host_with_half_the_heads_streaming() -> None:
    """Llama-3.1-8B at 1M under 24 GiB with 100 GiB of host memory: lossless needs 131 GB of
    host KV and does not fit; with --head-sparsity 0.5 only the retrieval heads' half is placed."""
    cfg = preset_config("llama-3.1-8b")
    inputs = PlanInputs(
        cfg,
        1 << 20,
        hardware=hardware_preset("h200"),
        dtype_bytes=2,
        gpu_budget=24 << 30,
        host_budget=100 << 30,
    )
    with pytest.raises(CapacityError, match="host memory"):
        plan_for(inputs)
    plan = plan_for(inputs, parse_choice("duo,head_sparsity=0.5")).plan
    every = cfg.num_layers * (cfg.num_kv_heads // plan.group_size)
    assert plan.compact_slices == every // 2 and plan.num_slices == every - plan.compact_slices
    assert plan.host_kv_bytes == plan.streamed_slices * plan.capacity_tokens * plan.slice_token_bytes
    assert 0 < plan.host_kv_bytes <= 100 << 30
    # Each compact slice is allocated once at its 320 kept tokens plus a chunk.
    assert plan.compact_tokens == round_up(64 + 256 + plan.chunk_size, 256)
    compact = plan.compact_slices * plan.compact_tokens * plan.slice_token_bytes
    lossless_like = plan_kv(
        cfg, 1 << 20, gpu_budget=24 << 30, group_size=plan.group_size, chunk_size=plan.chunk_size
    )
    assert plan.gpu_kv_bytes >= compact + plan.resident_slices * plan.slice_store_bytes
    assert lossless_like.host_kv_bytes > plan.host_kv_bytes  # (no host budget given to this one)
    # A --kv-budget sets what a streaming head keeps.
    budget = plan_for(inputs, parse_choice("duo,head_sparsity=0.5,kv_budget=1k")).plan
    assert budget.compact_tokens == round_up(1024 + budget.chunk_size, 256)


def test_the_store_stays_within_what_the_plan_counts(
    gqa: tuple[CausalLM, ModelConfig], tmp_path: Path
) -> None:
    """The tiny model's store under a compact plan, all retrieval slices streamed: it places
    exactly the plan's slices, its host bytes are the plan's, and its GPU bytes (compact slices
    grown by doubling, staging) never exceed the plan's GPU KV."""
    model, cfg = gqa
    chunk, keep = 25, 24
    compact = CompactSlices(0.5, keep)
    plan = plan_kv(cfg, PROMPT + DECODE, policy="head", gpu_budget=None, group_size=1, chunk_size=chunk,
                   block_size=8, dtype_bytes=4, compact=compact)  # fmt: skip
    assert (plan.num_slices, plan.compact_slices, plan.resident_slices) == (3, 3, 0)
    scores = head_scores(model, segment=16, repeats=3, cache_dir=tmp_path)
    store = make_store(cfg, plan, PolicyParts(evictor=HeadStreamingEvictor(scores, 0.5, sinks=4, recent=20)))
    drive_store(model, cfg, store, chunk)
    assert len(store.hosts) == plan.streamed_slices == 3 and len(store.resident) == plan.compact_slices
    assert store.account.peak["host"] == plan.host_kv_bytes
    assert store.account.peak["gpu"] <= plan.gpu_kv_bytes


def test_compact_slices_are_validated() -> None:
    for fraction, keep in ((0.0, 10), (1.0, 10), (0.5, 0)):
        with pytest.raises(ConfigError, match="compact slices"):
            CompactSlices(fraction, keep)
