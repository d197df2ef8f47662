"""Host time the engine spends turning a sequence's output tokens into text, per batch step.

The engine needs a sequence's output text after each new token (stop strings, streamed deltas).
Decoding the whole output every step costs O(length) a token; `IncrementalText` decodes the
tokens since the last character boundary. For outputs of each length, this times every step of
one sequence's generation both ways with the embedded SmolLM2's tokenizer (the output is real
text: the eval's prose haystack, tokenized), and reports the mean per step over the whole
output and over its last 64 steps, and what one batch step of `--batch` such sequences costs.

    python bench/detokenize.py --name detokenize_cpu
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.engine.batch.detokenize import IncrementalText
from kvtier.eval.haystack import prose_text
from kvtier.loading.embedded import embedded_gguf_path
from kvtier.loading.gguf import gguf_to_hf_folder


def time_steps(tok: Any, ids: list[int], incremental: bool) -> list[float]:
    """Seconds of each step's text update, for steps 1 .. len(ids)."""
    inc = IncrementalText(tok)
    out = []
    for i in range(1, len(ids) + 1):
        t0 = time.perf_counter()
        if incremental:
            inc.update(ids[:i])
        else:
            tok.decode(ids[:i], skip_special_tokens=True)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="128,512,2048", help="output lengths in tokens")
    ap.add_argument("--batch", type=int, default=64, help="sequences in a batch step")
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="a folder of the embedded model's tokenizer files (default: the GGUF)",
    )
    ap.add_argument("--name", default="detokenize_cpu")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    folder = args.tokenizer or gguf_to_hf_folder(
        embedded_gguf_path(), os.environ.get("KVTIER_CACHE_DIR") or ".cache"
    )
    tok = AutoTokenizer.from_pretrained(folder)
    text_ids = tok(prose_text())["input_ids"]
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        ids = text_ids[:n]
        row: dict[str, Any] = {"output_tokens": n}
        for mode in ("full", "incremental"):
            steps = time_steps(tok, ids, mode == "incremental")
            mean, last = sum(steps) / n, sum(steps[-64:]) / len(steps[-64:])
            row[f"{mode}_us_per_step_mean"] = round(1e6 * mean, 1)
            row[f"{mode}_us_per_step_last64"] = round(1e6 * last, 1)
            row[f"{mode}_ms_per_batch_step_last64"] = round(1e3 * last * args.batch, 3)
        rows.append(row)
        print(row, flush=True)
    path = write_results(
        args.name,
        {
            "tokenizer": "embedded SmolLM2-135M-Instruct (byte-level BPE)",
            "data": "real text: the eval's prose haystack, tokenized, as the output",
            "batch": args.batch,
            "load_average": os.getloadavg(),
            "rows": rows,
        },
    )
    print(path)


if __name__ == "__main__":
    main()
