"""Tiered runs queued from a launcher thread (`BatchConfig.tiered_thread`, the CUDA default): a
launch that blocks (as CUDA makes a host wait when its queues are full of slice loads) holds
neither the engine loop nor the batch, and the tokens still equal running alone."""

from __future__ import annotations

import threading
from pathlib import Path
from queue import Queue
from typing import Any

import pytest
import torch

from kvtier.engine.batch.sequence import Delta
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.kv.store import TieredKVStore
from kvtier.methods import parse_choice
from kvtier.serve.engine import ServeConfig, ServeEngine
from kvtier.serve.tiered import TieredRun
from tests.hf_reference import make_hf_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder: Path = tmp_path_factory.mktemp("gqa")
    make_hf_model("llama-gqa", folder)  # 3 layers, 4 query heads, 2 KV heads, vocab 211
    return LLM(str(folder), device="cpu", dtype="fp32", kv="gpu")


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 211, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tokens(q: Queue[Delta]) -> list[int]:
    out: list[int] = []
    while not q.empty():
        out.extend(q.get().token_ids)
    return out


def test_a_blocked_launch_holds_neither_the_loop_nor_the_batch(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The long request's first step blocks inside its launch until the short request has
    finished: the short one finishes meanwhile, then the long one runs out, both equal alone."""
    long_ids, short_ids = ids(40, 1), ids(6, 2)
    params = SamplingParams(max_tokens=4)
    expected_long = llm.generate(long_ids, params, method="head")[0].token_ids
    expected_short = llm.generate(short_ids, params)[0].token_ids
    release = threading.Event()
    launcher_threads: set[str] = set()
    queue_step = TieredRun._queue_step

    def blocking(run: TieredRun) -> None:
        launcher_threads.add(threading.current_thread().name)
        assert release.wait(timeout=60), "the short request never finished"
        queue_step(run)

    monkeypatch.setattr(TieredRun, "_queue_step", blocking)
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64, tiered_thread=True))
    long_q: Queue[Delta] = Queue()
    short_q: Queue[Delta] = Queue()

    def short_sink(d: Delta) -> None:
        short_q.put(d)
        if d.finish_reason is not None:
            release.set()

    engine.submit(long_ids, params, long_q.put, method=parse_choice("head"))
    engine.submit(short_ids, params, short_sink)
    engine.run_until_idle()
    assert tokens(short_q) == list(expected_short) and tokens(long_q) == list(expected_long)
    assert engine.offloaded == 1 and not engine.has_work
    assert launcher_threads and all(n.startswith("kvtier-tiered") for n in launcher_threads)


def test_an_error_while_queuing_fails_only_its_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the launcher thread raises reaches the request as an error at collect; the batch's
    request is served as usual and the run's store is closed."""

    def failing(run: TieredRun) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(TieredRun, "_queue_step", failing)
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64, tiered_thread=True))
    long_q: Queue[Delta] = Queue()
    engine.submit(ids(40, 1), SamplingParams(max_tokens=4), long_q.put, method=parse_choice("head"))
    short_q: Queue[Delta] = Queue()
    engine.submit(ids(6, 2), SamplingParams(max_tokens=3), short_q.put)
    engine.run_until_idle()
    deltas = [long_q.get() for _ in range(long_q.qsize())]
    assert deltas[-1].finish_reason == "error" and "device lost" in (deltas[-1].error or "")
    assert len(tokens(short_q)) == 3
    assert engine.tiered_bytes() == {"gpu": 0, "host": 0} and not engine.has_work


def test_the_store_is_built_and_freed_on_the_launcher(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a long request's store (pinning its host memory) and freeing it take seconds on
    CUDA: both run on the launcher thread, the tokens still equal alone, and the engine is idle
    only once the store is freed."""
    long_ids, params = ids(40, 3), SamplingParams(max_tokens=4)
    expected = llm.generate(long_ids, params, method="head")[0].token_ids
    where: dict[str, str] = {}
    make_store, close = LLM.make_store, TieredKVStore.close

    def made(self: LLM, *args: Any, **kwargs: Any) -> Any:
        where["make"] = threading.current_thread().name
        return make_store(self, *args, **kwargs)

    def closed(self: TieredKVStore, release_host: bool = True) -> None:
        where["close"] = threading.current_thread().name
        where["release_host"] = str(release_host)
        close(self, release_host)

    monkeypatch.setattr(LLM, "make_store", made)
    monkeypatch.setattr(TieredKVStore, "close", closed)
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64, tiered_thread=True))
    q: Queue[Delta] = Queue()
    engine.submit(long_ids, params, q.put, method=parse_choice("head"))
    engine.run_until_idle()
    assert tokens(q) == list(expected) and engine.offloaded == 1
    for f, _ in engine._closing_runs:
        f.result(timeout=30)
    assert where["make"].startswith("kvtier-tiered") and where["close"].startswith("kvtier-tiered")
    assert where["release_host"] == "False"  # the pinned memory stays cached for the next run
    assert engine.tiered_bytes() == {"gpu": 0, "host": 0}
    assert engine.transfer_bytes()[("h2d", "tiered")] > 0  # counted at its finish, before the free


def test_a_store_that_cannot_be_built_fails_only_its_request(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What building the store raises on the launcher (host memory that cannot be pinned)
    reaches its request as an error; the batch's request is served."""

    def failing(self: LLM, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("cannot pin 34 GB")

    monkeypatch.setattr(LLM, "make_store", failing)
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64, tiered_thread=True))
    long_q: Queue[Delta] = Queue()
    short_q: Queue[Delta] = Queue()
    engine.submit(ids(40, 1), SamplingParams(max_tokens=4), long_q.put, method=parse_choice("head"))
    engine.submit(ids(6, 2), SamplingParams(max_tokens=3), short_q.put)
    engine.run_until_idle()
    deltas = [long_q.get() for _ in range(long_q.qsize())]
    assert deltas[-1].finish_reason == "error" and "cannot pin" in (deltas[-1].error or "")
    assert len(tokens(short_q)) == 3 and not engine.has_work


