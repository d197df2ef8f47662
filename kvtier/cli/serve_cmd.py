"""`kvtier serve`: an OpenAI-compatible HTTP server with continuous batching and prefix caching."""

from __future__ import annotations

import argparse
import sys

from kvtier.cli.options import add_model_options, llm_kwargs
from kvtier.engine.llm import LLM
from kvtier.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics) with "
        "continuous batching, paged KV and prefix caching.",
    )
    add_model_options(p)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences in the running batch (64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step (512)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (16)")
    p.add_argument("--num-pages", type=int, default=None, help="device KV pages (default: from memory)")
    p.add_argument("--num-host-pages", type=int, default=None, help="host-tier pages (default: --num-pages)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of the engine")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="reject longer prompts with 400")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="reject larger request bodies (1 MiB)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from kvtier.serve.app import AppSettings, build_app
        from kvtier.serve.engine import ServeConfig, ServeEngine
    except ImportError as e:
        raise ConfigError(
            f"kvtier serve needs its extra packages ({e.name}): pip install 'kvtier[serve]'"
        ) from None
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    config = ServeConfig(
        page_size=args.page_size,
        num_pages=args.num_pages,
        num_host_pages=args.num_host_pages,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_caching=not args.no_prefix_caching,
        threads=args.threads,
    )
    llm = LLM(**llm_kwargs(args))
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
        f"{config.page_size} tokens, max {engine.max_model_len} tokens per sequence)",
        file=sys.stderr,
    )
    uvicorn.run(build_app(engine, settings), host=args.host, port=args.port, log_level="info")
    return 0
