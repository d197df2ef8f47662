"""bench/host_key_read.py's kernels (keys read from host memory, scored there, blocks gathered)
equal torch, in Triton's interpreter on the CPU: the GPU timings are of kernels that are right."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.triton_interpreter import NEEDS_TRITON

pytestmark = NEEDS_TRITON


def test_host_key_read_kernels_equal_torch() -> None:
    root = Path(__file__).parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "bench/host_key_read.py", "--check", "--device", "cpu"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "every kernel equals torch" in res.stdout
