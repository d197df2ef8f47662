"""Decode step times of `bench/hip_offload.py` runs (or `bench/hip_cli_speed.py`'s, whose rows
keep `kvtier generate`'s `decode_step_times_s`), one line per (file, method), log scale: where
HiP over offloaded KV spends a token, the steps that rerun a pruning stage against those that
rerun none (a stage-0 refresh takes seconds at 1M where a step between refreshes takes ~0.09 s).

    python bench/plot_steps.py bench/results/hip_offload_planned_1m_int4_runs.json \
        bench/results/hip_offload_planned_1m_int4_gather.json --out docs/hip_1m_steps.png

Each line is labelled with its file's "code" (the commit measured) when it has one, and its
amortized s/token. `--prefill` plots the CLI rows' `prefill_step_s` instead, linear: a chunk a
step by chunk, a layer a step by layer, HiP's last prompt token alone last (where a 512K
prefill goes, by chunk and by layer):

    python bench/plot_steps.py --prefill bench/results/hip_cli_speed_512k_fast_landmarks_triton.json \
        bench/results/hip_cli_speed_512k_fast_landmarks_layer.json --ymax 7 \
        --out docs/hip_512k_prefill_steps.png

Needs matplotlib (`pip install 'kvtier[plot]'`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _steps(row: dict[str, Any], prefill: bool = False) -> list[float]:
    """A row's decode step seconds (the bench's `decode_steps_s` or the CLI's
    `decode_step_times_s`), or with `prefill` its `prefill_step_s`."""
    if prefill:
        return list(row.get("prefill_step_s") or [])
    return list(row.get("decode_steps_s") or row.get("decode_step_times_s") or [])


def step_lines(paths: list[Path], method: str | None, prefill: bool = False) -> list[tuple[str, list[float]]]:
    """(label, step seconds) of every row of `paths` that has step times (and is `method`, when
    given; with `prefill` its prefill steps, warm-up rows left out). Raises SystemExit naming a
    file that holds none."""
    lines = []
    phase = "prefill" if prefill else "decode"
    for path in paths:
        data: dict[str, Any] = json.loads(path.read_text())
        rows = [r for r in data.get("rows", []) if len(_steps(r, prefill)) > 2]
        rows = [r for r in rows if method is None or r.get("method") == method]
        rows = [r for r in rows if not (prefill and r.get("warmup"))]
        if not rows:
            which = f" for method {method!r}" if method else ""
            sys.exit(f"{path}: no row with {phase} step times{which}")
        code = str(data.get("code", path.stem)).split()[0]
        for r in rows:
            if prefill:
                rate = r.get("prefill_tokens_per_s")
                tail = f" by {r.get('prefill_order', 'chunk')}" + (f", {rate:,.0f} tok/s" if rate else "")
            else:
                amort = r.get("amortized_s_per_token")
                tail = f", {amort:.3f} s/token amortized" if isinstance(amort, float) else ""
            lines.append((f"{r['method']} at {code}{tail}", [float(s) for s in _steps(r, prefill)]))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="hip_offload or hip_cli_speed JSON results")
    ap.add_argument("--method", default=None, help="only rows of this method (e.g. hip-fast)")
    ap.add_argument("--prefill", action="store_true", help="the rows' prefill steps, not their decode steps")
    ap.add_argument("--title", default=None, help="(default: by what is plotted)")
    ap.add_argument("--ymax", type=float, default=None, help="clip the y axis here (seconds; prefill)")
    ap.add_argument("--out", type=Path, default=Path("hip_steps.png"))
    args = ap.parse_args()
    for f in args.files:
        if not f.is_file():
            sys.exit(f"{f}: no such file (a bench/hip_offload.py or bench/hip_cli_speed.py JSON result)")
    lines = step_lines(args.files, args.method, args.prefill)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        sys.exit("plotting needs matplotlib: pip install 'kvtier[plot]'")
    fig = Figure(figsize=(8, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, steps in lines:
        ax.plot(range(len(steps)), steps, marker="o", markersize=3, label=label)
    if args.prefill:
        ax.set_xlabel("prefill step (a chunk, or a layer by layer; last: the prompt's last token alone)")
        ax.set_ylim(bottom=0, top=args.ymax)
        title = "HiP prefill steps over offloaded KV"
    else:
        ax.set_yscale("log")
        ax.set_xlabel("decode step")
        title = "HiP decode steps over offloaded KV"
    ax.set_ylabel("seconds")
    ax.set_title(args.title or title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
