"""`kvtier serve` over HTTP with the official `openai` client, on the embedded SmolLM2 (CPU).

One server (uvicorn in a thread, 127.0.0.1, a free port) serves the whole module; prompts are
short and max_tokens small so the file runs in well under a minute or two on a CPU.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.serve.app import AppSettings, build_app
from kvtier.serve.engine import ServeConfig, ServeEngine
from kvtier.serve.server import ServerThread

KEY = "test-key"
NUM_PAGES = 256


@dataclass
class Served:
    llm: LLM
    engine: ServeEngine
    url: str
    model: str
    client: openai.OpenAI
    http: httpx.Client


@pytest.fixture(scope="module")
def served(embedded_hf_dir: Path) -> Iterator[Served]:
    model = str(embedded_hf_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: on a shared 2-core CPU, 1 thread is ~10x faster for small GEMMs
    llm = LLM(model, device="cpu", dtype="fp32")
    engine = ServeEngine(llm, ServeConfig(page_size=16, num_pages=NUM_PAGES, max_num_seqs=64, threads=1))
    server = ServerThread(
        build_app(
            engine, AppSettings(model_name=model, api_key=KEY, max_body_bytes=1 << 16, max_prompt_tokens=3000)
        )
    )
    server.start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    try:
        yield Served(llm, engine, server.url, model, client, http)
    finally:
        http.close()
        server.stop()
        torch.set_num_threads(threads)


def idle(engine: ServeEngine, timeout: float = 10.0) -> bool:
    """Wait until no request runs or waits and every page is free (cached pages count as free)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.scheduler
        if not s.running and not s.waiting and engine.kv.pool.num_free == NUM_PAGES:
            return True
        time.sleep(0.05)
    return False


def test_completion_and_chat_match_offline_generate(served: Served) -> None:
    c = served.client
    out = c.completions.create(
        model=served.model, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    ref = served.llm.generate("The capital of France is", SamplingParams(max_tokens=4))[0]
    assert out.choices[0].text == ref.text and out.usage is not None
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    chat = c.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5, temperature=0
    )
    ref = served.llm.generate("Say hi", SamplingParams(max_tokens=5), chat=True)[0]
    assert chat.choices[0].message.content == ref.text
    assert chat.choices[0].finish_reason == ref.finish_reason


def test_streaming_equals_non_streaming(served: Served) -> None:
    c, m = served.client, served.model
    full = c.completions.create(model=m, prompt="One, two, three,", max_tokens=6, temperature=0)
    parts = [
        ch.choices[0].text
        for ch in c.completions.create(
            model=m, prompt="One, two, three,", max_tokens=6, temperature=0, stream=True
        )
        if ch.choices
    ]
    assert "".join(parts) == full.choices[0].text
    chunks = list(
        c.chat.completions.create(
            model=m,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 4
    with served.http.stream(
        "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True}
    ) as r:
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["object"] == "text_completion"


def test_32_concurrent_requests_equal_each_alone(served: Served) -> None:
    prompts = [f"List {n} animals:" for n in range(2, 10)] * 4  # 32 requests, 8 distinct prompts

    def ask(p: str) -> tuple[str, int]:
        r = served.client.completions.create(model=served.model, prompt=p, max_tokens=5, temperature=0)
        assert r.usage is not None
        return r.choices[0].text, r.usage.completion_tokens

    alone = {p: ask(p) for p in set(prompts)}
    t0 = time.monotonic()
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(ask, prompts))
    assert time.monotonic() - t0 < 120
    assert together == [alone[p] for p in prompts]
    assert idle(served.engine)


def test_shared_prefix_reports_cached_tokens(served: Served) -> None:
    prefix = "You are a helpful assistant. " * 12  # ~70 tokens: four full pages
    c, m = served.client, served.model
    first = c.completions.create(model=m, prompt=prefix + "Q: 2+2?", max_tokens=2, temperature=0)
    second = c.completions.create(model=m, prompt=prefix + "Q: 3+3?", max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 64 and cached % 16 == 0
    metrics = served.http.get("/metrics").text
    assert "kvtier:prefix_cache_hits_total" in metrics and "kvtier:num_requests_running{" in metrics
    ahead = [line for line in metrics.splitlines() if line.startswith("kvtier:decode_ahead_steps_total{")]
    assert len(ahead) == 1 and ahead[0].endswith(" 0")  # --decode-steps is 1 by default
    assert served.http.post("/reset_prefix_cache").status_code == 200
    third = c.completions.create(model=m, prompt=prefix + "Q: 3+3?", max_tokens=2, temperature=0)
    assert third.usage is not None and third.usage.prompt_tokens_details is not None
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    assert third.choices[0].text == second.choices[0].text


def error_of(r: httpx.Response) -> dict[str, str]:
    err = r.json()["error"]
    assert err["message"] and err["type"]
    return dict(err)


def test_errors_are_openai_shaped(served: Served) -> None:
    h = served.http
    r = h.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in error_of(r)["message"]
    r = h.post("/v1/completions", json={"model": "gpt-5", "prompt": "Hi"})
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    r = h.post("/v1/completions", json={"prompt": [1] * 5000})
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
    # prompt + max_tokens past the model's length (past only the page pool it would run offloaded)
    limit = served.llm.max_model_len
    r = h.post("/v1/completions", json={"prompt": [1] * 2000, "max_tokens": limit})
    assert r.status_code == 400 and str(limit) in error_of(r)["message"]
    r = h.post("/v1/completions", json={"prompt": [1] * 3001})  # --max-prompt-tokens
    assert r.status_code == 400 and "limit of 3000" in error_of(r)["message"]
    r = h.post("/v1/completions", json={"prompt": "Hi", "temperature": -1})
    assert r.status_code == 400 and "temperature" in error_of(r)["message"]
    r = h.post("/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400 and error_of(r)["param"] == "messages"
    r = h.post("/v1/completions", content=b"x" * (1 << 17))
    assert r.status_code == 413
    r = httpx.get(served.url + "/v1/models")
    assert r.status_code == 401 and error_of(r)["type"] == "authentication_error"
    with pytest.raises(openai.BadRequestError):
        served.client.completions.create(model=served.model, prompt="Hi", temperature=5)
    assert h.get("/health").status_code == 200
    assert [m.id for m in served.client.models.list()] == [served.model]


def test_a_request_may_name_its_method(served: Served) -> None:
    """kvtier's extra body field `method` (the openai client sends it through `extra_body`):
    the answer equals `LLM.generate` with that method; a bad spec is a 400 naming the field."""
    c, m = served.client, served.model
    for spec in ("int4", "window,kv_budget=64"):
        out = c.completions.create(
            model=m,
            prompt="The capital of France is",
            max_tokens=6,
            temperature=0,
            extra_body={"method": spec},
        )
        ref = served.llm.generate("The capital of France is", SamplingParams(max_tokens=6), method=spec)[0]
        assert out.choices[0].text == ref.text
    for bad in ("bogus", "window", 7, ""):
        r = served.http.post("/v1/completions", json={"prompt": "Hi", "method": bad})
        assert r.status_code == 400 and error_of(r)["param"] == "method", (bad, r.text)
    assert idle(served.engine)


def test_client_disconnect_frees_pages(served: Served) -> None:
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    before = served.engine.generation_tokens
    with served.http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk arrived; now hang up
    assert idle(served.engine)
    assert served.engine.generation_tokens - before < 400


def test_non_streaming_client_disconnect_aborts_at_the_next_step(served: Served) -> None:
    """A client that hangs up on a non-streaming request stops it at once (not at max_tokens)."""
    body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True}).encode()
    host, port = served.url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    before = served.engine.generation_tokens
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while served.engine.generation_tokens - before < 3:  # it is generating
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.5)
    left_at = served.engine.generation_tokens - before
    assert idle(served.engine, timeout=3.0)
    assert served.engine.generation_tokens - before < left_at + 50 < 2000


