"""What an eval run produces: per-sample records, aggregates, the machine, JSON and a table."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import ConfigError

GROUPINGS = {
    "cells": ("method", "task", "length", "depth"),
    "by_length": ("method", "task", "length"),
    "overall": ("method", "task"),
}
"""Aggregate name -> the record fields it groups by."""
SUBTASK_MEAN = "subtask_mean"
"""The aggregate of a run over several subtasks (RULER): per method and length, the mean of the
subtasks' scores, each weighted equally as RULER reports it."""


@dataclass(frozen=True)
class Record:
    """One sample run with one method."""

    method: str
    task: str
    length: int  # requested context tokens
    depth: float | None  # requested depth in percent; None = drawn per sample
    index: int
    prompt_tokens: int
    needle_depths: tuple[float, ...]
    expected: tuple[str, ...]
    answer: str
    score: float
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # The method dropped nothing at this length and ran lossless (`LLM.exact_note`): the answer
    # is lossless attention's.
    ran_lossless: bool = False

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Record:
        """The inverse of `to_dict` (unknown keys are ignored)."""
        fields = {f.name for f in dataclasses.fields(Record)}
        kwargs: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in fields
        }
        return Record(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["needle_depths"], d["expected"] = list(self.needle_depths), list(self.expected)
        return d


def aggregate(records: Sequence[Record], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Mean score and count per distinct value of `keys`, in order of first appearance, and how
    many of a group's samples ran lossless (`Record.ran_lossless`), where any did."""
    groups: dict[tuple[Any, ...], list[Record]] = {}
    for r in records:
        groups.setdefault(tuple(getattr(r, k) for k in keys), []).append(r)
    rows = []
    for key, group in groups.items():
        row = {**dict(zip(keys, key, strict=True)), "n": len(group)}
        row["score"] = round(sum(r.score for r in group) / len(group), 4)
        exact = sum(r.ran_lossless for r in group)
        rows.append({**row, "ran_lossless": exact} if exact else row)
    return rows


def subtask_means(by_length: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (method, length) of `by_length` rows: the unweighted mean of its subtasks' scores."""
    groups: dict[tuple[str, int], list[float]] = {}
    for c in by_length:
        groups.setdefault((c["method"], c["length"]), []).append(c["score"])
    return [
        {"method": m, "length": n, "subtasks": len(v), "score": round(sum(v) / len(v), 4)}
        for (m, n), v in groups.items()
    ]


def machine_info(device: str) -> dict[str, Any]:
    """Where the run happened: platform, CPU, torch and the device the model ran on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


@dataclass
class EvalResult:
    """A finished run: `meta` (model, methods, seed, machine, version, date, command) + records."""

    meta: dict[str, Any]
    records: list[Record] = field(default_factory=list)

    def aggregates(self) -> dict[str, list[dict[str, Any]]]:
        out = {name: aggregate(self.records, keys) for name, keys in GROUPINGS.items()}
        if len({r.task for r in self.records}) > 1:
            out[SUBTASK_MEAN] = subtask_means(out["by_length"])
        return out

    def summary(self) -> dict[str, Any]:
        """The aggregate object (`--json`): meta plus every aggregate, no per-sample records."""
        return {**self.meta, **self.aggregates()}

    def to_json(self) -> dict[str, Any]:
        """Everything (`--out`): the summary plus one record per sample and method."""
        return {**self.summary(), "records": [r.to_dict() for r in self.records]}

    def save(self, path: str | Path) -> None:
        """Write `to_json()` to `path` whole: a temporary file beside it, then renamed over it, so
        a reader never sees half a file (ConfigError when it cannot be written)."""
        target = Path(path)
        partial = target.with_name(target.name + ".part")
        try:
            partial.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
            partial.replace(target)
        except OSError as e:
            raise ConfigError(f"cannot write the results to {path}: {e}") from None

    @staticmethod
    def load(path: str | Path) -> EvalResult:
        """Read a result saved with `save` (e.g. to plot it again)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read results from {path}: {e}") from None
        meta = {k: v for k, v in data.items() if k not in ("records", SUBTASK_MEAN, *GROUPINGS)}
        return EvalResult(meta, [Record.from_dict(r) for r in data.get("records", [])])

    def table(self) -> str:
        """Scores in percent: per method, depth x length (niah) or subtask x length."""
        task = self.meta.get("task")
        lines: list[str] = []
        cells = self.aggregates()["cells" if task == "niah" else "by_length"]
        lengths = sorted({c["length"] for c in cells})
        for method in dict.fromkeys(c["method"] for c in cells):
            mine = [c for c in cells if c["method"] == method]
            row_key = "depth" if task == "niah" else "task"
            rows = list(dict.fromkeys(c[row_key] for c in mine))
            lines.append(f"method {method}: score % ({'depth' if task == 'niah' else 'task'} x length)")
            lines.append(f"{'':>16}" + "".join(f"{_k(n):>8}" for n in lengths))
            for row in rows:
                vals = {c["length"]: c["score"] for c in mine if c[row_key] == row}
                label = f"{row:g}%" if isinstance(row, float) else str(row)
                lines.append(
                    f"{label:>16}"
                    + "".join(f"{100 * vals[n]:>8.1f}" if n in vals else f"{'-':>8}" for n in lengths)
                )
            overall = [c for c in self.aggregates()["overall"] if c["method"] == method]
            lines.append(
                "  mean: " + ", ".join(f"{c['task']} {100 * c['score']:.1f}% (n={c['n']})" for c in overall)
            )
            exact = sum(c.get("ran_lossless", 0) for c in overall)
            if exact:
                lines.append(f"  {exact} sample(s) ran lossless: the method dropped nothing at their length")
            for m in (c for c in self.aggregates().get(SUBTASK_MEAN, []) if c["method"] == method):
                at = _k(m["length"])
                lines.append(f"  mean of {m['subtasks']} subtasks at {at}: {100 * m['score']:.1f}%")
            lines.append("")
        return "\n".join(lines).rstrip()


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)
