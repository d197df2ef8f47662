"""Shutdown does not wait for in-flight generations: it aborts them and tells their clients.

A tiny random Llama (token-id prompts, no tokenizer) generating up to 16000 tokens, which takes
far longer than any of these tests may wait: a stop that returns in seconds proves the abort.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from queue import Queue
from typing import Any

import httpx
import pytest
import torch

from kvtier.engine.batch.sequence import Delta
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.serve.app import AppSettings, build_app
from kvtier.serve.engine import SHUTTING_DOWN, EngineClosed, ServeConfig, ServeEngine
from kvtier.serve.server import ServerThread, _Server, free_port
from tests.hf_reference import make_hf_model

LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 16000, "ignore_eos": True}
CONFIG = ServeConfig(page_size=16, num_pages=1024, num_host_pages=0, max_num_seqs=8, threads=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("gqa")
    make_hf_model("llama-gqa", path)  # 3 layers, vocab 211, no tokenizer
    return path


@pytest.fixture(scope="module")
def llm(folder: Path) -> Iterator[LLM]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(str(folder), device="cpu", dtype="fp32", kv="gpu", max_model_len=1 << 14)
    torch.set_num_threads(threads)


def wait_until(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_engine_shutdown_aborts_queued_and_running_requests(llm: LLM) -> None:
    engine = ServeEngine(llm, CONFIG)
    got: Queue[Delta] = Queue()

    def sink(d: Delta) -> None:  # the first token of either: the server begins to shut down
        got.put(d)
        engine.begin_shutdown()

    for _ in range(2):
        engine.submit([5, 6, 7], SamplingParams(max_tokens=100), sink)
    engine.run_until_idle()
    with pytest.raises(EngineClosed, match="shutting down"):
        engine.submit([5, 6, 7], SamplingParams(max_tokens=1), got.put)
    last = [d for d in list(got.queue) if d.finish_reason is not None]
    assert [(d.finish_reason, d.error) for d in last] == [("abort", SHUTTING_DOWN)] * 2
    assert engine.generation_tokens == 2  # one step ran, the next one was not started
    assert not engine.scheduler.has_work and engine.kv.pool.num_free == CONFIG.num_pages


def test_stop_aborts_in_flight_requests_and_answers_their_clients(llm: LLM) -> None:
    engine = ServeEngine(llm, CONFIG)
    server = ServerThread(build_app(engine, AppSettings(model_name="tiny"))).start()
    answers: dict[str, Any] = {}

    def plain() -> None:
        r = httpx.post(server.url + "/v1/completions", json=LONG, timeout=60)
        answers["plain"] = (r.status_code, r.json())

    def streamed() -> None:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60
        ) as r:
            answers["stream"] = [line for line in r.iter_lines() if line]

    clients = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in clients:
        t.start()
    wait_until(lambda: len(engine.scheduler.running) == 2 and engine.generation_tokens > 20)
    t0 = time.monotonic()
    server.stop()
    assert time.monotonic() - t0 < 5.0
    assert not server.thread.is_alive() and engine._thread is None  # the engine thread stopped
    for t in clients:
        t.join(timeout=5)
        assert not t.is_alive()
    status, body = answers["plain"]
    assert status == 503 and body["error"]["code"] == "server_shutting_down"
    assert body["error"]["message"] == SHUTTING_DOWN
    lines = answers["stream"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    assert engine.generation_tokens < 2 * 16000


def test_a_second_sigterm_forces_exit() -> None:
    server = _Server(__import__("uvicorn").Config(lambda: None), None)
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and not server.force_exit
    server.handle_exit(signal.SIGTERM, None)
    assert server.force_exit


def generated(url: str) -> float:
    """kvtier:generation_tokens_total from /metrics."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        float(x.split()[-1]) for x in text.splitlines() if x.startswith("kvtier:generation_tokens_total")
    )


def test_sigterm_stops_kvtier_serve_within_seconds(folder: Path, tmp_path: Path) -> None:
    """`python -m kvtier serve` during a streamed generation: SIGTERM ends it in seconds."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvtier", "serve", "--model", str(folder), "--device", "cpu"]
    cmd += ["--port", str(port), "--num-pages", "1024", "--max-model-len", "16384", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, timeout=90)
        lines: list[str] = []

        def streamed() -> None:
            body = {**LONG, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line)

        client = threading.Thread(target=streamed)
        client.start()
        wait_until(lambda: generated(url) > 20)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        assert time.monotonic() - t0 < 10
        # uvicorn re-raises the signal it handled once it is done: killed by SIGTERM, cleanly
        assert proc.returncode in (0, -signal.SIGTERM), log.read_text()
        client.join(timeout=5)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
