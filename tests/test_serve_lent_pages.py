"""One store: a tiered request's whole-capacity buffers are a run of the server's KV pages.

`region_buffers` (placed by `fitting`) must be exactly what a store takes from its
`RegionMemory`; the store over a region must give the same logits as over the caching
allocator; and a served request that streams from the host borrows a run of pool pages,
equals `LLM.generate`, and gives them back.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from queue import Queue
from typing import Any

import pytest
import torch

from kvtier.engine.batch.sequence import Delta
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import CapacityError
from kvtier.kv.device_memory import RegionMemory, fitting, region_buffers
from kvtier.kv.layout import KVLayout
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.methods import parse_choice
from kvtier.planner.placement import KVPlan
from kvtier.policies import PolicyParts
from kvtier.serve.engine import ServeConfig, ServeEngine
from kvtier.serve.metrics import render
from kvtier.sparse import HipKernel
from tests.hf_reference import make_hf_model
from tests.serve_helpers import gqa_llm
from tests.serve_lent_helpers import collect, head_request, served_alone, tokens

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return gqa_llm(tmp_path_factory)


PLANS = [
    KVPlan("gpu", group_size=2, resident_slices=3, chunk_size=64, staging_buffers=0, staging_tokens=0),
    KVPlan("head", group_size=1, resident_slices=0, chunk_size=16, staging_buffers=2, staging_tokens=48),
    KVPlan("auto", group_size=1, resident_slices=2, chunk_size=16, staging_buffers=3, staging_tokens=24),
    KVPlan("layer", group_size=2, resident_slices=1, chunk_size=16, staging_buffers=2, staging_tokens=48),
]


@pytest.mark.parametrize("plan", PLANS, ids=[p.policy for p in PLANS])
def test_a_store_over_a_region_takes_region_bytes_and_equals_the_allocator(llm: LLM, plan: KVPlan) -> None:
    ids = torch.randint(1, 211, (37,), generator=torch.Generator().manual_seed(5))
    lay = KVLayout.of(llm.model_config, plan.group_size, 8, torch.float32)

    def check(store: TieredKVStore, inside: Callable[[torch.Tensor], bool]) -> None:
        bufs = list(store.resident.values()) + (store.ring.buffers if store.ring else [])
        assert bufs and all(inside(b) for b in bufs)

    same_over_a_region(
        llm, plan, PolicyParts(), ids, 48, region_buffers(lay, plan, 48), check, chunk=len(ids)
    )


def test_a_region_too_small_raises_capacity_error() -> None:
    memory = RegionMemory(torch.zeros(1024, dtype=torch.uint8))
    assert memory.empty((64,), torch.float32).shape == (64,)
    with pytest.raises(CapacityError, match="sized too small"):
        memory.empty((200,), torch.float32)


def test_a_region_with_a_spill_places_first_fit_as_fitting_says() -> None:
    from kvtier.kv.device_memory import CachingMemory, fitting

    region = torch.zeros(3000, dtype=torch.uint8)
    memory = RegionMemory(region, spill=CachingMemory(CPU))
    sizes = [1200, 2000, 600, 100]  # bytes: 1200 fits, 2000 spills, 600 and 100 fit after it
    inside = []
    for n in sizes:
        t = memory.empty((n // 4,), torch.float32)
        inside.append(region.data_ptr() <= t.data_ptr() < region.data_ptr() + 3000)
    assert inside == [True, False, True, True]
    # 1200 at 0; 600 at 1536 (aligned to 512); 100 at 2560
    assert memory.spilled == 2000 and memory.used == fitting(sizes, 3000) == 2560 + 100


KERNELS = {
    "head": "DenseKernel",
    "hip,hip_preset=fast,kv=head": "HipKernel",
    "quest,kv_budget=8,quest_page=4,kv=head": "QuestKernel",
    "int8,kv=head": "DenseKernel",
}


@pytest.mark.parametrize("spec", list(KERNELS))
def test_a_streaming_request_borrows_a_run_of_pool_pages_and_gives_it_back(llm: LLM, spec: str) -> None:
    """A request streaming from the host (lossless "head", HiP, Quest or quantized) over a pool
    with room: its staging buffers are views of pool pages, lent from the top while short
    requests take pages from the bottom, its tokens equal `LLM.generate`, and the pages come
    back at its end. HiP's block caches, bounded by the request's 46 tokens (36K tokens a slice
    under `fast` otherwise), and Quest's page bounds (a few KB a slice) are carved from the run
    after the store's buffers."""
    g = torch.Generator().manual_seed(9)
    long_ids = torch.randint(1, 211, (40,), generator=g).tolist()
    shorts = [torch.randint(1, 211, (n,), generator=g).tolist() for n in (7, 13)]
    params = SamplingParams(max_tokens=6)
    expected = llm.generate(long_ids, params, method=spec)[0].token_ids
    expected_short = [llm.generate(s, SamplingParams(max_tokens=4))[0].token_ids for s in shorts]
    engine = ServeEngine(
        llm, ServeConfig(page_size=4, num_pages=1024, tiered_share=0.5, tiered_keep_tokens=4)
    )
    pool = engine.kv.pool
    seen: dict[str, object] = {}

    def sink(d: Delta) -> None:
        (run,) = engine._tiered.values()
        assert run.store is not None and run.store.ring is not None
        storage = engine.store.storage
        base, end = storage.data_ptr(), storage.data_ptr() + storage.numel() * storage.element_size()
        seen["inside"] = all(base <= b.data_ptr() < end for b in run.store.ring.buffers)
        seen["kernel"] = type(run.store.kernel).__name__
        banks = [c.bank for c in getattr(run.store.kernel, "_gpu", {}).values()]
        seen["banks_inside"] = len(banks), all(base <= b.data_ptr() < end for b in banks)
        bounds = list(getattr(run.store.kernel, "_bounds", {}).values())
        seen["bounds_inside"] = len(bounds), all(base <= b.data_ptr() < end for b in bounds)
        seen["lent"] = dict(pool.lent)
        seen["short_pages"] = [p for s in engine.scheduler.running for p in s.block_table]
        seen["metrics"] = render(engine, "m").splitlines()
        long_q.put(d)

    long_q: Queue[Delta] = Queue()
    engine.submit(long_ids, params, sink, method=parse_choice(spec))
    short_qs = [collect(engine, s, SamplingParams(max_tokens=4)) for s in shorts]
    engine.run_until_idle()
    assert tokens(long_q) == list(expected)
    assert seen["kernel"] == KERNELS[spec]
    assert [tokens(q) for q in short_qs] == [list(t) for t in expected_short]
    assert seen["inside"] is True
    if KERNELS[spec] == "HipKernel":
        assert seen["banks_inside"] == (6, True)  # 3 layers x 2 KV heads, bounded by its 46 tokens
    if KERNELS[spec] == "QuestKernel":
        assert seen["bounds_inside"] == (2, True)  # the layer past the 2 dense ones x 2 KV heads
    lent = seen["lent"]
    assert isinstance(lent, dict) and len(lent) == 1
    ((first, count),) = lent.items()
    assert 0 < count <= 512 and first + count == 1024  # from the top of the pool
    assert all(p < first for p in seen["short_pages"])  # type: ignore[attr-defined]
    assert f'kvtier:kv_pages_used{{model_name="m",tier="gpu_lent"}} {count}' in seen["metrics"]  # type: ignore[operator]
    assert pool.lent == {} and pool.num_free == 1024  # given back
    assert engine.offloaded == 1


