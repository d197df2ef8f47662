"""The FastAPI app: OpenAI-compatible routes over a `ServeEngine` running in its own thread.

Handlers never touch the engine's state: they `submit` token ids with a sink that hops each
`Delta` onto the event loop (`call_soon_threadsafe`), and `abort` when the client goes away
(a non-streaming handler watches for the disconnect while it waits, so the request stops at
the engine's next step). When the server begins to shut down (`app.state.begin_shutdown`, which
`kvtier.serve.server` calls), the engine aborts every request: a streaming client gets a last
chunk with finish_reason "abort", a waiting one a 503 error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from kvtier.engine.batch.sequence import Delta
from kvtier.errors import ConfigError, KvtierError
from kvtier.serve.engine import EngineClosed, ServeEngine
from kvtier.serve.metrics import render
from kvtier.serve.protocol import DEFAULT_CHAT_TOKENS, APIError, ParsedRequest, parse_request


@dataclass(frozen=True)
class AppSettings:
    """HTTP-level limits and identity. `aliases` are other names accepted for the model."""

    model_name: str
    aliases: tuple[str, ...] = field(default_factory=tuple)
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ConfigError("--served-model-name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key must not be empty (leave it out to serve without a key)")
        if self.max_body_bytes < 1:
            raise ConfigError(f"--max-body-bytes must be at least 1, got {self.max_body_bytes}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(
                f"--max-prompt-tokens must be at least 1, got {self.max_prompt_tokens} "
                "(leave it out for no limit)"
            )


def build_app(engine: ServeEngine, settings: AppSettings) -> FastAPI:
    """The app; its lifespan starts the engine thread and shuts it down."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="kvtier", lifespan=lifespan)
    app.state.begin_shutdown = engine.begin_shutdown  # called by kvtier.serve.server on shutdown
    names = {settings.model_name, *settings.aliases}

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        # NOTE: a bug, not a bad request; still answered in the OpenAI shape (uvicorn logs the trace).
        body = APIError(500, f"internal error: {type(e).__name__}", "server_error").body()
        return JSONResponse(body, status_code=500)

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {settings.api_key}":
            raise APIError(
                401,
                "missing or wrong API key (Authorization: Bearer ...)",
                "authentication_error",
                "invalid_api_key",
            )

    async def read_json(request: Request) -> Any:
        authorize(request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise APIError(413, f"request body is over {settings.max_body_bytes} bytes")
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > settings.max_body_bytes:
                raise APIError(413, f"request body is over {settings.max_body_bytes} bytes")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None

    def prepare(req: ParsedRequest, chat: bool) -> tuple[list[int], ParsedRequest]:
        if req.model is not None and req.model not in names:
            raise APIError(
                404,
                f"the model {req.model!r} does not exist; this server serves {settings.model_name!r}",
                code="model_not_found",
                param="model",
            )
        try:
            ids = engine.tokenize(req.prompt, req.messages)
        except KvtierError as e:
            raise APIError(400, str(e), param="messages" if chat else "prompt") from None
        limit = settings.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            msg = f"the prompt has {len(ids)} tokens, over this server's limit of {limit}"
            raise APIError(400, msg, code="context_length_exceeded")
        if chat and not req.max_tokens_given:  # the rest of the context, capped
            room = max(1, min(engine.max_model_len - len(ids), DEFAULT_CHAT_TOKENS))
            req = replace(req, params=replace(req.params, max_tokens=room))
        try:
            engine.check(ids, req.params)
        except KvtierError as e:
            raise APIError(400, str(e), code="context_length_exceeded") from None
        return ids, req

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render(engine, settings.model_name), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        authorize(request)
        engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        card = {
            "id": settings.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvtier",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response | dict[str, Any]:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response | dict[str, Any]:
        return await handle(request, chat=True)

    async def handle(request: Request, chat: bool) -> Response | dict[str, Any]:
        req = parse_request(await read_json(request), chat)
        ids, req = prepare(req, chat)
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[Delta] = asyncio.Queue()

        def sink(d: Delta) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
                loop.call_soon_threadsafe(deltas.put_nowait, d)

        try:
            rid = engine.submit(ids, req.params, sink, req.cache_salt, req.method)
        except EngineClosed as e:
            raise APIError(503, str(e), "server_error", "server_shutting_down") from None
        head = _Head(
            ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()), settings.model_name
        )
        if req.stream:
            return StreamingResponse(
                stream(rid, deltas, head, chat, req.include_usage), media_type="text/event-stream"
            )
        return await collect(request, rid, deltas, head, chat)

    async def collect(
        request: Request, rid: str, deltas: asyncio.Queue[Delta], head: _Head, chat: bool
    ) -> dict[str, Any]:
        result = asyncio.ensure_future(_gather(deltas))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((result, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled (server shutdown)
            gone.cancel()
            if not result.done():  # the client left (or we were cancelled): stop it now
                result.cancel()
                engine.abort(rid)
        if not result.done():
            return {}  # nobody to answer
        content, last = result.result()
        if last.error is not None:
            if last.finish_reason == "abort":  # the server is shutting down
                raise APIError(503, last.error, "server_error", "server_shutting_down")
            raise APIError(500, f"generation failed: {last.error}", "server_error")
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        return {**head.fields(chat, False), "choices": [choice], "usage": _usage(last)}

    async def stream(
        rid: str, deltas: asyncio.Queue[Delta], head: _Head, chat: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        done = False
        try:
            if chat:
                yield _sse(
                    {
                        **head.fields(chat, True),
                        "choices": [
                            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        ],
                    }
                )
            while not done:
                d = await deltas.get()
                done = d.finish_reason is not None
                if d.error is not None and d.finish_reason != "abort":  # an abort ends with a chunk
                    yield _sse(APIError(500, f"generation failed: {d.error}", "server_error").body())
                    break
                for chunk in _chunks(head, d, chat):
                    yield chunk
                if done and include_usage:
                    yield _sse({**head.fields(chat, True), "choices": [], "usage": _usage(d)})
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away mid-stream: free its pages now
                engine.abort(rid)

    return app


async def _gather(deltas: asyncio.Queue[Delta]) -> tuple[str, Delta]:
    """The whole text of a request and its last `Delta` (the one with a finish_reason)."""
    text = []
    while True:
        d = await deltas.get()
        text.append(d.text)
        if d.finish_reason is not None:
            return "".join(text), d


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection.

    NOTE: called after the body is read, so `receive()` waits (no polling) until uvicorn reports
    "http.disconnect" (the client left, or the response was sent).
    """
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # a stray body message: never spin


@dataclass(frozen=True)
class _Head:
    id: str
    created: int
    model: str

    def fields(self, chat: bool, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def _chunks(head: _Head, d: Delta, chat: bool) -> Iterator[str]:
    if not d.text and d.finish_reason is None:
        return
    if chat:
        delta = {"content": d.text} if d.text else {}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": d.finish_reason}
    else:
        choice = {"index": 0, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
    yield _sse({**head.fields(chat, True), "choices": [choice]})


def _usage(d: Delta) -> dict[str, Any]:
    return {
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "total_tokens": d.prompt_tokens + d.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
    }


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
