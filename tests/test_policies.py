"""Lossy KV policies over the store: exact eviction indices, Quest at a full budget and over
offload, deterministic head classification, the planner's bytes per policy, and clear
configuration errors. Quantized KV has its own file, test_quantized_kv.py."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.attention.interface import SliceStep
from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.kv.layout import KVLayout
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.methods import build_policy
from kvtier.model.llama import CausalLM
from kvtier.planner.placement import KVPlan
from kvtier.policies import PolicyParts
from kvtier.policies.evict import H2OEvictor, SnapKVEvictor, WindowEvictor
from kvtier.policies.head_sparsity import HeadStreamingEvictor, head_scores
from kvtier.policies.quant import Fp8Codec, KiviCodec
from kvtier.policies.quest import DENSE_LAYERS, QuestKernel, bounded_slices, quest_gpu_bytes
from kvtier.policies.scoring import attention_mass
from tests.policy_store import CPU, DECODE, PROMPT, make_store, options, run

# -- eviction ----------------------------------------------------------------------------------


def layout(group: int = 2) -> KVLayout:
    return KVLayout(
        num_layers=1,
        num_kv_heads=2,
        head_dim=4,
        q_per_kv=1,
        group_size=group,
        block_size=4,
        dtype=torch.float32,
    )


def kept(ev: Any, length: int, new: int = 1) -> list[list[int]]:
    idx = ev.keep(0, length, new)
    assert idx is not None
    return list(idx.tolist())


def test_streaming_keeps_sinks_and_recent() -> None:
    ev = WindowEvictor(budget=8, sinks=4)
    ev.bind(layout(), capacity=64)
    assert ev.keep(0, 8, 1) is None
    assert kept(ev, 20) == [[0, 1, 2, 3, 16, 17, 18, 19]] * 2
    assert kept(WindowEvictor(budget=3), 10) == [[7, 8, 9]]


def test_h2o_keeps_heavy_hitters_by_accumulated_attention() -> None:
    ev = H2OEvictor(budget=4, recent=2)
    ev.bind(layout(), capacity=64)
    step = SliceStep(0, 0, 0)
    ev.observe(step, torch.tensor([[5.0, 0.1, 3.0, 0.2, 0.0, 0.0], [0.0, 4.0, 0.0, 2.0, 9.0, 9.0]]))
    ev.observe(step, torch.tensor([[0.0, 0.0, 0.0, 4.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]))
    # Head 0 accumulated [5, .1, 3, 4.2, 0] over the 5 older tokens; head 1 [1, 4, 0, 2, 9].
    assert kept(ev, 7) == [[0, 3, 5, 6], [1, 4, 5, 6]]
    assert torch.allclose(ev.scores[0], torch.tensor([[5.0, 4.2, 0.0, 1.0], [4.0, 9.0, 9.0, 1.0]]))


def test_snapkv_keeps_observation_window_votes() -> None:
    ev = SnapKVEvictor(budget=5, window=2, kernel=1)
    ev.bind(layout(group=1), capacity=64)
    assert list(ev.rows(1)) == [] and list(ev.rows(6)) == [4, 5]
    ev.observe(SliceStep(0, 0, 0), torch.tensor([[0.5, 0.0, 0.9, 0.1, 0.7, 0.3, 0.4, 0.2]]))
    assert kept(ev, 8, 8) == [[0, 2, 4, 6, 7]]
    assert ev.keep(0, 9, 1) is None  # decode steps append without eviction


def test_attention_mass_is_causal_and_sums_to_queries() -> None:
    q = torch.randn(3, 2, 4)
    kv = torch.randn(5, 2, 1, 4)
    mass = attention_mass(q, kv, start=2, rows=range(3))
    assert mass.shape == (1, 5)
    assert torch.allclose(mass.sum(), torch.tensor(6.0))  # 3 queries x 2 query heads
    first_only = attention_mass(q, kv, start=2, rows=range(1))
    assert first_only[0, 3:].eq(0).all()  # query at index 2 cannot see 3, 4


@pytest.mark.parametrize("evict", ["streaming", "h2o", "snapkv", "window"])
def test_evicting_store_keeps_budget_and_position(gqa: tuple[CausalLM, ModelConfig], evict: str) -> None:
    model, cfg = gqa
    parts = build_policy(cfg, device=CPU, **options(evict=evict, kv_budget=40))
    # SnapKV compresses a step only when it has a full observation window (32 queries).
    logits, store = run(model, cfg, parts, chunk=PROMPT if evict == "snapkv" else 20)
    assert store.position == PROMPT + DECODE
    expected = 40 + (DECODE if evict == "snapkv" else 0)  # SnapKV does not evict at decode
    assert store.slice_length == [expected] * 3 and store.length == expected
    assert all(torch.isfinite(x).all() for x in logits)


@pytest.mark.parametrize("evict", ["snapkv", "h2o"])
def test_an_evictors_plan_holds_what_its_store_allocates(
    gqa: tuple[CausalLM, ModelConfig], evict: str
) -> None:
    """The plan's GPU bytes bound the store's peak, decode included: SnapKV keeps every decoded
    token (it evicts in prefill only), so its plan counts the request's new tokens too."""
    from kvtier.methods import parse_choice, plan_for
    from kvtier.planner.hardware import hardware_preset
    from kvtier.planner.inputs import PlanInputs

    model, cfg = gqa
    prompt, chunk, decode, budget = 400, 50, 150, 40
    spec = f"{evict},kv_budget={budget}"
    inputs = PlanInputs(
        cfg,
        prompt + decode,
        hardware=hardware_preset("h200"),
        dtype_bytes=4,
        gpu_budget=None,
        chunk_size=chunk,
        block_size=8,
        new_tokens=decode,
    )
    plan = plan_for(inputs, parse_choice(spec)).plan
    assert plan.context < prompt + decode  # planned for what it keeps, not the context
    parts = build_policy(cfg, device=CPU, **options(evict=evict, kv_budget=budget))
    store = make_store(cfg, plan, parts, capacity=prompt + decode)
    ids = torch.randint(0, cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(5))
    logits = None
    for s in range(0, prompt, chunk):
        store.begin_step(chunk)
        logits = model(ids[s : s + chunk], store)
        store.end_step()
    for _ in range(decode):
        assert logits is not None
        store.begin_step(1)
        logits = model(logits[-1].argmax().view(1), store)
        store.end_step()
    kept = budget + (decode if evict == "snapkv" else 0)
    assert store.slice_length == [kept] * 3
    assert store.account.peak["gpu"] <= plan.gpu_kv_bytes
    if evict == "snapkv":  # unknown new tokens: up to the whole context
        unknown = plan_for(replace(inputs, new_tokens=None), parse_choice(spec)).plan
        assert unknown.context == prompt + decode