def test_a_hip_request_keeps_its_decode_memory_in_lent_pages(llm: LLM) -> None:
    """A streaming HiP request over a pool with room for them: after its staging buffers, its
    RoPE table and each streamed slice's decode rows and block cache are carved from its run of
    pool pages too (the plan's `method_buffers`), its tokens equal `LLM.generate`, and the
    pages come back."""
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(1, 211, (40,), generator=g).tolist()
    params, spec = SamplingParams(max_tokens=6), "hip,hip_preset=fast,kv=head"
    expected = llm.generate(ids, params, method=spec)[0].token_ids
    pages = 32_768  # 3 KB pages: half of them hold six 4.6 MB banks and a 64K-row RoPE table
    config = ServeConfig(page_size=4, num_pages=pages, tiered_share=0.5, tiered_keep_tokens=4)
    engine = ServeEngine(llm, config)
    seen: dict[str, object] = {}

    def sink(d: Delta) -> None:
        (run,) = engine._tiered.values()
        assert run.store is not None
        storage = engine.store.storage
        base, end = storage.data_ptr(), storage.data_ptr() + storage.numel() * storage.element_size()
        kernel = run.store.kernel
        assert isinstance(kernel, HipKernel) and kernel.rotary is not None
        banks = [c.bank for c in kernel._gpu.values()]
        rows = [t for pair in kernel._rows.values() for t in pair]
        rope = [kernel.rotary._cos, kernel.rotary._sin]
        seen["banks_inside"] = len(banks), all(base <= b.data_ptr() < end for b in banks)
        seen["rows_inside"] = len(rows), all(base <= t.data_ptr() < end for t in rows + rope)
        q.put(d)

    q: Queue[Delta] = Queue()
    engine.submit(ids, params, sink, method=parse_choice(spec))
    engine.run_until_idle()
    assert tokens(q) == list(expected)
    assert seen["banks_inside"] == (6, True)  # 3 layers x 2 KV heads, each streamed
    assert seen["rows_inside"] == (12, True)  # a decode query per slice: keys and values
    assert engine.kv.pool.lent == {} and engine.kv.pool.num_free == pages


