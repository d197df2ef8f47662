"""What `bench/gpu_smoke.py` records: one `Check` per command or server step, the runner that
executes `kvtier` subprocesses and prints each result as it comes, and the table printed last."""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORDS = [
    "river", "lantern", "copper", "meadow", "signal", "harbor", "orchard", "glacier",
    "violet", "thunder", "ember", "canyon", "marble", "falcon", "willow", "quartz",
    "beacon", "summit", "cedar", "prairie", "ledger", "compass", "velvet", "anchor",
]  # fmt: skip


@dataclass
class Check:
    """One command (or one step of the server session) and what came of it."""

    model: str
    name: str
    argv: list[str]
    ok: bool
    seconds: float
    rc: int | None = None
    peak_gb: float | None = None
    detail: str = ""


@dataclass
class Smoke:
    kvtier: list[str]
    workdir: Path
    checks: list[Check] = field(default_factory=list)
    agreement: dict[str, Any] = field(default_factory=dict)
    only: tuple[str, ...] = ()  # run only checks whose name holds one of these (empty: all)
    on_add: Any = None  # called after every check (the script rewrites its JSON)
    lock: threading.RLock = field(default_factory=threading.RLock)  # checks may run in threads

    def wanted(self, name: str) -> bool:
        return not self.only or any(o in name for o in self.only)

    def add(self, check: Check) -> Check:
        with self.lock:
            self.checks.append(check)
            if self.on_add is not None:
                self.on_add()
            mark = "ok " if check.ok else "FAIL"
            print(
                f"[{mark}] {check.model:8s} {check.name:32s} {check.seconds:6.1f}s {check.detail}", flush=True
            )
        return check

    def cli(
        self,
        model: str,
        name: str,
        args: list[str],
        timeout: float = 300,
        parse_json: bool = False,
        stdin: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> tuple[Check | None, Any]:
        """Run `kvtier ARGS` (with `env` over this process's environment); ok = exit 0 and no
        traceback (and JSON on stdout with parse_json). A check `only` leaves out is not run:
        (None, None)."""
        if not self.wanted(name):
            return None, None
        argv = [*self.kvtier, *args]
        t0 = time.perf_counter()
        try:
            text_in = None if stdin is None else stdin.read_text()
            p = subprocess.run(
                argv,
                input=text_in,
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=self.workdir,
                env=None if env is None else {**os.environ, **env},
            )
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = None, str(e.stdout or ""), f"timed out after {timeout:.0f} s"
        seconds = time.perf_counter() - t0
        ok = rc == 0 and "Traceback" not in err
        detail, data = "", None
        if ok and parse_json:
            try:
                data = json.loads(out)
            except json.JSONDecodeError:
                ok, detail = False, "stdout is not JSON"
        if not ok:
            detail = detail or last_line(err)
        shown = [*(f"{k}={v}" for k, v in (env or {}).items()), "kvtier", *args]
        return self.add(Check(model, name, shown, ok, round(seconds, 2), rc, detail=detail)), data


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def prose(n_words: int, seed: int) -> str:
    """Deterministic filler text with numbers in it, so prompts are not one repeated phrase."""
    rng = random.Random(seed)
    out = []
    for i in range(n_words // 12):
        words = rng.sample(WORDS, 10)
        out.append(
            f"Entry {i}: the {words[0]} near the {words[1]} counted {rng.randint(10, 99999)} "
            f"{words[2]}s, and {' '.join(words[3:10])}."
        )
    return " ".join(out)


def table(checks: list[Check]) -> str:
    """One line per check: model, name, ok, seconds, peak GPU GB, detail (names and details cut)."""
    rows = [f"{'model':9s} {'check':32s} {'ok':4s} {'s':>6s} {'peak GB':>8s}  detail"]
    for c in checks:
        peak = "" if c.peak_gb is None else f"{c.peak_gb:.2f}"
        rows.append(
            f"{c.model:9s} {c.name[:32]:32s} {'ok' if c.ok else 'FAIL':4s} {c.seconds:6.1f} {peak:>8s}  "
            f"{c.detail[:90]}"
        )
    return "\n".join(rows)
