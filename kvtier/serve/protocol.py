"""OpenAI request bodies -> validated engine inputs, and OpenAI-style errors.

Only what kvtier can honour is accepted; anything else that would silently change results
(n > 1, logprobs, tools) is a 400 with a message, like every malformed value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError
from kvtier.methods import MethodChoice, parse_choice, spec_names

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 512  # cap on "the rest of the context" for chat without max_tokens
SEED_LIMIT = 2**64  # seeds are 0 <= seed < 2**64: what torch.Generator.manual_seed takes


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "code", "param"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion or chat request, before tokenization."""

    model: str | None
    prompt: str | list[int] | None  # /v1/completions
    messages: list[dict[str, str]] | None  # /v1/chat/completions
    params: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    cache_salt: str | None
    method: MethodChoice | None = None  # kvtier's extension: "method": "quest,kv_budget=1k"


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise APIError(400, f"'{name}' must be a number, got {v!r}", param=name)
    if not lo <= v <= hi:
        raise APIError(400, f"'{name}' must be between {lo} and {hi}, got {v}", param=name)
    return float(v)


def _int(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise APIError(400, f"'{name}' must be an integer, got {v!r}", param=name)
    if v < lo:
        raise APIError(400, f"'{name}' must be at least {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise APIError(400, f"'{name}' must be at most {hi}, got {v}", param=name)
    return v


def _check_text(value: Any, where: str, param: str | None) -> None:
    """Raise a 400 if any string in `value` (keys included) is not valid Unicode text.

    JSON may spell a lone UTF-16 surrogate ("\\ud800"); Python then holds a str that cannot be
    encoded as UTF-8, which the tokenizer, the prefix hash and the JSON answer would all fail on.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                400,
                f"{where} is not valid Unicode text: it has a lone surrogate ({e.reason}) at character "
                f"{e.start}, i.e. a \\ud800-\\udfff escape without its pair; send UTF-8 text",
                param=param,
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, f"a key in {where}", param)
            _check_text(v, where, param)
    elif isinstance(value, list):
        for v in value:
            _check_text(v, where, param)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise APIError(400, "'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    return tuple(stops)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise APIError(400, f"messages[{i}]: only text content parts are supported", param="messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def _prompt(body: dict[str, Any]) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise APIError(400, "'prompt' must be one non-empty string or list of token ids", param="prompt")


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    """Validate a JSON body of /v1/completions (`chat=False`) or /v1/chat/completions."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for key, value in body.items():
        _check_text(key, "a key of the request body", None)
        _check_text(value, f"'{key}'", key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "'model' must be a string", param="model")
    if _int(body, "n", 1, 1) != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    for name in ("logprobs", "top_logprobs", "tools", "suffix", "echo", "best_of", "logit_bias"):
        if body.get(name) not in (None, False, 1 if name == "best_of" else None):
            raise APIError(400, f"'{name}' is not supported by kvtier serve", param=name)
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise APIError(400, f"'{name}' is not supported by kvtier serve (only 0)", param=name)
    top_k = _int(body, "top_k", 0, -1)  # vLLM's extension; -1 = off
    limit = _int(body, "max_completion_tokens", None, 1) if chat else None
    max_tokens = _int(body, "max_tokens", limit, 1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be true or false", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise APIError(400, "'cache_salt' must be a string", param="cache_salt")
    seed = _int(body, "seed", None, 0, SEED_LIMIT - 1)
    method = _method(body)
    try:
        params = SamplingParams(
            max_tokens=max_tokens or (DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS),
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
            top_k=0 if top_k in (None, -1) else top_k,
            seed=seed,
            stop=_stop(body),
            ignore_eos=bool(body.get("ignore_eos", False)),
        )
    except ConfigError as e:
        raise APIError(400, str(e)) from None
    return ParsedRequest(
        model=model,
        prompt=None if chat else _prompt(body),
        messages=_messages(body) if chat else None,
        params=params,
        max_tokens_given=max_tokens is not None,
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        cache_salt=salt,
        method=method,
    )


def _method(body: dict[str, Any]) -> MethodChoice | None:
    """The request's own method (kvtier's extension, as vLLM takes extra sampling fields): a
    spec like `kvtier generate`'s flags, `"int4"`, `"quest,kv_budget=1k"`, `"hip"`."""
    spec = body.get("method")
    if spec is None:
        return None
    if not isinstance(spec, str) or not spec.strip():
        raise APIError(
            400, f"'method' must be a method spec such as one of {', '.join(spec_names())}", param="method"
        )
    try:
        return parse_choice(spec)
    except ConfigError as e:
        raise APIError(400, f"'method': {e}", param="method") from None