def test_lending_leaves_the_batch_its_share_and_what_a_full_batch_keeps(llm: LLM) -> None:
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=100, tiered_share=0.3, tiered_keep_tokens=0))
    assert engine.lendable_pages() == 30
    first = engine.lend(20)
    assert first == 80 and engine.lendable_pages() == 10  # the share is for all runs together
    engine.kv.pool.return_run(80)
    off = ServeEngine(llm, ServeConfig(page_size=4, num_pages=100, tiered_share=0.0))
    assert off.lendable_pages() == 0
    # 4 sequences x 80 tokens = 80 pages kept for the batch: 20 of 100 may go
    kept = ServeEngine(
        llm, ServeConfig(page_size=4, num_pages=100, max_num_seqs=4, tiered_keep_tokens=80, tiered_share=0.5)
    )
    assert kept.lendable_pages() == 20
    # the default keeps 64 x 2,048 tokens: a pool smaller than that lends nothing, but to a
    # request that fits nowhere else (`plan_store` asks without the keep): the share
    small = ServeEngine(llm, ServeConfig(page_size=4, num_pages=100))
    assert small.lendable_pages() == 0 and small.lendable_pages(keep_batch=False) == 25


def test_a_request_that_fits_nowhere_else_borrows_what_the_batchs_keep_withheld(llm: LLM) -> None:
    """A server whose batch keeps every page (a pool smaller than max_num_seqs x
    tiered_keep_tokens, as an 8B model's under 24 GiB) and whose reserve is short of a
    request's staging buffers: the request borrows the free pages the keep withheld (up to the
    share), equals `LLM.generate` and gives them back; with no share to borrow it fails with
    CapacityError in its own words."""
    from kvtier.planner.memory import GPU_RESERVE_BYTES, weight_bytes

    ids, params, expected = head_request(llm, 8, 6)
    # weights, the CUDA reserve and activations fit; the two staging buffers do not
    budget = weight_bytes(llm.model_config, 4) + GPU_RESERVE_BYTES + 128_000
    outcomes = {}
    for share in (0.5, 0.0):
        cfg = ServeConfig(page_size=4, num_pages=100, tiered_share=share, tiered_keep_tokens=10**6)
        engine = ServeEngine(llm, cfg)
        engine.offload_gpu_budget = lambda: budget  # type: ignore[method-assign]
        assert engine.lendable_pages() == 0
        lent: list[int] = []
        q: Queue[Delta] = Queue()

        def sink(d: Delta, engine: ServeEngine = engine, lent: list[int] = lent, q: Queue[Delta] = q) -> None:
            lent.append(engine.kv.pool.num_lent)
            q.put(d)

        engine.submit(ids, params, sink, method=parse_choice("head"))
        engine.run_until_idle()
        outcomes[share] = q
        assert engine.kv.pool.lent == {} and engine.kv.pool.num_free == 100
        if share:
            assert tokens(q) == list(expected)
            assert 0 < max(lent) <= 50
    errors = [d.error for d in list(outcomes[0.0].queue) if d.error]
    assert errors and errors[0].startswith("CapacityError: a 46-token request does not fit")
    assert "--offload-reserve" in errors[0] and "no pages to lend" in errors[0]


