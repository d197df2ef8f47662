"""Quest over the store: equal to dense at a full budget, its page bounds as planned and as held,
exact page selection per query head, and offloaded decode that gathers only the selected pages
and matches resident Quest."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kvtier.attention.interface import SliceStep
from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.methods import build_policy
from kvtier.model.llama import CausalLM
from kvtier.policies import PolicyParts
from kvtier.policies.quest import DENSE_LAYERS, QuestKernel, bounded_slices, quest_gpu_bytes
from tests.policy_store import CPU, DECODE, PROMPT, options, run

# -- Quest ------------------------------------------------------------------------------------


def test_quest_with_budget_over_context_equals_dense(gqa: tuple[CausalLM, ModelConfig]) -> None:
    model, cfg = gqa
    ref, _ = run(model, cfg, PolicyParts())
    got, _ = run(model, cfg, PolicyParts(kernel=QuestKernel(budget=PROMPT + DECODE, page=4, dense_layers=0)))
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_quest_page_size_is_an_option(gqa: tuple[CausalLM, ModelConfig]) -> None:
    _, cfg = gqa
    parts = build_policy(cfg, device=CPU, quest_page=4, **options(attention="quest", kv_budget=64))
    assert isinstance(parts.kernel, QuestKernel) and parts.kernel.page == 4
    with pytest.raises(ConfigError, match="at least one page"):
        build_policy(cfg, device=CPU, quest_page=128, **options(attention="quest", kv_budget=64))


@pytest.mark.parametrize("streamed", [False, True])
def test_quest_gpu_bytes_are_the_page_bounds_it_keeps(
    gqa: tuple[CausalLM, ModelConfig], streamed: bool
) -> None:
    """The planner's count of Quest's GPU page bounds equals what the kernel holds after a run
    of a known capacity (one buffer of its pages per slice past the dense layers, allocated
    once); without a capacity the buffers double and logits are the same."""
    model, cfg = gqa
    context = PROMPT + DECODE
    kernel = QuestKernel(budget=8, page=4, capacity=context)
    sizes: list[int] = []

    def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        sizes.append(math.prod(shape))
        return torch.empty(shape, dtype=dtype)

    kernel.place_caches(alloc)
    logits, _ = run(model, cfg, PolicyParts(kernel=kernel), streamed=streamed)
    assert {layer for layer, _ in kernel._bounds} == set(range(DENSE_LAYERS, cfg.num_layers))
    assert kernel.held_bytes() == quest_gpu_bytes(cfg, context, 4, 4) == 4 * sum(sizes)  # float32
    assert len(sizes) == bounded_slices(cfg, 2)  # run's slices of 2 KV heads, each allocated once
    assert kernel.read_tokens < kernel.total_tokens  # decode selected pages
    growing = QuestKernel(budget=8, page=4)
    again, _ = run(model, cfg, PolicyParts(kernel=growing), streamed=streamed)
    for a, b in zip(again, logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert growing.held_bytes() >= kernel.held_bytes()


def test_quest_is_planned_with_its_page_bounds_off_the_budget() -> None:
    """At 256K under 24 GiB (Llama-3-8B shapes) Quest's bounds (~2 GB with pages of 16) come off
    the store's budget: the plan is the lossless planner's at the smaller budget; a budget the
    bounds alone exceed is a CapacityError that names them."""
    from kvtier.errors import CapacityError
    from kvtier.loading.presets import preset_config
    from kvtier.methods import parse_choice, plan_for
    from kvtier.planner.hardware import hardware_preset
    from kvtier.planner.inputs import PlanInputs

    cfg = preset_config("llama-3-8b")
    inputs = PlanInputs(cfg, 262_144, hardware=hardware_preset("h200"), dtype_bytes=2, gpu_budget=24 << 30)
    placed = plan_for(inputs, parse_choice("quest,kv_budget=2048"))
    bounds = quest_gpu_bytes(cfg, 262_144, 16, 2)
    assert placed.reserve_bytes == bounds and 1.5e9 < bounds < 2.5e9
    assert placed.plan == plan_for(replace(inputs, gpu_budget=(24 << 30) - bounds)).plan
    assert placed.plan.gpu_kv_bytes < plan_for(inputs).plan.gpu_kv_bytes
    with pytest.raises(CapacityError, match="page bounds"):
        plan_for(replace(inputs, gpu_budget=bounds), parse_choice("quest,kv_budget=2048"))


def test_quest_selects_pages_by_upper_bound() -> None:
    kernel = QuestKernel(budget=8, page=4, dense_layers=0)
    kv = torch.zeros(16, 2, 1, 2)
    kv[4:8, 0, 0] = torch.tensor([1.0, 0.0])  # page 1 aligns with q
    kv[8:12, 0, 0] = torch.tensor([-1.0, 0.0])  # page 2 opposes it
    kv[:, 1, 0, 0] = torch.arange(16.0)
    q = torch.tensor([[[5.0, 0.0]]])  # [1, 1, 2]
    kernel(q, kv, SliceStep(0, 0, 15))
    # 3 pages of 4 are read (max(3, 8 // 4)): page 1 (best bound), the current page 3, and one tie.
    assert kernel.read_tokens == 12 and kernel.total_tokens == 16


@pytest.mark.parametrize("fixed", [False, True], ids=["union", "fixed-shapes"])
@pytest.mark.parametrize("length", [61, 64, 65])  # a partial last page, none, one stored token in it
def test_quest_decode_equals_attention_over_each_heads_pages(length: int, fixed: bool) -> None:
    """A sparse decode step attends exactly each query head's chosen pages' stored tokens and its
    own token, as a per-head reference: over the union's pages (the CPU's way) and in fixed
    shapes (CUDA's: a slot per page the heads could choose, unused ones empty)."""
    g, r, d, page = 2, 3, 8, 4
    kernel = QuestKernel(budget=12, page=page, dense_layers=0)
    kernel.fixed_shapes = fixed
    gen = torch.Generator().manual_seed(length)
    kv = torch.randn(length + 1, 2, g, d, generator=gen)
    q = torch.randn(1, g * r, d, generator=gen)
    step = SliceStep(0, 0, length)
    out = kernel(q, kv, step)
    lo, hi = kernel._minmax(kv[:length], SliceStep(0, 0, length - 1))
    pages = -(-(length + 1) // page)
    top = kernel._top_pages(q, lo[: length // page], hi[: length // page], pages, 3)  # [G, r, 3]
    for h in range(g * r):
        keep = torch.zeros(length + 1, dtype=torch.bool)
        for pg in top[h // r, h % r].tolist():
            keep[pg * page : (pg + 1) * page] = True
        keep[length] = True
        k, v = kv[keep, 0, h // r], kv[keep, 1, h // r]  # [n, D]
        want = torch.softmax(q[0, h] @ k.T / d**0.5, dim=-1) @ v
        assert torch.allclose(out[0, h], want, atol=1e-5), h
    assert kernel.read_tokens == sum(
        min((pg + 1) * page, length + 1) - pg * page for row in top.flatten(0, 1).tolist() for pg in row
    )


@pytest.mark.parametrize("fixed", [False, True], ids=["union", "fixed-shapes"])
@pytest.mark.parametrize("group", [1, 2])
def test_quest_over_offload_gathers_only_selected_pages_and_matches_resident_quest(
    gqa: tuple[CausalLM, ModelConfig], group: int, fixed: bool
) -> None:
    model, cfg = gqa
    budget, page, decode = 16, 4, 12
    ref, ref_store = run(
        model, cfg, PolicyParts(kernel=QuestKernel(budget, page, dense_layers=1)), group, 25, decode
    )
    kernel = QuestKernel(budget, page, dense_layers=1)
    kernel.fixed_shapes = fixed  # the offloaded steps (the resident reference takes the union)
    logits, store = run(model, cfg, PolicyParts(kernel=kernel), group, 25, decode, streamed=True)
    for a, b in zip(logits, ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)  # masked vs gathered: summation order
    assert [int(x[-1].argmax()) for x in logits] == [int(x[-1].argmax()) for x in ref]
    assert kernel.read_tokens == ref_store.kernel.read_tokens  # type: ignore[attr-defined]
    # Decode steps of sparse layers gathered pages only; dense layer 0 streamed its slices.
    token = 2 * group * cfg.head_dim * 4
    sparse_slices = (cfg.num_layers - 1) * cfg.num_kv_heads // group
    dense_slices = cfg.num_kv_heads // group
    stored = [PROMPT + i for i in range(decode)]
    prefill = sum(range(0, PROMPT, 25)) * (sparse_slices + dense_slices)
    # Pages are gathered once for all heads of a slice (the union): with groups of 2 KV heads
    # (4 query heads) the union covers more of this tiny context.
    assert 0 < kernel.gathered_tokens < sparse_slices * sum(stored) * (0.5 if group == 1 else 1)
    assert store.account.h2d_bytes == (prefill + dense_slices * sum(stored) + kernel.gathered_tokens) * token
