"""HiP's prefill pruning batch (`HipConfig.prune_bytes`): where the plan keeps every slice on
the GPU and has the room, it reserves enough to prune a whole prefill chunk's query blocks in one
batch a stage (SmolLM2's 16K chunk ran six batches a stage, ~25 launches each), and the kernel
built for the request gets it; elsewhere the default stays."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvtier.config import RopeConfig
from kvtier.errors import ConfigError
from kvtier.loading.presets import preset_config
from kvtier.methods import parse_choice, plan_for
from kvtier.methods.registry import Placement, PlanInputs
from kvtier.model.rope import Rotary
from kvtier.planner.hardware import HARDWARE
from kvtier.sparse import HIP_PRESETS, hip_phase_bytes
from kvtier.sparse.config import HipConfig
from kvtier.sparse.prune_memory import PRUNE_BATCH_BYTES, whole_chunk_prune_bytes
from kvtier.sparse.rope_ext import RopeTable

GIB = 1 << 30


def _placement(model: str, context: int, gpu: int | None, method: str = "hip") -> Placement:
    inputs = PlanInputs(
        preset_config(model), context, hardware=HARDWARE["h200"], gpu_budget=gpu, dtype_bytes=2
    )
    return plan_for(inputs, parse_choice(method))


def test_a_resident_plan_with_room_reserves_a_whole_chunk_of_pruning() -> None:
    """SmolLM2 at 16K under 24 GiB (`lean`, past its 8K): every slice resident, and the plan
    reserves what its 16K chunk's 256 blocks take at once in the widest stage, counted in
    HiP's always-held bytes; without a GPU budget (the CPU) nothing changes."""
    cfg = preset_config("smollm2-135m")
    placed = _placement("smollm2-135m", 16384, 24 * GIB)
    assert placed.plan.streamed_slices == 0 and placed.plan.chunk_size == 16384
    lean = HIP_PRESETS["lean"]
    need = whole_chunk_prune_bytes(
        16384, 256, 64, 9, 3, 64, 2, chunk_sizes=lean.chunk_sizes,
        budgets=(*lean.budgets[:-1], lean.wide_budget), strides=lean.query_strides, head_score="softmax",
    )  # fmt: skip
    assert placed.prune_bytes == need > 4 * PRUNE_BATCH_BYTES
    always = hip_phase_bytes(cfg, replace(lean, prune_bytes=placed.prune_bytes), 2, 16384)[1]
    assert always - hip_phase_bytes(cfg, lean, 2, 16384)[1] == need - PRUNE_BATCH_BYTES
    assert _placement("smollm2-135m", 16384, None).prune_bytes is None


def test_streamed_or_tight_plans_keep_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama-3-8B at 128K under 24 GiB streams slices: the default batch. A whole chunk's
    bytes past `WHOLE_CHUNK_PRUNE_MAX` reserve that much; where the larger reservation would not
    fit (here: more than the card, the cap lifted), the plan is the one planned with the
    default, not a worse one."""
    assert _placement("llama-3-8b", 131072, 24 * GIB).prune_bytes is None
    import kvtier.sparse.planning as planning

    before = _placement("smollm2-135m", 16384, 24 * GIB)
    monkeypatch.setattr(planning, "whole_chunk_prune_bytes", lambda *a, **k: 64 * GIB)
    assert _placement("smollm2-135m", 16384, 24 * GIB).prune_bytes == planning.WHOLE_CHUNK_PRUNE_MAX
    monkeypatch.setattr(planning, "WHOLE_CHUNK_PRUNE_MAX", 64 * GIB)
    after = _placement("smollm2-135m", 16384, 24 * GIB)
    assert after.prune_bytes is None
    assert after.plan == before.plan and after.reserve_bytes < before.reserve_bytes


def test_the_kernel_gets_the_planned_batch() -> None:
    """The request's kernel is built with the placement's prune bytes (`MethodChoice.build`)."""
    cfg = preset_config("smollm2-135m")
    parts = parse_choice("hip").build(cfg, torch.device("cpu"), None, context=16384, hip_prune_bytes=3 << 30)
    assert parts.kernel is not None and parts.kernel.cfg.prune_bytes == 3 << 30  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="prune_bytes"):
        HipConfig(prune_bytes=0)


def test_the_whole_chunk_bytes_prune_every_block_in_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_block_stages` given `whole_chunk_prune_bytes` of its blocks prunes each stage in one
    call; given a quarter of it, in several (the two count the same bytes)."""
    from kvtier.sparse import prefill

    calls: list[int] = []
    real = prefill.prune_blocks

    def counted(q: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(prefill, "prune_blocks", counted)
    gen = torch.Generator().manual_seed(2)
    d, bq, sink, window, s, heads, g = 16, 8, 4, 16, 600, 4, 2
    stages = {"chunk_sizes": (32, 8, 2), "budgets": (256, 64, 16), "strides": (4, 4, 1)}
    q = torch.randn(12 * bq, heads, d, generator=gen)
    start = s - q.shape[0]
    keys = torch.randn(s, g, d, generator=gen)
    starts = [max(sink, start + b - window + 1) for b in range(0, q.shape[0], bq)]
    need = whole_chunk_prune_bytes(
        s - sink, 12, bq, heads, g, d, 4, triton=False, head_score="softmax", **stages
    )  # fmt: skip
    selections = []
    for bound in (need, need // 4):
        calls.clear()
        sel, n = prefill.run_block_stages(
            q.view(-1, bq, heads, d), torch.arange(start, s).view(-1, bq), keys, sink, torch.tensor(starts),
            **stages, mode="relative", rotary=RopeTable(Rotary(RopeConfig(), d)), window=window,
            head_score="softmax", triton=False, batch_bytes=bound,
        )  # fmt: skip
        selections.append((sel, n))
        if bound == need:
            assert calls == [12, 12, 12]
        else:
            assert len(calls) > 3 and max(calls) < 12
    assert torch.equal(selections[0][0], selections[1][0]) and torch.equal(selections[0][1], selections[1][1])
