"""Every launched Triton kernel of kvtier compiles (Triton's frontend, to TTIR, for sm90; no
GPU needed) with every constexpr combination its wrapper passes.

Why: the other Triton tests run the kernels in Triton's interpreter (TRITON_INTERPRET=1), which
runs their Python source and never compiles it, so a variant the compiler rejects passes there.
That is how `_bisect_kernel` failed on the GPU with host int4 keys at 1M tokens (a constexpr flag
assigned to a local stopped being a constexpr, so a disabled branch compiled: "Cannot
make_shape_compatible"); this test fails on that bug. The variants and the compiling are in
`tests/triton_compile_variants.py`, run in subprocesses with TRITON_INTERPRET unset (kernels
imported under the interpreter are interpreted functions, which cannot compile).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.triton_variants import KERNELS, variants

ROOT = Path(__file__).resolve().parent.parent
MAX_SHARDS = 4  # processes compiling at once (CI has 2 cores)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every variant's result ({"index", "kernel", "variant", "error"}) by kernel, compiled in
    `os.cpu_count()` (at most MAX_SHARDS) processes."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    shards = max(1, min(MAX_SHARDS, os.cpu_count() or 1))
    folder = tmp_path_factory.mktemp("triton-compile")
    procs = []
    for i in range(shards):
        cmd = [sys.executable, "-m", "tests.triton_compile_variants", "--shard", f"{i}/{shards}"]
        out, err = (folder / f"{i}.out").open("w"), (folder / f"{i}.err").open("w")
        with out, err:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in KERNELS}
    try:
        for i, proc in enumerate(procs):
            code = proc.wait(timeout=600)
            if code not in (0, 1):  # 1: some variant failed (reported per kernel below)
                pytest.fail(f"shard {i} exited {code}:\n{(folder / f'{i}.err').read_text()[-4000:]}")
            for line in (folder / f"{i}.out").read_text().splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    results[row["kernel"]].append(row)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {name: sorted(rows, key=lambda row: row["index"]) for name, rows in results.items()}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_compiles_to_ttir_for_sm90(kernel: str, compiled: dict[str, list[dict[str, Any]]]) -> None:
    rows = compiled[kernel]
    assert len(rows) == len(variants([kernel])), f"{kernel}: {len(rows)} results of {len(variants([kernel]))}"
    failed = [row for row in rows if row["error"]]
    if failed:
        causes = Counter(row["error"].splitlines()[0] for row in failed)
        lines = [f"{len(failed)} of {len(rows)} variants of {kernel} do not compile (TTIR, sm90):"]
        for cause, n in causes.items():
            first = next(row for row in failed if row["error"].splitlines()[0] == cause)
            lines += [f"\n{n} variant(s), e.g. {first['variant']}:", first["error"]]
        lines += ["\nfailing variants:", *(row["variant"] for row in failed[:20])]
        if len(failed) > 20:
            lines.append(f"... and {len(failed) - 20} more")
        pytest.fail("\n".join(lines), pytrace=False)


def _launched_kernels() -> set[str]:
    """Names of the @triton.jit functions that some kvtier module launches (`kernel[grid](...)`,
    or through `kvtier.attention.fit_shared.launch`)."""
    jit: set[str] = set()
    launched: set[str] = set()
    for path in (ROOT / "kvtier").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef):
                if any("triton.jit" in ast.unparse(d) for d in node.decorator_list):
                    jit.add(node.name)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
            ):
                launched.add(node.func.value.id)
            elif (  # `fit_shared.launch(kernel, grid, ...)`
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "launch"
                and node.args
                and isinstance(node.args[0], ast.Name)
            ):
                launched.add(node.args[0].id)
    return jit & launched


def test_every_launched_kernel_is_compiled_here() -> None:
    """A new kernel needs its variants in tests/triton_compile_variants.py."""
    assert _launched_kernels() == set(KERNELS)
