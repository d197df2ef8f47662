"""Prefix caching in the engine: shared pages (exact ids), hit counts, the host tier, exactness."""

from __future__ import annotations

from pathlib import Path
from queue import Queue

import pytest
import torch

from kvtier.engine.batch.sequence import Delta
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.serve.engine import ServeConfig, ServeEngine
from tests.hf_reference import make_hf_model

PREFIX = torch.randint(1, 211, (16,), generator=torch.Generator().manual_seed(5)).tolist()
A, B = [*PREFIX, 7], [*PREFIX, 8, 9]
OTHER = list(range(100, 120))


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder: Path = tmp_path_factory.mktemp("gqa")
    make_hf_model("llama-gqa", folder)
    return LLM(str(folder), device="cpu", dtype="fp32", kv="gpu")


def run(engine: ServeEngine, ids: list[int], max_tokens: int = 2) -> tuple[list[int], int]:
    """Serve one request to the end; (tokens, cached_tokens)."""
    q: Queue[Delta] = Queue()
    engine.submit(ids, SamplingParams(max_tokens=max_tokens), q.put)
    engine.run_until_idle()
    tokens: list[int] = []
    cached = 0
    while not q.empty():
        d = q.get()
        tokens.extend(d.token_ids)
        cached = d.cached_tokens
    return tokens, cached


def fresh(llm: LLM, num_pages: int, host: int = 8) -> ServeEngine:
    return ServeEngine(llm, ServeConfig(page_size=4, num_pages=num_pages, num_host_pages=host))


def test_second_request_shares_the_prefix_pages(llm: LLM) -> None:
    expected_b = run(fresh(llm, 16), B)[0]
    engine = fresh(llm, 16)
    assert run(engine, A) == (run(fresh(llm, 16), A)[0], 0)
    # A computed 18 tokens in pages 0..4; the 4 full ones stay cached, freed tail first.
    assert list(engine.kv.pool.lru) == [3, 2, 1, 0]
    assert engine.kv.pool.free[0] == 4  # the partial last page: free, the lowest free id
    engine.submit(B, SamplingParams(max_tokens=2), lambda d: None)
    engine._drain(block=False)
    engine.step()
    (seq,) = engine.scheduler.running
    assert seq.block_table == [0, 1, 2, 3, 4] and seq.cached_tokens == 16
    assert engine.kv.pool.ref[:4] == [1, 1, 1, 1]
    engine.run_until_idle()
    assert run(engine, B) == (expected_b, 16)
    stats = engine.kv.stats
    assert (stats.queries, stats.hits, stats.host_hits) == (17 + 18 + 18, 32, 0)
    assert engine.kv.pool.num_free == 16


def test_evicted_prefix_comes_back_from_the_host_tier(llm: LLM) -> None:
    expected_b = run(fresh(llm, 16), B)[0]
    engine = fresh(llm, 6)  # 24 tokens: OTHER evicts all of A's cached pages
    run(engine, A)
    run(engine, OTHER)
    assert engine.kv.host.saved == 4
    assert all(engine.kv.pool.lookup(h) is None for h in engine.kv.host.lru)
    assert run(engine, B) == (expected_b, 16)
    assert engine.kv.stats.host_hits == 16 and engine.kv.host.loaded == 4


def test_without_host_tier_evicted_prefix_is_recomputed(llm: LLM) -> None:
    engine = fresh(llm, 6, host=0)
    run(engine, A)
    run(engine, OTHER)
    assert run(engine, B)[1] == 0


def test_reset_prefix_cache_forgets_everything(llm: LLM) -> None:
    engine = fresh(llm, 16)
    run(engine, A)
    engine.reset_prefix_cache()
    assert run(engine, B)[1] == 0
    assert engine.kv.pool.num_free == 16


def test_cache_salt_isolates_tenants(llm: LLM) -> None:
    engine = fresh(llm, 16)
    engine.submit(A, SamplingParams(max_tokens=2), lambda d: None, cache_salt="tenant-1")
    engine.run_until_idle()
    got: list[Delta] = []
    engine.submit(B, SamplingParams(max_tokens=1), got.append, cache_salt="tenant-2")
    engine.submit(B, SamplingParams(max_tokens=1), got.append, cache_salt="tenant-1")
    engine.run_until_idle()
    assert [d.cached_tokens for d in got] == [0, 16]


def test_a_full_host_tier_keeps_the_pages_a_match_loads_while_it_evicts(llm: LLM) -> None:
    """The host tier is full of A's four prefix pages when B matches them; loading them takes
    device pages whose eviction saves OTHER's pages to the host tier. Those saves must not drop
    the prefix pages still to be loaded (they are pinned): all 16 tokens come from the host."""
    expected_b = run(fresh(llm, 16), B)[0]
    engine = fresh(llm, 6, host=4)
    run(engine, A)
    run(engine, OTHER)  # evicts A's four pages: the host tier is full
    assert engine.kv.host.num_used == 4 and not engine.kv.host.free
    assert run(engine, B) == (expected_b, 16)
    assert engine.kv.stats.host_hits == 16 and engine.kv.host.loaded == 4
