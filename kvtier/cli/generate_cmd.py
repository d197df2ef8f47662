"""`kvtier generate`: one prompt in, text (or a JSON object) out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtier.cli.options import add_method_options, add_model_options, llm_kwargs
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError, PromptError
from kvtier.units import format_bytes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for one prompt",
        description="Generate text for one prompt with the tiered KV cache.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a file ('-' for stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids, stats")
    add_model_options(p)
    add_method_options(p)
    p.set_defaults(func=run)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return str(args.prompt)
    path: Path = args.prompt_file
    if str(path) == "-":
        return sys.stdin.read()
    try:
        return path.read_text()
    except OSError as e:
        raise PromptError(f"cannot read --prompt-file {path}: {e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    if not prompt.strip():
        raise PromptError("the prompt is empty; give some text with --prompt or --prompt-file")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    params = SamplingParams(
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    llm = LLM(**llm_kwargs(args))
    out = llm.generate(prompt, params, chat=args.chat, progress=True)[0]
    if args.json:
        print(json.dumps(out.to_dict()))
        return 0
    print(out.text)
    s = out.stats
    peaks = ", ".join(f"{k} {format_bytes(v)}" for k, v in s.peak_bytes.items())
    print(
        f"[{s.prompt_tokens} prompt tokens, prefill {s.prefill_tokens_per_s:.0f} tok/s; "
        f"{s.generated_tokens} new, decode {s.decode_tokens_per_s:.2f} tok/s; kv={s.plan.get('policy')} "
        f"group={s.plan.get('group_size')} resident={s.plan.get('resident_slices')}; peak {peaks}]",
        file=sys.stderr,
    )
    return 0