def test_cache_rope_kernel_without_eviction_matches_default(gqa: tuple[CausalLM, ModelConfig]) -> None:
    model, cfg = gqa
    parts = build_policy(cfg, device=CPU, **options(evict="streaming", kv_budget=200))
    no_evict = PolicyParts(kernel=parts.kernel, rotate_keys=False)
    ref, _ = run(model, cfg, PolicyParts(), chunk=20)
    got, _ = run(model, cfg, no_evict, chunk=20)
    for a, b in zip(got, ref, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


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


# -- head sparsity ----------------------------------------------------------------------------


def test_head_classification_is_deterministic_and_cached(
    gqa: tuple[CausalLM, ModelConfig], tmp_path: Path
) -> None:
    model, cfg = gqa
    a = head_scores(model, segment=16, repeats=3, cache_dir=tmp_path)
    assert a.shape == (cfg.num_layers, cfg.num_kv_heads)
    assert len(list(tmp_path.iterdir())) == 1
    assert torch.equal(head_scores(model, segment=16, repeats=3, cache_dir=tmp_path), a)
    assert torch.equal(head_scores(model, segment=16, repeats=3, cache_dir=None), a)
    ev = HeadStreamingEvictor(a, ratio=0.5, sinks=2, recent=4)
    lay = KVLayout(
        num_layers=3, num_kv_heads=2, head_dim=16, q_per_kv=2, group_size=1, block_size=8, dtype=torch.float32
    )
    streaming = ev.bind(lay, capacity=64)
    assert len(streaming) == 3
    assert max(a.flatten()[s] for s in streaming) <= min(a.flatten()[s] for s in set(range(6)) - streaming)


def test_head_sparsity_compacts_only_streaming_heads(
    gqa: tuple[CausalLM, ModelConfig], tmp_path: Path
) -> None:
    model, cfg = gqa
    parts = build_policy(cfg, device=CPU, model=model, head_cache=tmp_path, **options(head_sparsity=0.5))
    assert isinstance(parts.evictor, HeadStreamingEvictor)
    assert (parts.evictor.sinks, parts.evictor.recent) == (64, 256)  # DuoAttention's defaults
    small = HeadStreamingEvictor(parts.evictor.scores, 0.5, sinks=4, recent=20)
    _, store = run(model, cfg, PolicyParts(evictor=small), group=1)
    assert sorted(store.slice_length) == [24] * 3 + [PROMPT + DECODE] * 3
    assert store.length == store.position == PROMPT + DECODE


def test_head_sparsity_with_offload_keeps_streaming_heads_on_gpu_and_streams_retrieval_heads(
    gqa: tuple[CausalLM, ModelConfig], tmp_path: Path
) -> None:
    model, cfg = gqa
    scores = head_scores(model, segment=16, repeats=3, cache_dir=tmp_path)
    ev = HeadStreamingEvictor(scores, 0.5, sinks=4, recent=20)
    logits, store = run(model, cfg, PolicyParts(evictor=ev), group=1, chunk=25, streamed=True)
    chunked, _ = run(
        model, cfg, PolicyParts(evictor=HeadStreamingEvictor(scores, 0.5, 4, 20)), group=1, chunk=25
    )
    for a, b in zip(logits, chunked, strict=True):
        assert torch.equal(a, b)  # offloading the retrieval heads changes nothing
    streaming = ev.streaming_slices(store.layout)
    assert set(store.resident) == streaming and set(store.hosts) == set(range(6)) - streaming
    # GPU: the 3 streaming heads keep sinks + recent = 24 tokens, in buffers of at most twice
    # that (block-rounded), whatever the context; plus 2 staging buffers for retrieval heads.
    assert all(store.slice_length[s] == 24 and store.resident[s].shape[0] <= 64 for s in streaming)
    token = 2 * cfg.head_dim * 4
    assert store.account.allocated["gpu"] == 3 * 64 * token + 2 * 72 * token
    assert store.account.d2h_bytes == 3 * (PROMPT + DECODE) * token  # only retrieval heads go to host


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
