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


def test_a_stage0_group_prunes_stage_0_once_for_its_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_block_stages(stage0_group=4)`: stage 0 prunes each group of 4 blocks as one, with
    their pooled queries together and the first block's candidates, and each block takes the
    group's result (a single stage: the same selection for the 4); later stages run per block.
    One block a group is the per-block pruning."""
    from kvtier.sparse import prefill

    calls: list[tuple[int, int]] = []
    real = prefill.prune_blocks

    def counted(q: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((q.shape[0], q.shape[1]))  # blocks, pooled queries a block
        return real(q, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(prefill, "prune_blocks", counted)
    gen = torch.Generator().manual_seed(4)
    d, bq, sink, window, s, heads, g = 16, 8, 4, 16, 600, 4, 2
    q = torch.randn(12 * bq, heads, d, generator=gen).view(-1, bq, heads, d)
    start = s - 12 * bq
    pos = torch.arange(start, s).view(-1, bq)
    keys = torch.randn(s, g, d, generator=gen)
    starts = torch.tensor([max(sink, start + b - window + 1) for b in range(0, 12 * bq, bq)])
    rope = RopeTable(Rotary(RopeConfig(), d))

    def prune(group: int, n_stages: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        calls.clear()
        return prefill.run_block_stages(
            q, pos, keys, sink, starts, chunk_sizes=(32, 8, 2)[:n_stages], budgets=(256, 64, 16)[:n_stages],
            strides=(4, 4, 1)[:n_stages], mode="relative", rotary=rope, window=window, head_score="softmax",
            triton=False, stage0_group=group,
        )  # fmt: skip

    sel, n = prune(4, n_stages=1)
    assert calls == [(3, 8)]  # 3 groups of 4 blocks' 2 pooled queries
    for first in range(0, 12, 4):
        assert all(torch.equal(sel[first], sel[b]) for b in range(first, first + 4))
        assert (sel[first][: int(n[first])] < int(starts[first])).all()  # the first block's candidates
    ref, ref_n = prefill.run_block_stages(  # the same as one block holding the group's queries
        q[:4].reshape(1, 4 * bq, heads, d), pos[:4].reshape(1, -1), keys, sink, starts[:1],
        chunk_sizes=(32,), budgets=(256,), strides=(4,), mode="relative", rotary=rope, window=window,
        head_score="softmax", triton=False,
    )  # fmt: skip
    assert torch.equal(sel[0, : ref.shape[1]], ref[0]) and int(n[0]) == int(ref_n[0])
    prune(4)
    assert calls == [(3, 8), (12, 2), (12, 8)]  # stage 0 by group; stages 1 and 2 per block
    assert torch.equal(prune(1)[0], prefill.run_block_stages(
        q, pos, keys, sink, starts, chunk_sizes=(32, 8, 2), budgets=(256, 64, 16), strides=(4, 4, 1),
        mode="relative", rotary=rope, window=window, head_score="softmax", triton=False,
    )[0])  # fmt: skip


def test_stage0_block_q_is_validated_and_reaches_the_pruning() -> None:
    """0 or a multiple of block_q; `prune_whole_blocks` groups block_q-query blocks by it."""
    from kvtier.errors import ConfigError
    from kvtier.sparse import prefill
    from kvtier.sparse.config import HipConfig

    assert HipConfig(stage0_block_q=256).stage0_block_q == 256
    for bad in (-64, 96, 100):
        with pytest.raises(ConfigError, match="stage0_block_q"):
            HipConfig(stage0_block_q=bad)
    seen: list[int] = []
    real = prefill.run_block_stages

    def spy(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(int(kwargs["stage0_group"]))  # type: ignore[call-overload]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    cfg = HipConfig.scaled(512)
    d, g = 16, 2
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(512, g, d, generator=gen)
    q = torch.randn(4 * cfg.block_q, 2 * g, d, generator=gen)
    start = 512 - q.shape[0]
    w0 = [max(cfg.sink, start + b - cfg.window + 1) for b in range(0, q.shape[0], cfg.block_q)]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(prefill, "run_block_stages", spy)
        for block in (0, 4 * cfg.block_q):
            c = HipConfig.scaled(512, stage0_block_q=block)
            prefill.prune_whole_blocks(q, start, keys, w0, c, 5, RopeTable(Rotary(RopeConfig(), d)))
    assert seen == [1, 4]
