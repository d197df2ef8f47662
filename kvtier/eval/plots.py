"""`kvtier eval --plot`: NIAH heatmaps and accuracy-vs-length lines (needs matplotlib).

- niah: one heatmap per method; x = context length, y = needle depth, colour = mean score,
  Kamradt's red -> yellow -> green map.
- passkey: accuracy vs length, one line per method.
- ruler: one panel per subtask, accuracy vs length, one line per method.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.eval.results import EvalResult

KAMRADT_COLOURS = ("#F0496E", "#EBB839", "#0CD79F")


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _figure(width: float, height: float) -> Any:
    """A pyplot-free figure (no global state), laid out to fit its labels and colour bar."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kvtier[plot]'") from None
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_results(result: EvalResult, path: str | Path) -> None:
    """Save the plot that suits the result's task to `path` (format from its suffix)."""
    fig = plot_heatmaps(result) if result.meta.get("task") == "niah" else plot_lines(result)
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot save the plot to {path}: {e}") from None


def _title(result: EvalResult) -> str:
    m = result.meta
    return f"{m.get('task')} on {m.get('model')}\n{m.get('samples')} sample(s) per cell, seed {m.get('seed')}"


def plot_heatmaps(result: EvalResult) -> Any:
    """One depth x length heatmap per method."""
    from matplotlib.colors import LinearSegmentedColormap

    cells = result.aggregates()["cells"]
    methods = list(dict.fromkeys(c["method"] for c in cells))
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells if c["depth"] is not None})
    fig = _figure(1.2 + 0.9 * len(lengths) * len(methods) + 1.0, 1.5 + 0.38 * len(depths))
    cmap = LinearSegmentedColormap.from_list("kamradt", list(KAMRADT_COLOURS))
    axes = fig.subplots(1, len(methods), squeeze=False)[0]
    image = None
    for ax, method in zip(axes, methods, strict=True):
        score = {(c["depth"], c["length"]): c["score"] for c in cells if c["method"] == method}
        grid = [[score.get((d, n), float("nan")) for n in lengths] for d in depths]
        image = ax.imshow(grid, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:  # not NaN
                    ax.text(j, i, f"{v:.2f}".rstrip("0").rstrip("."), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [_k(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(method)
    axes[0].set_ylabel("needle depth")
    if image is not None:
        fig.colorbar(image, ax=list(axes), label="score (recall)")
    fig.suptitle(_title(result), fontsize=9)
    return fig


def plot_lines(result: EvalResult) -> Any:
    """Accuracy vs length: one panel per subtask, one line per method."""
    rows = result.aggregates()["by_length"]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cols = min(len(tasks), 3)
    nrows = -(-len(tasks) // cols)
    fig = _figure(max(4.0 * cols, 5.5), 3.2 * nrows + 0.6)
    axes = fig.subplots(nrows, cols, squeeze=False).ravel()
    lengths = sorted({r["length"] for r in rows})
    for ax, task in zip(axes, tasks, strict=False):
        for method in methods:
            pts = sorted(
                (r["length"], r["score"]) for r in rows if r["task"] == task and r["method"] == method
            )
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_k(n) for n in lengths])
        ax.minorticks_off()
        ax.set_ylim(-5, 105)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(task)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[len(tasks) :]:
        ax.set_visible(False)
    fig.suptitle(_title(result), fontsize=9)
    return fig