def test_bad_seed_and_lone_surrogates_are_400_and_the_server_goes_on(served: Served) -> None:
    h = served.http
    for raw in (
        b'{"prompt": "Hi", "max_tokens": 1, "seed": 18446744073709551616}',  # 2**64
        b'{"prompt": "a\\ud800b", "max_tokens": 1}',  # JSON's escape of a lone surrogate
        b'{"prompt": "Hi", "max_tokens": 1, "cache_salt": "\\udfff"}',
    ):
        r = h.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert error_of(r)["type"] == "invalid_request_error"
    chat = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 1}'
    r = h.post("/v1/chat/completions", content=chat, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and error_of(r)["param"] == "messages"
    r = h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "seed": 2**64 - 1, "temperature": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    assert idle(served.engine)


def test_soak_of_tiny_requests_returns_every_page(served: Served) -> None:
    # NOTE: a client per thread: 32 threads sharing one httpx.Client's pooled keep-alive
    # connections once read from a socket another had closed (EBADF), a flake of the test's
    # client, not of the server
    local, clients = threading.local(), []

    def tiny(i: int) -> int:
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=served.url, headers=served.http.headers, timeout=120)
            clients.append(local.http)
        body = {"prompt": [1 + i % 97, 2 + i % 5], "max_tokens": 1 + i % 3}  # token ids: tiny and fast
        r = local.http.post("/v1/completions", json=body)
        return r.status_code

    try:
        with ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(tiny, range(200)))
    finally:
        for c in clients:
            c.close()
    assert codes == [200] * 200
    assert idle(served.engine)
    assert served.engine.kv.pool.num_free == NUM_PAGES


def test_stop_string_cuts_the_text_also_when_streamed(served: Served) -> None:
    c, m = served.client, served.model
    full = c.completions.create(model=m, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0).choices[0].text
    stop = full[3:5]
    assert stop.strip(), full
    want = full[: full.index(stop)]
    got = c.completions.create(model=m, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stop=[stop])
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    parts = c.completions.create(
        model=m, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stop=[stop], stream=True
    )
    assert "".join(ch.choices[0].text for ch in parts if ch.choices) == want


def test_multi_turn_chat_reuses_the_earlier_turn(served: Served) -> None:
    c, m = served.client, served.model
    turn1: list[Any] = [{"role": "user", "content": "Name a color of the sky."}]
    first = c.chat.completions.create(model=m, messages=turn1, max_tokens=6, temperature=0)
    assert first.usage is not None
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content or ""}]
    turn2.append({"role": "user", "content": "And of grass?"})
    second = c.chat.completions.create(model=m, messages=turn2, max_tokens=2, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= first.usage.prompt_tokens // 16 * 16 > 0