def test_a_sliding_window_models_request_borrows_pages_for_its_full_layers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A model with sliding-window layers (Qwen2's: layer 0 full, layers 1 and 2 a 6-token
    window): a request past the window streams its full layer's slices through staging buffers
    carved from lent pages, its windowed layers' slices stay with the caching allocator
    (`region_buffers(..., windowed)`), and its tokens equal `LLM.generate`. (Windowed models
    borrowed nothing before.)"""
    folder: Path = tmp_path_factory.mktemp("qwen2-window")
    make_hf_model("qwen2-window", folder)
    windowed = LLM(str(folder), device="cpu", dtype="fp32", kv="gpu")
    ids, params, expected = head_request(windowed, 11, 6)
    cfg = ServeConfig(page_size=4, num_pages=200, tiered_share=0.5, tiered_keep_tokens=0)
    engine = ServeEngine(windowed, cfg)
    out, seen = served_alone(
        engine,
        ids,
        params,
        "head",
        lambda run: {
            "lent": engine.kv.pool.num_lent,
            "region": isinstance(run.store.memory, RegionMemory),
            "windows": len(run.store._windowed),
            "staged": run.store.ring is not None,
        },
    )
    assert out == list(expected)
    assert seen["region"] is True and seen["lent"] > 0
    assert seen["windows"] == 4 and seen["staged"] is True  # 2 windowed layers x 2 KV heads
    assert engine.kv.pool.lent == {} and engine.kv.pool.num_free == 200


def test_buffers_past_the_lendable_pages_spill_to_the_reserve_and_tokens_stay_equal(llm: LLM) -> None:
    """Only one of the run's two staging buffers fits the pages it may borrow: that one lives
    in the lent run, the other in the caching allocator, and the tokens still equal generate."""
    ids, params, expected = head_request(llm, 4, 5)
    cfg = ServeConfig(page_size=4, num_pages=100, tiered_share=0.15, tiered_keep_tokens=0)
    engine = ServeEngine(llm, cfg)

    def probe(run: Any) -> dict[str, Any]:
        memory = run.store.memory
        assert isinstance(memory, RegionMemory)
        return {"spilled": memory.spilled, "used": memory.used, "lent": engine.kv.pool.num_lent}

    out, seen = served_alone(engine, ids, params, "head", probe)
    assert out == list(expected)
    assert seen["spilled"] > 0 and seen["used"] > 0  # one buffer each way
    assert 0 < seen["lent"] <= 15 and seen["lent"] == -(-seen["used"] // engine.page_bytes)
    assert engine.kv.pool.lent == {} and engine.kv.pool.num_free == 100


def test_a_run_over_cached_pages_saves_them_to_the_host_tier_first(llm: LLM) -> None:
    """A run lent over pages that hold a cached prefix: the pool evicts them to the host tier
    before the run's store writes there, and the prefix, asked again, comes back from the host
    tier with the same tokens."""
    g = torch.Generator().manual_seed(6)
    prefix = torch.randint(1, 211, (41,), generator=g).tolist()  # 10 full pages of 4
    long_ids = torch.randint(1, 211, (40,), generator=g).tolist()
    short = SamplingParams(max_tokens=3)
    cfg = ServeConfig(page_size=4, num_pages=24, num_host_pages=16, tiered_share=1.0, tiered_keep_tokens=0)
    engine = ServeEngine(llm, cfg)
    first_q = collect(engine, prefix, short)
    engine.run_until_idle()
    want = tokens(first_q)
    pool = engine.kv.pool
    cached = set(pool.lru)
    assert len(cached) == 10
    lent: dict[int, int] = {}

    def sink(d: Delta) -> None:
        lent.update(pool.lent)
        long_q.put(d)

    long_q: Queue[Delta] = Queue()
    engine.submit(long_ids, SamplingParams(max_tokens=4), sink, method=parse_choice("head"))
    engine.run_until_idle()
    assert tokens(long_q) == list(
        llm.generate(long_ids, SamplingParams(max_tokens=4), method="head")[0].token_ids
    )
    ((start, count),) = lent.items()
    overlapped = {p for p in cached if start <= p < start + count}
    assert overlapped and engine.kv.host.saved >= len(overlapped)  # saved before being overwritten
    hits_before = engine.kv.stats.host_hits
    again = collect(engine, prefix, short)
    engine.run_until_idle()
    assert tokens(again) == want
    assert engine.kv.stats.host_hits - hits_before == 4 * len(overlapped)  # those pages came from the host


def test_an_aborted_run_gives_its_pages_back(llm: LLM) -> None:
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(1, 211, (40,), generator=g).tolist()
    cfg = ServeConfig(page_size=4, num_pages=200, tiered_share=0.5, tiered_keep_tokens=0)
    engine = ServeEngine(llm, cfg)
    seen: list[int] = []

    def sink(d: Delta) -> None:
        seen.append(engine.kv.pool.num_lent)
        if len(seen) == 1:
            engine.abort(rid)

    rid = engine.submit(ids, SamplingParams(max_tokens=30), sink, method=parse_choice("head"))
    engine.run_until_idle()
    assert seen[0] > 0  # it had borrowed pages
    assert engine.kv.pool.lent == {} and engine.kv.pool.num_free == 200


def test_lent_pages_make_a_request_fit_that_the_reserve_alone_cannot(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a GPU budget for stores of their own that holds a 16-token chunk's activations but
    not one staging block, the request fits only over lent pages; it then runs there and
    equals `LLM.generate` (budgets are numbers to the planner, so the CPU can play a GPU's)."""
    from kvtier.planner.memory import GPU_RESERVE_BYTES, activation_bytes, weight_bytes

    folder: Path = tmp_path_factory.mktemp("gqa16")
    make_hf_model("llama-gqa", folder)
    small = LLM(str(folder), device="cpu", dtype="fp32", kv="gpu", chunk_size=16)
    cfg = small.model_config
    ids, params, expected = head_request(small, 10, 4)
    act = activation_bytes(cfg, 16, 4, group_size=1, context=len(ids) + 4)
    engine = ServeEngine(
        small, ServeConfig(page_size=4, num_pages=400, tiered_share=0.5, tiered_keep_tokens=0)
    )
    budget = weight_bytes(cfg, 4) + GPU_RESERVE_BYTES + act + 64  # no room for a staging block
    monkeypatch.setattr(engine, "offload_gpu_budget", lambda: budget)
    seen: list[int] = []

    def sink(d: Delta) -> None:
        seen.append(engine.kv.pool.num_lent)
        q.put(d)

    q: Queue[Delta] = Queue()
    engine.submit(ids, params, sink, method=parse_choice("head"))
    engine.run_until_idle()
    assert tokens(q) == list(expected) and seen and seen[0] > 0
    # the same budget and no pages to borrow: the request fails with the reason
    none = ServeEngine(small, ServeConfig(page_size=4, num_pages=400, tiered_share=0.0))
    monkeypatch.setattr(none, "offload_gpu_budget", lambda: budget)
    failed: Queue[Delta] = Queue()
    none.submit(ids, params, failed.put, method=parse_choice("head"))
    none.run_until_idle()
    last = [failed.get() for _ in range(failed.qsize())][-1]
    assert last.finish_reason == "error" and last.error is not None and "CapacityError" in last.error


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_a_quantized_request_borrows_pages_for_its_unpack_buffers(llm: LLM, spec: str) -> None:
    """A quantized request whose store fits the device joins the batch's forward; its two
    whole-slice buffers that packed rows unpack into are lent pages, given back when it ends,
    and its tokens equal `LLM.generate(method=spec)`."""
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(1, 211, (40,), generator=g).tolist()
    params = SamplingParams(max_tokens=5)
    expected = llm.generate(ids, params, method=spec)[0].token_ids
    cfg = ServeConfig(page_size=4, num_pages=400, tiered_share=0.5, tiered_keep_tokens=0)
    engine = ServeEngine(llm, cfg)
    seen: dict[str, object] = {}

    def sink(d: Delta) -> None:
        (seq,) = [s for s in engine.scheduler.running if s.own is not None]
        assert seq.own is not None
        memory = seq.own.store.memory
        seen.update(lent=engine.kv.pool.num_lent, region=isinstance(memory, RegionMemory))
        q.put(d)

    q: Queue[Delta] = Queue()
    engine.submit(ids, params, sink, method=parse_choice(spec))
    engine.run_until_idle()
    assert tokens(q) == list(expected)
    assert seen["region"] is True and isinstance(seen["lent"], int) and seen["lent"] > 0
    assert engine.own_store_requests == 1 and engine.kv.pool.lent == {} and engine.kv.pool.num_free == 400


