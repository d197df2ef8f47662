"""Every opt-in method is reachable from `LLM` (and so the CLI), and bad combinations fail early."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.cli.main import main
from kvtier.errors import CapacityError, ConfigError
from kvtier.planner.placement import KVPlan
from tests.tiny_llm import tokens


def test_methods_run_and_budgets_covering_the_context_are_lossless(tiny: Path) -> None:
    ref, desc = tokens(tiny)
    assert desc == "lossless"
    # HiP's default budgets (32K tokens) cover this context, so it equals dense attention.
    # (`--hip-preset auto` takes the paper's setting within the trained length.)
    assert tokens(tiny, attention="hip") == (ref, "hip fast (auto)")
    # Every method also runs over head-wise offload (HiP through its GPU block cache, the codec
    # through the packed host tier, evicted slices resident next to streamed ones).
    assert tokens(tiny, attention="hip", kv="head") == (ref, "hip fast (auto)")
    assert tokens(tiny, kv_quant="int8", kv="head") == tokens(tiny, kv_quant="int8", kv="gpu")
    assert tokens(tiny, evict="window", kv_budget=40, kv="head") == tokens(tiny, evict="window", kv_budget=40)
    assert (
        tokens(tiny, attention="quest", kv_budget=16, kv="head")[0]
        == tokens(tiny, attention="quest", kv_budget=16)[0]
    )
    assert tokens(tiny, attention="quest", kv_budget=4096)[0] == ref
    assert len(tokens(tiny, evict="window", kv_budget=40)[0]) == 6
    with pytest.raises(ConfigError, match="not below the context"):
        tokens(tiny, evict="window", kv_budget=4096)
    assert tokens(tiny, kv_quant="int8")[1] == "kv-quant int8"
    assert len(tokens(tiny, evict="streaming", kv_budget=24)[0]) == 6


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"attention": "quest", "kv_quant": "int4", "kv_budget": 64}, "cannot be combined"),
        ({"attention": "sparse"}, "unknown --attention"),
        ({"evict": "h2o"}, "--kv-budget"),
        ({"kv_quant": "int3"}, "unknown --kv-quant"),
        ({"head_sparsity": 1.5}, r"\(0, 1\)"),
        ({"hip_refresh": "fast"}, "--hip-refresh applies only with --attention hip"),
        ({"attention": "hip", "hip_refresh": "sometimes"}, "unknown --hip-refresh 'sometimes'"),
        ({"hip_host_keys": True}, "--hip-host-keys applies only with --attention hip"),
    ],
)
def test_bad_method_options(tiny: Path, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LLM(str(tiny), device="cpu", **kw)


def test_cli_flags_reach_the_engine(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tiny), "--prompt", "x", "--evict", "h2o"]) == 2
    assert "--kv-budget" in capsys.readouterr().err


def streaming_plan(cfg: Any, context: int, group: int, *, whole: bool) -> KVPlan:
    """A plan that streams every slice of `group` KV heads; its staging buffers hold a whole
    slice or half of one."""
    return KVPlan(
        policy="auto",
        group_size=group,
        resident_slices=0,
        chunk_size=16,
        staging_buffers=2,
        staging_tokens=context if whole else context // 2,
        context=context,
        capacity_tokens=context,
        num_slices=cfg.num_layers * (cfg.num_kv_heads // group),
    )


@pytest.mark.parametrize("layer_holds_slices", [True, False])
def test_hip_under_auto_plans_whole_layer_slices_when_their_staging_fits(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, layer_holds_slices: bool
) -> None:
    """HiP selects per slice: with `--kv auto` and no `--head-group` the engine takes whole
    layers (the published head reduction, fewer slice steps) when a layer's staging buffers hold
    whole slices, and finer slices that do otherwise."""
    import kvtier.planner.inputs as engine

    asked: list[int | None] = []

    def fake_plan(cfg: Any, context: int, *, group_size: int | None, **kw: Any) -> KVPlan:
        asked.append(group_size)
        g = group_size or 1
        return streaming_plan(cfg, context, g, whole=g == 1 or layer_holds_slices)

    monkeypatch.setattr(engine, "plan_kv", fake_plan)
    llm = LLM(str(tiny), device="cpu", attention="hip", gpu_memory="1GB")
    plan = llm.plan(64)
    assert asked[0] == llm.model_config.num_kv_heads
    assert plan.group_size == (llm.model_config.num_kv_heads if layer_holds_slices else 1)
    assert asked[-1] == (llm.model_config.num_kv_heads if layer_holds_slices else 1)
    asked.clear()
    LLM(str(tiny), device="cpu", attention="dense", gpu_memory="1GB").plan(64)
    assert asked == [None]  # dense attention: the planner's choice


def test_hip_shrinks_its_block_cache_before_giving_up_whole_layer_slices(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a whole refresh interval's block cache leaves no room for a layer's staging buffers,
    the engine tries smaller caches (largest first) and builds the kernel with the one that fits."""
    import kvtier.planner.inputs as engine
    import kvtier.sparse as sparse
    from kvtier.sparse import CACHE_TOKEN_STEPS, HipKernel
    from kvtier.sparse.planning import store_budget

    # NOTE: past every cache step: a shorter request's caches are bounded by its tokens anyway
    budget, context, fits = 10**9, 65_536, CACHE_TOKEN_STEPS[2]
    # a short chunk: a long one's activations, which decode frees, would dwarf every cache size
    llm = LLM(
        str(tiny), device="cpu", attention="hip", hip_preset="default", gpu_memory=str(budget), chunk_size=64
    )
    cfg = llm.model_config
    # The tiny model's caches are smaller than prefill's pruning reserve, the larger phase: without
    # it the cache size is what decides.
    monkeypatch.setattr(sparse, "PRUNE_BATCH_BYTES", 0)

    def fake_plan(
        cfg: Any, ctx: int, *, group_size: int | None, gpu_budget: int, chunk_size: int | None, **kw: Any
    ) -> KVPlan:
        # A layer plan holds whole slices only with the budget HiP leaves at `fits` tokens or less.
        enough = store_budget(cfg, context, budget, "default", 4, fits, chunk_size)
        return streaming_plan(cfg, ctx, group_size or 1, whole=gpu_budget >= enough)

    monkeypatch.setattr(engine, "plan_kv", fake_plan)
    placed = llm.placement(context, llm.method)
    plan, cache_tokens = placed.plan, placed.cache_tokens
    assert (plan.group_size, cache_tokens) == (cfg.num_kv_heads, fits)
    store, parts = llm.make_store(plan, context, cache_tokens)
    store.close()
    assert isinstance(parts.kernel, HipKernel) and parts.kernel.cfg.cache_tokens == fits
    assert f"block cache {fits} tokens/slice" in parts.describe


