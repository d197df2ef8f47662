"""Triton kernels on CPU tensors in tests: Triton's interpreter (TRITON_INTERPRET=1).

Import this module before anything imports triton: without CUDA it sets TRITON_INTERPRET=1,
and Triton picks interpreter or compiler when a kernel is decorated. Where torch imported
triton.language earlier (while collecting other test modules), the CPU cases cannot run in this
process: `run_cpu_cases` re-runs a test file's "cpu" cases in a fresh interpreter-mode process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreter_in_process() -> bool:
    """TRITON_INTERPRET=1 and triton.language was decorated under it (not imported before)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or importlib.util.find_spec("triton") is None:
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


INTERPRET = interpreter_in_process()
NEEDS_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1 before triton is imported"
        ),
    ),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]
# For the test that re-runs the CPU cases: needed only when they could not run in this process.
SUBPROCESS_ONLY = pytest.mark.skipif(
    INTERPRET or torch.cuda.is_available(), reason="CPU cases run in this process (or CUDA is used)"
)


def run_cpu_cases(test_file: str) -> None:
    """Run `test_file`'s "cpu" cases in a fresh process with TRITON_INTERPRET=1; they must pass."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", test_file, "-k", "cpu"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout, res.stdout[-2000:]