@pytest.mark.parametrize("release", [False, True])
def test_the_allocator_cache_is_freed_once_when_a_runs_prefill_ends_if_asked(llm: LLM, release: bool) -> None:
    g = torch.Generator().manual_seed(14)
    ids = torch.randint(1, 211, (40,), generator=g).tolist()
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64, tiered_release_after_prefill=release))
    q = collect(engine, ids, SamplingParams(max_tokens=4), method=parse_choice("head"))
    engine.run_until_idle()
    assert len(tokens(q)) == 4 and engine.offloaded == 1
    assert engine.cache_releases == int(release)  # at its first token only, not at every token


@pytest.mark.parametrize("spec", ["hip,hip_preset=fast", "quest,kv_budget=8,quest_page=4"])
def test_a_resident_sparse_request_joins_the_batch_over_lent_pages(llm: LLM, spec: str) -> None:
    """A HiP or Quest request whose store fits the device joins the batch's forward with its
    resident slices carved from a run of pool pages; its tokens equal `LLM.generate`, the short
    request beside it is unchanged, and the pages come back."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 211, (30,), generator=g).tolist()
    short = torch.randint(1, 211, (9,), generator=g).tolist()
    params = SamplingParams(max_tokens=5)
    expected = llm.generate(ids, params, method=spec)[0].token_ids
    expected_short = llm.generate(short, SamplingParams(max_tokens=4))[0].token_ids
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=256, tiered_share=0.5, tiered_keep_tokens=4))
    seen: dict[str, object] = {}

    def sink(d: Delta) -> None:
        (seq,) = [s for s in engine.scheduler.running if s.own is not None]
        assert seq.own is not None
        storage = engine.store.storage
        base, end = storage.data_ptr(), storage.data_ptr() + storage.numel() * storage.element_size()
        bufs = list(seq.own.store.resident.values())
        seen["inside"] = bool(bufs) and all(base <= b.data_ptr() < end for b in bufs)
        seen["lent"] = engine.kv.pool.num_lent
        q.put(d)

    q: Queue[Delta] = Queue()
    engine.submit(ids, params, sink, method=parse_choice(spec))
    short_q = collect(engine, short, SamplingParams(max_tokens=4))
    engine.run_until_idle()
    assert tokens(q) == list(expected)
    assert tokens(short_q) == list(expected_short)
    assert seen["inside"] is True and isinstance(seen["lent"], int) and seen["lent"] > 0
    assert engine.own_store_requests == 1 and engine.kv.pool.lent == {} and engine.kv.pool.num_free == 256


@pytest.mark.parametrize(
    "spec", ["h2o,kv_budget=16", "window,kv_budget=16", "snapkv,kv_budget=40", "duo,head_sparsity=0.5"]
)
def test_an_evicting_request_keeps_its_slices_in_lent_pages(llm: LLM, spec: str) -> None:
    """An evictor's slices are allocated once at what they keep plus a step (the plan's
    `compact_tokens`), so in the server its store (which joins the batch's forward: nothing
    streams) lives in a run of lent pool pages; its tokens equal `LLM.generate`'s."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 211, (72,), generator=g).tolist()
    params = SamplingParams(max_tokens=12)
    expected = llm.generate(ids, params, method=spec)[0].token_ids
    engine = ServeEngine(
        llm, ServeConfig(page_size=4, num_pages=1024, tiered_share=0.5, tiered_keep_tokens=4)
    )
    seen: dict[str, object] = {}

    def sink(d: Delta) -> None:
        (own,) = [s.own for s in engine.scheduler.running if s.own is not None]  # in the batch's forward
        storage = engine.store.storage
        base, end = storage.data_ptr(), storage.data_ptr() + storage.numel() * storage.element_size()
        bufs = list(own.store.resident.values())
        seen["inside"] = bool(bufs) and all(base <= b.data_ptr() < end for b in bufs)
        seen["lent"] = dict(engine.kv.pool.lent)
        q.put(d)

    q: Queue[Delta] = Queue()
    engine.submit(ids, params, sink, method=parse_choice(spec))
    engine.run_until_idle()
    assert tokens(q) == list(expected)
    assert engine.own_store_requests == 1
    assert seen["inside"] is True and len(seen["lent"]) == 1  # type: ignore[arg-type]
    assert engine.kv.pool.lent == {} and engine.kv.pool.num_free == 1024


