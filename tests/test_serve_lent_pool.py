"""The pool's side of lending pages to a tiered run: how many a run may borrow (the share, what
a full batch keeps, the keep's withheld pages for a request that fits nowhere else), buffers
past them spilling to the reserve, cached pages saved to the host tier before a run overwrites
them, pages given back on abort, a request that fits only over lent pages, the allocator's
cache freed once a run's prefill ends, and the pool compacted so a run finds a long stretch.
"""

from __future__ import annotations

from pathlib import Path
from queue import Queue
from typing import Any

import pytest
import torch

from kvtier.engine.batch.sequence import Delta
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.kv.device_memory import RegionMemory
from kvtier.methods import parse_choice
from kvtier.serve.engine import ServeConfig, ServeEngine
from kvtier.serve.metrics import render
from tests.hf_reference import make_hf_model
from tests.serve_helpers import gqa_llm
from tests.serve_lent_helpers import collect, head_request, served_alone, tokens


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return gqa_llm(tmp_path_factory)


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


@pytest.mark.parametrize("release", [False, True])
def test_the_allocator_cache_is_freed_once_when_a_runs_prefill_ends_if_asked(llm: LLM, release: bool) -> None:
    g = torch.Generator().manual_seed(14)
    ids = torch.randint(1, 211, (40,), generator=g).tolist()
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64, tiered_release_after_prefill=release))
    q = collect(engine, ids, SamplingParams(max_tokens=4), method=parse_choice("head"))
    engine.run_until_idle()
    assert len(tokens(q)) == 4 and engine.offloaded == 1
    assert engine.cache_releases == int(release)  # at its first token only, not at every token


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
