"""What each kind of served request keeps in a run of lent pool pages: a streaming request's
staging buffers (lossless, HiP, Quest, quantized), HiP's block caches, decode rows and RoPE
table, a sliding-window model's full layers, a quantized request's unpack buffers, and the
slices of a resident sparse or an evicting request that joins the batch's forward. Every
request's tokens equal `LLM.generate`'s and its pages come back at its end.
"""

from __future__ import annotations

from pathlib import Path
from queue import Queue

import pytest
import torch

from kvtier.engine.batch.sequence import Delta
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.kv.device_memory import RegionMemory
from kvtier.methods import parse_choice
from kvtier.serve.engine import ServeConfig, ServeEngine
from kvtier.serve.metrics import render
from kvtier.sparse import HipKernel
from tests.hf_reference import make_hf_model
from tests.serve_helpers import gqa_llm
from tests.serve_lent_helpers import collect, head_request, served_alone, tokens


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return gqa_llm(tmp_path_factory)


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
