"""Tiered runs queued from a launcher thread (`BatchConfig.tiered_thread`, the CUDA default): a
launch that blocks (as CUDA makes a host wait when its queues are full of slice loads) holds
neither the engine loop nor the batch, and the tokens still equal running alone."""

from __future__ import annotations

import threading
from pathlib import Path
from queue import Queue

import pytest
import torch

from kvtier.engine.batch.sequence import Delta
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
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