def test_head_sparsitys_store_over_a_region_takes_what_region_buffers_says(llm: LLM) -> None:
    """Head sparsity mixes compact slices (at `compact_tokens`) with placed ones (whole, or
    streamed through staging): the store asks for the whole ones, then the compact ones, then
    staging, as `region_buffers` lists them, and gives the allocator's logits."""
    plan = KVPlan(
        "auto", group_size=1, resident_slices=2, chunk_size=16, staging_buffers=2, staging_tokens=40,
        compact_slices=3, compact_tokens=72 + 16,
    )  # fmt: skip
    parts = parse_choice("duo,head_sparsity=0.5,kv_budget=72").build(
        llm.model_config, CPU, llm.loaded.model, None, context=120
    )
    ids = torch.randint(1, 211, (96,), generator=torch.Generator().manual_seed(6))
    lay = KVLayout.of(llm.model_config, plan.group_size, 8, torch.float32)
    sizes = region_buffers(lay, plan, 120)
    assert len(sizes) == 2 + 3 + 2 and sizes[2] < sizes[0]  # whole, compact, staging

    def check(store: TieredKVStore, inside: Callable[[torch.Tensor], bool]) -> None:
        assert sorted(store.slice_length) == [72] * 3 + [100] * 3  # the streaming heads evicted
        bufs = list(store.resident.values()) + (store.ring.buffers if store.ring else [])
        assert len(bufs) == 7 and all(inside(b) for b in bufs)

    same_over_a_region(llm, plan, parts, ids, 120, sizes, check)


