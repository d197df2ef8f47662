"""`kvtier serve`: an OpenAI-compatible HTTP server with continuous batching and prefix caching."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from dataclasses import replace

from kvtier.cli.options import (
    add_exact_lossless_option,
    add_model_options,
    check_before_loading,
    float_type,
    int_type,
    llm_kwargs,
    size_type,
    text_type,
)
from kvtier.engine.llm import LLM
from kvtier.errors import ConfigError

# Prompt tokens a batch step takes by default. On a GPU a step of 8,192 tokens keeps the matmuls
# compute-bound (vLLM's default on large GPUs); the CPU, where a step's time grows with its
# tokens, keeps decode steps short with 512.
GPU_STEP_TOKENS = 8192
CPU_STEP_TOKENS = 512


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics) with "
        "continuous batching, paged KV and prefix caching.",
        allow_abbrev=False,
    )
    add_model_options(p)
    add_exact_lossless_option(p)
    p.add_argument(
        "--host",
        type=text_type("--host", allow_empty=False),
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only)",
    )
    p.add_argument("--port", type=int_type("--port", 1, 65535), default=8000)
    p.add_argument(
        "--served-model-name",
        type=text_type("--served-model-name", allow_empty=False),
        default=None,
        help="model id clients send (default: --model)",
    )
    p.add_argument(
        "--api-key",
        type=api_key,
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int_type("--max-num-seqs"),
        default=64,
        help="sequences in the running batch (64)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int_type("--max-num-batched-tokens"),
        default=None,
        help=f"tokens per step (default: {GPU_STEP_TOKENS} on CUDA, {CPU_STEP_TOKENS} on the CPU)",
    )
    p.add_argument("--page-size", type=int_type("--page-size"), default=16, help="tokens per KV page (16)")
    p.add_argument(
        "--num-pages",
        type=int_type("--num-pages"),
        default=None,
        help="device KV pages (default: from memory)",
    )
    p.add_argument(
        "--num-host-pages",
        type=int_type("--num-host-pages", 0),
        default=None,
        help="host-tier pages (default: --num-pages)",
    )
    p.add_argument(
        "--offload-reserve",
        type=size_type("--offload-reserve", positive=False),
        default=None,
        help="GPU memory kept out of the page pool for requests that stream their KV from the host "
        "or name a method (default: a quarter of what the pool could take, at most 4 GiB). Long "
        "HiP requests want more: with 4GiB a 256K one beside an 8B model under 24 GiB got 4-head "
        "slices and decoded 2.35x faster than with the default (docs/serving.md)",
    )
    p.add_argument(
        "--tiered-share",
        type=float_type("--tiered-share", 0.0, 1.0),
        default=0.25,
        help="share of the page pool that requests streaming their KV from the host may borrow for "
        "resident slices and staging buffers (default 0.25; 0: only --offload-reserve)",
    )
    p.add_argument(
        "--tiered-keep-tokens",
        type=int_type("--tiered-keep-tokens", 0),
        default=2048,
        help="tokens per --max-num-seqs sequence the batch keeps before such requests may borrow "
        "pages (default 2048; 0: they may borrow any free page up to --tiered-share)",
    )
    p.add_argument(
        "--decode-steps",
        type=int_type("--decode-steps"),
        default=1,
        help="decode tokens a decode-only batch step computes before reading them back (default 1; "
        "2+ queues the next forward on the device's own sampled tokens, so the GPU does not wait "
        "for the host in between; tokens arrive that many at a time). CUDA only: the CPU has no "
        "such wait, and ignores it",
    )
    p.add_argument(
        "--threads", type=int_type("--threads"), default=None, help="torch CPU threads of the engine"
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    p.add_argument(
        "--max-prompt-tokens",
        type=int_type("--max-prompt-tokens"),
        default=None,
        help="reject longer prompts with 400",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int_type("--max-body-bytes"),
        default=1 << 20,
        help="reject larger request bodies (1 MiB)",
    )
    p.set_defaults(func=run)


def api_key(text: str) -> str:
    """An --api-key clients can send: printable ASCII (it travels in an HTTP header, which drops
    surrounding spaces), not empty."""
    if not text:
        raise ConfigError(
            "--api-key is empty, so every request would be refused; give a key or drop --api-key"
        )
    if text != text.strip() or not all(" " <= ch <= "~" for ch in text):
        raise ConfigError(
            "--api-key must be printable ASCII with no leading or trailing spaces "
            "(clients send it in an HTTP header)"
        )
    return text


def check_can_listen(host: str, port: int) -> None:
    """Bind (host, port) once, as uvicorn will, so a port in use or a bad --host fails before the
    model loads. SO_REUSEADDR like uvicorn: a port in TIME_WAIT is free, one with a listener is not."""
    where = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise ConfigError(f"cannot listen on {where}: {_reason(e)}; pick another --port or --host") from None
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as e:
        raise ConfigError(f"cannot listen on {where}: {_reason(e)}; pick another --port or --host") from None


def step_tokens(requested: int | None, device_type: str) -> int:
    """--max-num-batched-tokens as given, else the default for the device the model is on."""
    if requested is not None:
        return requested
    return GPU_STEP_TOKENS if device_type == "cuda" else CPU_STEP_TOKENS


def _reason(e: BaseException) -> str:
    return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


def run(args: argparse.Namespace) -> int:
    try:
        from kvtier.serve.app import AppSettings, build_app
        from kvtier.serve.engine import ServeConfig, ServeEngine
        from kvtier.serve.server import serve_forever
    except ImportError as e:
        raise ConfigError(
            f"kvtier serve needs its extra packages ({e.name}): pip install 'kvtier[serve]'"
        ) from None
    config = ServeConfig(
        page_size=args.page_size,
        num_pages=args.num_pages,
        num_host_pages=args.num_host_pages,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=CPU_STEP_TOKENS
        if args.max_num_batched_tokens is None
        else args.max_num_batched_tokens,
        prefix_caching=not args.no_prefix_caching,
        threads=args.threads,
        offload_reserve=args.offload_reserve,
        tiered_share=args.tiered_share,
        tiered_keep_tokens=args.tiered_keep_tokens,
        decode_steps=args.decode_steps,
    )
    if args.cpu_attention != "off":
        # NOTE: a CPU-attended layer waits on the host for its query; the server's tiered runs
        # are queued whole on their own stream, and the engine loop must never wait for them.
        raise ConfigError("--cpu-attention is for kvtier generate (one request); kvtier serve streams its KV")
    check_can_listen(args.host, args.port)
    check_before_loading(args)
    llm = LLM(**llm_kwargs(args))
    config = replace(config, max_num_batched_tokens=step_tokens(args.max_num_batched_tokens, llm.device.type))
    engine = ServeEngine(llm, config)
    name = args.served_model_name or llm.loaded.name
    settings = AppSettings(
        model_name=name,
        aliases=(llm.loaded.name,),
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    print(
        f"kvtier serve: {name} on http://{args.host}:{args.port} ({engine.store.num_pages} pages of "
        f"{config.page_size} tokens, max {engine.max_model_len} tokens per sequence"
        + (f", {engine.graphs_at_start} decode graphs captured" if engine.graphs_at_start else "")
        + ")",
        file=sys.stderr,
    )
    if engine.pool_budget is not None and engine.pool_budget.where == "GPU":
        pool = engine.store.bytes_per_page * engine.store.num_pages
        print(f"kvtier serve: {engine.pool_budget.describe(pool)}", file=sys.stderr)
    log = logging.getLogger("kvtier.serve")  # how each request over a store of its own was placed
    if not log.handlers:  # NOTE: once a process (tests run the command more than once)
        placed = logging.StreamHandler(sys.stderr)
        placed.setFormatter(logging.Formatter("kvtier serve: %(message)s"))
        log.addHandler(placed)
        log.setLevel(logging.INFO)
        log.propagate = False
    serve_forever(build_app(engine, settings), args.host, args.port)
    return 0
