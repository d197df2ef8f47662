"""`kvtier plan --plot`: total GPU memory versus context for each method (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path

from kvtier.errors import CapacityError, ConfigError
from kvtier.planner.memory import GPU_RESERVE_BYTES
from kvtier.planner.methods import METHODS, method_memory
from kvtier.planner.report import PlanRequest

GiB = 1024**3


def plot_memory(req: PlanRequest, path: str | Path, points: int = 40) -> None:
    """Save a log-x plot of each method's GPU memory (GiB) from 1K tokens to 4x the context.

    The horizontal line is the usable budget (--gpu-memory minus the CUDA reserve); kvtier's
    curve stops where its plan no longer fits the GPU or host budget.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kvtier[plot]'") from None
    top = max(4 * req.context, 2048)
    contexts = sorted({int(1024 * (top / 1024) ** (i / (points - 1))) for i in range(points)})
    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for method in METHODS:
        xs: list[int] = []
        ys: list[float] = []
        for n in contexts:
            if method == "auto":
                try:
                    plan = req.plan(n)
                except CapacityError:
                    break
                m = method_memory(req.cfg, method, n, dtype_bytes=req.dtype_bytes, plan=plan)
            else:
                m = method_memory(
                    req.cfg,
                    method,
                    n,
                    dtype_bytes=req.dtype_bytes,
                    chunk=req.baseline_chunk,
                    activation_model=req.activation_model,
                )
            xs.append(n)
            ys.append(m.total_gpu / GiB)
        ax.plot(xs, ys, label="kvtier (auto)" if method == "auto" else method)
    usable = (req.gpu_budget - GPU_RESERVE_BYTES) / GiB
    ax.axhline(usable, color="black", linestyle="--", label="GPU budget - reserve")
    ax.axvline(req.context, color="grey", linestyle=":", label=f"{req.context:,} tokens")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("GPU memory (GiB)")
    ax.set_title(f"{req.model}: GPU memory by KV method")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (OSError, ValueError) as e:  # unwritable path, unknown image format
        raise ConfigError(f"cannot write the plot to {path}: {e}") from None