@pytest.mark.parametrize("codec", ["int4", "fp8"])
@pytest.mark.parametrize("resident", [0, 3])
def test_a_quantized_store_over_a_region_takes_what_region_buffers_says(
    llm: LLM, codec: str, resident: int
) -> None:
    """A quantized store keeps its resident slices packed on the device: their tail rings,
    the staging buffers, their packed rows and the unpack scratch all come from its memory, in
    the order `region_buffers` lists them, and its logits equal the caching allocator's."""
    from kvtier.planner.packed import PackedSizing

    parts = parse_choice(codec).build(llm.model_config, CPU, llm.loaded.model, None, context=96)
    packer = parts.codec
    sizing = PackedSizing.of(packer, 1, llm.model_config.head_dim)  # type: ignore[arg-type]
    plan = KVPlan(
        "auto", group_size=1, resident_slices=resident, chunk_size=16, staging_buffers=2,
        staging_tokens=96, packed=sizing,
    )  # fmt: skip
    ids = torch.randint(1, 211, (80,), generator=torch.Generator().manual_seed(8))
    lay = KVLayout.of(llm.model_config, 1, 8, torch.float32)
    sizes = region_buffers(lay, plan, 96, packing=True)
    assert len(sizes) == (2 + 1 if resident == 0 else 5)  # staging, scratch (+ tails, rows)

    def check(store: TieredKVStore, inside: Callable[[torch.Tensor], bool]) -> None:
        assert len(store.on_device) == resident and store.packed is not None
        rows = [slab for a in store.packed.arenas if a.device is not None for slab in a.slabs()]
        assert len(rows) == (1 if resident else 0)
        assert all(inside(t) for t in [*rows, *store.packed.scratches])

    same_over_a_region(llm, plan, parts, ids, 96, sizes, check)


@pytest.mark.parametrize("extents", [1, 2, 37, 64, 500, 1920])
@pytest.mark.parametrize("extent_mib", [1, 16, 100])
def test_device_slabs_divide_the_extents_exactly_within_the_cap(extents: int, extent_mib: int) -> None:
    """A device arena's slabs hold a whole share of its extents: no byte beyond what the planner
    counts, none over 64 MiB unless one extent is, and a run of lent pages can hold them apart."""
    from kvtier.kv.tiers import DEVICE_SLAB_BYTES, device_slab_bytes

    extent = extent_mib << 20
    slab = device_slab_bytes(extent, extents)
    per = slab // extent
    assert slab % extent == 0 and extents % per == 0
    assert slab <= max(DEVICE_SLAB_BYTES, extent)
    if extents % 4 == 0 and extent_mib == 16:
        assert per == 4  # the most that fit 64 MiB