def test_no_run_is_planned_while_another_builds_its_store(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store being built holds memory the GPU budget does not show yet: the next tiered
    request is planned only after it (both then equal alone)."""
    first, second, params = ids(40, 4), ids(36, 5), SamplingParams(max_tokens=3)
    expected = [llm.generate(p, params, method="head")[0].token_ids for p in (first, second)]
    release = threading.Event()
    started: list[int] = []
    make_store = LLM.make_store

    def slow(self: LLM, *args: Any, **kwargs: Any) -> Any:
        started.append(len(started))
        if len(started) == 1:
            assert release.wait(timeout=60)
        return make_store(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "make_store", slow)
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64, tiered_thread=True))
    qs: list[Queue[Delta]] = [Queue(), Queue()]
    for p, q in zip((first, second), qs, strict=True):
        engine.submit(p, params, q.put, method=parse_choice("head"))
    engine._drain(block=False)
    for _ in range(20):
        engine.step_tiered()
    assert len(started) == 1 and engine.num_tiered == (1, 1)
    release.set()
    engine.run_until_idle()
    assert [tokens(q) for q in qs] == [list(e) for e in expected]


def test_paced_attention_keeps_the_launcher_a_few_layers_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before queuing layer l, `PacedAttention` waits for the mark of layer l - ahead: at most
    `ahead` layers are outstanding, in order, and every call reaches the store unchanged."""
    from kvtier.serve.tiered import PacedAttention

    log: list[tuple[str, int]] = []

    class Mark:
        made = 0

        def __init__(self) -> None:
            self.n = Mark.made
            Mark.made += 1

        def record(self, stream: object) -> None:
            log.append(("record", self.n))

        def synchronize(self) -> None:
            log.append(("wait", self.n))

    monkeypatch.setattr(torch.cuda, "Event", Mark)
    calls: list[int] = []

    def store(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        calls.append(layer)
        return q + layer

    paced = PacedAttention(store, stream=object(), ahead=2)  # type: ignore[arg-type]
    q = torch.zeros(1, 2, 4)
    outs = [paced(layer, q, q, q) for layer in range(5)]
    assert calls == [0, 1, 2, 3, 4] and all(torch.equal(o, q + i) for i, o in enumerate(outs))
    # layer 2 waits for layer 0's mark, layer 3 for layer 1's, layer 4 for layer 2's
    assert log == [
        ("record", 0),
        ("record", 1),
        ("record", 2),
        ("wait", 0),
        ("record", 3),
        ("wait", 1),
        ("record", 4),
        ("wait", 2),
    ]
    unpaced = PacedAttention(store, stream=None, ahead=2)  # type: ignore[arg-type]
    log.clear()
    unpaced(0, q, q, q)
    assert log == []  # the CPU, or the engine's own thread: never a wait


def test_what_a_failed_run_allocated_is_freed_before_the_next_plan(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that fails half-built and a step that fails after allocating leave nothing
    allocated once the request has failed, by reference counting alone (no collector run): on
    the H200 a Quest request planned after a failed one ran out of memory with ~2.7 GB still
    allocated (`bench/results/serve_methods_fit_24gib.json`). Their errors reach the request."""
    import gc
    import weakref

    import kvtier.serve.engine as serve_engine

    held: list[weakref.ref[torch.Tensor]] = []

    def half_built(self: LLM, *args: Any, **kwargs: Any) -> Any:
        partly = torch.zeros(1 << 16)  # a buffer the store had taken
        held.append(weakref.ref(partly))
        raise RuntimeError("out of memory while building")

    def failing_step(run: TieredRun) -> None:
        activation = torch.zeros(1 << 16)
        held.append(weakref.ref(activation))
        raise RuntimeError("out of memory in a layer")

    monkeypatch.setattr(serve_engine.gc, "collect", lambda *a: 0)
    gc.disable()
    try:
        for where, patch in ((LLM, ("make_store", half_built)), (TieredRun, ("_queue_step", failing_step))):
            with monkeypatch.context() as m:
                m.setattr(where, *patch)
                engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64, tiered_thread=True))
                q: Queue[Delta] = Queue()
                engine.submit(ids(40, 1), SamplingParams(max_tokens=4), q.put, method=parse_choice("head"))
                engine.run_until_idle()
                for f, _ in engine._closing_runs:
                    f.result(timeout=30)
                engine.shutdown()
                deltas = [q.get() for _ in range(q.qsize())]
                assert deltas[-1].finish_reason == "error" and "out of memory" in (deltas[-1].error or "")
        assert len(held) == 2 and all(r() is None for r in held)
    finally:
        gc.enable()


def test_a_plan_counts_what_other_requests_stores_hold() -> None:
    """`held_by_stores`: nothing while no request holds a store (what is allocated then is the
    server's own), and beyond that once a run is being freed or runs."""
    engine = ServeEngine.__new__(ServeEngine)  # the method's state only, no model
    engine._tiered, engine._closing_runs, engine._idle_allocated = {}, [], 0
    engine.scheduler = type("S", (), {"running": [], "waiting": []})()  # type: ignore[assignment]
    assert engine.held_by_stores(20_000) == 0 and engine._idle_allocated == 20_000
    done: Any = object()
    engine._closing_runs = [(done, None)]
    assert engine.held_by_stores(22_500) == 2_500
    assert engine.held_by_stores(19_000) == 0
    engine._closing_runs = []
    assert engine.held_by_stores(21_000) == 0 and engine._idle_allocated == 21_000


def test_a_request_that_does_not_fit_waits_for_a_store_of_its_own_in_the_batch(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store of its own in the batch holds GPU memory outside the pool: a tiered request the
    planner cannot fit beside it waits for it to finish (it held no pool page), then runs."""
    import kvtier.serve.engine as serve_engine
    from kvtier.errors import CapacityError

    plan_store = serve_engine.plan_store
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64, tiered_thread=True))
    refused: list[int] = []

    def beside_own_stores(host: Any, seq: Any) -> Any:
        batch = list(engine.scheduler.running) + list(engine.scheduler.waiting)
        if any(s.own is not None for s in batch if s is not seq):
            refused.append(1)
            raise CapacityError("does not fit beside the store of its own")
        return plan_store(host, seq)

    monkeypatch.setattr(serve_engine, "plan_store", beside_own_stores)
    own_q: Queue[Delta] = Queue()
    long_q: Queue[Delta] = Queue()
    params = SamplingParams(max_tokens=4)
    engine.submit(ids(12, 6), params, own_q.put, method=parse_choice("window,kv_budget=8"))
    engine._drain(block=False)
    engine.step_tiered()  # the short request's own store joins the batch
    assert engine.own_store_requests == 1 and engine.kv.pool.num_used == 0
    engine.submit(ids(40, 7), params, long_q.put, method=parse_choice("head"))
    engine.run_until_idle()
    assert refused and len(tokens(own_q)) == 4
    assert tokens(long_q) == list(llm.generate(ids(40, 7), params, method="head")[0].token_ids)


def test_an_out_of_memory_error_names_its_line_once_when_detached(monkeypatch: pytest.MonkeyPatch) -> None:
    """`detached` drops the traceback and puts the allocating line (`raised_at`: the innermost
    kvtier frame) in an out-of-memory error's first line, once: the store's error is detached
    where it is caught and again after it is raised from the step."""
    from kvtier.serve import tiered
    from kvtier.serve.tiered import detached

    monkeypatch.setattr(tiered, "raised_at", lambda e: "kvtier/kv/store.py:12 in allocate")

    def allocate() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore advice")

    try:
        allocate()
    except torch.OutOfMemoryError as e:
        error = detached(e)
    assert error.__traceback__ is None
    first = str(error).splitlines()[0]
    assert first.endswith("in allocate)") and " (at " in first
    try:
        raise error
    except torch.OutOfMemoryError as e:
        again = detached(e)
    assert str(again).count(" (at ") == 1 and str(again).endswith("more advice")


def test_a_failed_request_with_a_store_of_its_own_runs_the_collector(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request over a store of its own that fails has the collector run once its store is
    closed (what it allocated may sit in cycles through its error); a plain one does not."""
    import kvtier.serve.engine as serve_engine

    collected: list[int] = []
    monkeypatch.setattr(serve_engine.gc, "collect", lambda *a: collected.append(1) or 0)
    engine = ServeEngine(llm, ServeConfig(page_size=4, num_pages=64, tiered_thread=True))
    q: Queue[Delta] = Queue()
    params = SamplingParams(max_tokens=4)
    engine.submit(ids(12, 6), params, q.put, method=parse_choice("window,kv_budget=8"))
    engine.submit(ids(12, 7), params, q.put)
    engine._drain(block=False)
    engine.step_tiered()  # the first joins the batch over a store of its own
    own, plain = sorted(engine.scheduler.waiting, key=lambda s: s.own is None)
    assert own.own is not None and plain.own is None
    engine._finish(plain, "error", error="boom")
    assert not collected
    engine._finish(own, "error", error="boom")
    assert collected == [1] and own.own is None
