"""`kvtier generate`: one prompt in, text (or a JSON object) out."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvtier.cli.main import STARTED
from kvtier.cli.options import (
    add_method_options,
    add_model_options,
    add_parallel_option,
    check_before_loading,
    decode_utf8,
    float_type,
    int_type,
    llm_kwargs,
    text_type,
)
from kvtier.engine.config import PREFILL_ORDERS
from kvtier.engine.llm import LLM
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import PromptError
from kvtier.kv.tiers import keeping_pinned, release_pinned_cache
from kvtier.units import format_bytes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for one prompt",
        description="Generate text for one prompt with the tiered KV cache.",
        allow_abbrev=False,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=text_type("--prompt"), help="the prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a file ('-' for stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument(
        "--max-new-tokens",
        type=int_type("--max-new-tokens"),
        default=64,
        help="tokens to generate (default 64)",
    )
    p.add_argument(
        "--temperature",
        type=float_type("--temperature", 0.0),
        default=0.0,
        help="0 = greedy (default)",
    )
    p.add_argument("--top-p", type=float_type("--top-p", 0.0, 1.0, lo_open=True), default=1.0)
    p.add_argument("--top-k", type=int_type("--top-k", 0), default=0, help="0 = off (default)")
    p.add_argument(
        "--stop",
        type=text_type("--stop", allow_empty=False),
        action="append",
        default=[],
        help="stop string (repeatable)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate all --max-new-tokens, past the end-of-sequence token (benchmarks)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: text, token_ids, stats, load_s (the model's load) and at_s "
        "(when each part began, on the monotonic clock)",
    )
    p.add_argument(
        "--prefill-order",
        choices=PREFILL_ORDERS,
        default="chunk",
        help="chunk (default): each prompt chunk through every layer; layer: the chunks through "
        "each layer in turn where the KV streams from host memory, so no chunk loads the stored "
        "prompt again (long prompts under a small --gpu-memory)",
    )
    add_model_options(p)
    add_parallel_option(p)
    add_method_options(p)
    p.set_defaults(func=run)


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text: --prompt, or --prompt-file's bytes as UTF-8 (PromptError otherwise)."""
    if args.prompt is not None:
        return str(args.prompt)
    path: Path = args.prompt_file
    if str(path) == "-":
        source = "the prompt on stdin (--prompt-file -)"
        stdin = getattr(sys.stdin, "buffer", None)
        if stdin is None:  # a text stream without bytes underneath (e.g. a StringIO)
            return sys.stdin.read()
        data = stdin.read()
    else:
        source = f"--prompt-file {path}"
        try:
            data = path.read_bytes()
        except OSError as e:
            raise PromptError(f"cannot read --prompt-file {path}: {e.strerror or e}") from None
    return decode_utf8(data, source)


def plan_note(plan: dict[str, object]) -> str:
    """The stats line's plan: the tiered store's placement, or the batch engine's page pool (and
    why a lossy method ran lossless, `LLM.exact_note`)."""
    exact = f"; ran lossless: {plan['ran_lossless']}" if "ran_lossless" in plan else ""
    if plan.get("policy") == "batched":
        graphs = ", CUDA graphs" if "cuda_graphs_capture_s" in plan else ""
        return f"kv=batched ({plan.get('pages', '?')} pages{graphs}){exact}"
    placed = f"kv={plan.get('policy')} group={plan.get('group_size')} resident={plan.get('resident_slices')}"
    return placed + exact


def order_note(asked: str, ran: str) -> str:
    """The stats line's word on `--prefill-order layer`: that it ran, or why the chunks did not
    (the store must stream a layer's slices whole into its staging buffers)."""
    if asked != "layer":
        return ""
    if ran == "layer":
        return "; prefill by layer"
    return (
        "; prefill by chunk (by layer needs two chunks or more and KV streamed from host memory, "
        "one layer's fitting the staging buffers whole: docs/methods.md)"
    )


def tp_note(plan: dict[str, object]) -> str:
    """' per rank of N' for a run over N ranks' stats line (they are rank 0's), else ''."""
    ranks = plan.get("tensor_parallel") or plan.get("pipeline_parallel")
    return f" per rank of {ranks}" if ranks else ""


def run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    if not prompt.strip():
        raise PromptError("the prompt is empty; give some text with --prompt or --prompt-file")
    params = SamplingParams(
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    at = {"started": STARTED, "run": time.perf_counter()}
    check_before_loading(args)
    llm = LLM(**llm_kwargs(args))
    at["loaded"] = time.perf_counter()
    try:
        with keeping_pinned():  # NOTE: the store's pinned host memory is let go after the answer
            out = llm.generate(prompt, params, chat=args.chat, progress=llm.is_rank0)[0]
        at["generated"] = time.perf_counter()
        if llm.is_rank0:  # NOTE: under torchrun every rank runs this command; rank 0 prints
            show(args, out, llm.load_s, at)
    finally:
        llm.close()
        release_pinned_cache()
    return 0


def show(args: argparse.Namespace, out: RequestOutput, load_s: float, at: dict[str, float]) -> None:
    """The answer: one JSON object (`--json`), else its text and a stats line on stderr."""
    if args.json:
        # the model's load (`LLM.load_s`), and when each part began on `time.perf_counter`'s clock
        # (comparable across processes on Linux): where a run's wall goes past its stats' parts
        at["answered"] = time.perf_counter()
        answer = {**out.to_dict(), "load_s": round(load_s, 3), "at_s": at}
        print(json.dumps(answer), flush=True)  # NOTE: flushed: a pipe sees it before the exit
        return
    print(out.text, flush=True)
    s = out.stats
    peaks = ", ".join(f"{k} {format_bytes(v)}" for k, v in s.peak_bytes.items())
    steps = s.decode_step_s
    spread = f" (step p50 {steps['p50'] * 1e3:.1f} ms, max {steps['max'] * 1e3:.1f} ms)" if steps else ""
    # the first new token comes from the prefill: one new token leaves no decode step to time
    decode = "no decode step"
    if s.generated_tokens > 1:
        decode = f"decode {s.decode_tokens_per_s:.2f} tok/s{spread}"
    # a long prompt's store pins its host tier before the prefill (64 GiB at 512K for Llama-3-8B)
    setup = f" after {s.setup_s:.1f} s building the KV store" if s.setup_s >= 0.5 else ""
    if load_s >= 5:
        setup += f" ({load_s:.1f} s loading the model)"
    print(
        f"[{s.prompt_tokens} prompt tokens, prefill {s.prefill_tokens_per_s:.0f} tok/s{setup}; "
        f"{s.generated_tokens} new, {decode}; {plan_note(s.plan)}"
        f"{order_note(args.prefill_order, s.prefill_order)}"
        f"{tp_note(s.plan)}; peak {peaks}]",
        file=sys.stderr,
        flush=True,
    )