def same_over_a_region(
    llm: LLM,
    plan: KVPlan,
    parts: PolicyParts,
    ids: torch.Tensor,
    capacity: int,
    sizes: list[int],
    check: Callable[[TieredKVStore, Callable[[torch.Tensor], bool]], None],
    chunk: int = 16,
) -> None:
    """A store of `plan` and `parts` over the caching allocator and over a region sized by
    `fitting(sizes)`: `chunk`-token prefill steps of `ids`, then 4 greedy tokens. The region's store
    uses exactly those bytes (up to the last alignment) and gives the same logits; `check` sees
    each store with a test of whether a tensor lies in the region (never, for the allocator's)."""
    need = fitting(sizes, 1 << 62)
    region = torch.zeros(need + 1000, dtype=torch.uint8)
    base, end = region.data_ptr(), region.data_ptr() + region.numel()
    memory = RegionMemory(region)
    outs = []
    for mem in (None, memory):
        store = TieredKVStore(
            llm.model_config, plan, device=CPU, dtype=torch.float32, capacity=capacity,
            options=StoreOptions(8), memory=mem, **parts.store_kwargs(),
        )  # fmt: skip
        logits = []
        for a in range(0, len(ids), chunk):
            store.begin_step(len(ids[a : a + chunk]))
            logits.append(llm.loaded.model(ids[a : a + chunk], store)[-1])
            store.end_step()
        for _ in range(4):
            store.begin_step(1)
            logits.append(llm.loaded.model(logits[-1].argmax().view(1), store)[-1])
            store.end_step()
        outs.append(torch.stack(logits))
        check(store, (lambda t: base <= t.data_ptr() < end) if mem is not None else (lambda t: True))
        store.close()
    assert memory.used <= need and need - memory.used < 512
    assert torch.equal(outs[0], outs[1])


def test_a_run_compacts_the_pool_when_a_running_request_splits_its_free_pages(llm: LLM) -> None:
    """A short request whose pages sit in the middle of the pool (the ones below it were freed)
    leaves no stretch as long as a run may borrow: before planning the run, its pages move down
    (`ServeEngine.compact`), the run borrows the longer stretch, and both requests' tokens equal
    `LLM.generate`'s (the moved pages kept their tokens and the block table follows them)."""
    g = torch.Generator().manual_seed(21)
    short_ids = torch.randint(1, 211, (13,), generator=g).tolist()
    long_ids = torch.randint(1, 211, (40,), generator=g).tolist()
    short_params, long_params = SamplingParams(max_tokens=12), SamplingParams(max_tokens=6)
    expected_short = llm.generate(short_ids, short_params)[0].token_ids
    expected_long = llm.generate(long_ids, long_params, method="head")[0].token_ids
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64, tiered_share=0.5, tiered_keep_tokens=0))
    pool = engine.kv.pool
    below = [pool.allocate() for _ in range(30)]  # ids 0 .. 29, as if finished requests had held them
    short_q = collect(engine, short_ids, short_params)
    engine._drain(block=False)
    engine.step()  # the short request's prompt: its pages 30 .. 33
    (seq,) = engine.scheduler.running
    assert seq.block_table == [30, 31, 32, 33]
    for page in below:
        pool.release(page)
    assert pool.largest_run() == 30 < engine._lendable_in_all() == 32  # 0.5 of 64, none lent yet
    seen: dict[str, object] = {}

    def sink(d: Delta) -> None:
        seen["lent"] = dict(pool.lent)
        seen["short_table"] = list(seq.block_table)
        long_q.put(d)

    long_q: Queue[Delta] = Queue()
    engine.submit(long_ids, long_params, sink, method=parse_choice("head"))
    engine.run_until_idle()
    # the cheapest window of 32 is 32 .. 63, which holds pages 32 and 33: they move to 0 and 1
    assert engine.pages_compacted == 2
    assert tokens(long_q) == list(expected_long) and tokens(short_q) == list(expected_short)
    short_table = seen["short_table"]
    assert isinstance(short_table, list) and short_table[:4] == [30, 31, 0, 1]
    assert max(short_table) < 32  # it grew from the lowest free ids
    ((first, count),) = seen["lent"].items()  # type: ignore[attr-defined]
    assert first + count == 64 and count > 0
    assert pool.lent == {} and pool.num_free == 64
    assert "kvtier:pages_compacted_total" in render(engine, "m")