def test_a_stopgap_block_cache_says_so_in_the_plan(tiny: Path) -> None:
    """A block cache below the steps (`SMALL_CACHE_TOKEN_STEPS`, only where nothing else fits)
    misses every step; the plan's description says so, as `kvtier generate` prints it."""
    from kvtier.sparse import CACHE_TOKEN_STEPS, SMALL_CACHE_TOKEN_STEPS

    llm = LLM(str(tiny), device="cpu", attention="hip", hip_preset="default", chunk_size=64)
    plan = llm.plan(65_536)
    for cache, stopgap in ((SMALL_CACHE_TOKEN_STEPS[-1], True), (CACHE_TOKEN_STEPS[-1], False)):
        store, parts = llm.make_store(plan, 65_536, cache)
        store.close()
        assert f"block cache {cache} tokens/slice" in parts.describe
        assert ("a stopgap" in parts.describe) is stopgap


def test_hip_offloaded_by_the_engine_matches_hip_on_the_gpu(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through `LLM` end to end: a budget where the planner streams whole-layer slices with a
    reduced block cache gives the tokens of HiP with everything resident."""
    import kvtier.sparse as sparse
    import kvtier.sparse.planning as planning

    # The tiny model's caches are smaller than prefill's pruning reserve, the larger phase: without
    # it the block cache is what the budget has to fit.
    monkeypatch.setattr(sparse, "PRUNE_BATCH_BYTES", 0)
    # Cache steps below the request's 412 tokens (the real ones, 8K-16K, exceed it: its caches
    # are bounded by its tokens, `HipConfig.capacity`, whatever the step).
    monkeypatch.setattr(planning, "CACHE_TOKEN_STEPS", (256, 192, 128, 64))
    ids = [(7 * i) % 200 + 3 for i in range(400)]
    params = SamplingParams(max_tokens=12)
    ref = LLM(str(tiny), device="cpu", attention="hip").generate(ids, params)[0]
    # 16-token chunks: the whole prompt's activations, which decode frees, would dwarf the caches
    for budget in range(545_000_000, 550_000_000, 40_000):  # the tiny model's KV: ~1 MB
        llm = LLM(str(tiny), device="cpu", attention="hip", gpu_memory=str(budget), chunk_size=16)
        with contextlib.suppress(CapacityError):
            placed = llm.placement(len(ids) + params.max_tokens, llm.method)
            plan, cache_tokens = placed.plan, placed.cache_tokens
            layers = plan.group_size == llm.model_config.num_kv_heads
            if layers and plan.streamed_slices and cache_tokens is not None:
                break
    else:
        pytest.fail("no budget streams the tiny model's layers")
    out = llm.generate(ids, params)[0]
    assert out.stats.plan["group_size"] == llm.model_config.num_kv_heads
    assert f"block cache {cache_tokens} tokens/slice" in out.stats.plan["method"]
    assert out.token_ids == ref.token_ids


@pytest.mark.parametrize(
    ("n", "alone", "steps"),
    [(10, True, [4, 4, 1, 1]), (10, False, [4, 4, 2]), (9, True, [4, 4, 1]), (1, True, [1])],
)
def test_prefill_runs_the_last_prompt_token_alone_for_hip(n: int, alone: bool, steps: list[int]) -> None:
    """The prefill loop gives a kernel with `last_query_alone` the prompt's last token as a step
    of its own (its selection is then for that query alone); other kernels get plain chunks.
    Only the last step asks for logits."""
    from types import SimpleNamespace

    from kvtier.config import ModelConfig
    from kvtier.engine.runner import prefill
    from kvtier.sparse import make_hip_kernel

    cfg = ModelConfig(64, 64, 96, 1, 4, 2, 16, 512)
    kernel, _ = make_hip_kernel(cfg, torch.device("cpu"), last_query_alone=alone)
    seen: list[tuple[int, bool]] = []

    def model(
        part: torch.Tensor, store: object, logits_at: torch.Tensor | None, mlp_chunk: int
    ) -> torch.Tensor:
        seen.append((part.shape[0], logits_at is None))
        return torch.zeros(1, 5)

    store = SimpleNamespace(kernel=kernel, begin_step=lambda t: None, end_step=lambda: None)
    prefill(model, store, torch.arange(n), 4)  # type: ignore[arg-type]
    assert [t for t, _ in seen] == steps
    assert [wants for _, wants in seen] == [False] * (len(steps) - 1) + [True]
