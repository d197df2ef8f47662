"""Eviction policies over the store: exact eviction indices (streaming, H2O, SnapKV), the budget
each keeps in the store and in its plan, and head sparsity (deterministic head classification,
streaming heads compacted on the GPU, retrieval heads offloaded). Quest: test_policies_quest.py;
option errors and the bytes of each policy: test_policies_store.py; quantized KV:
test_quantized_kv.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.attention.interface import SliceStep
from kvtier.config import ModelConfig
from kvtier.kv.layout import KVLayout
from kvtier.methods import build_policy
from kvtier.model.llama import CausalLM
from kvtier.policies import PolicyParts
from kvtier.policies.evict import H2OEvictor, SnapKVEvictor, WindowEvictor
from kvtier.policies.head_sparsity import HeadStreamingEvictor, head_scores
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
