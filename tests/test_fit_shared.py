"""HiP's attention kernels launch on a 24 GB card: where the GPU's shared memory per block cannot
hold a tile choice's pipeline stages (tuned on an H100's 227 KB; an RTX 4090 has 99 KB),
`kvtier.attention.fit_shared.launch` retries with fewer, and remembers what fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.attention import fit_shared

ROOT = Path(__file__).resolve().parent.parent


class _Kernel:
    """A stand-in for a JIT kernel on a card that holds at most `fits` stages."""

    def __init__(self, fits: int) -> None:
        self.fits = fits
        self.tried: list[int] = []
        self.fn = self  # a JITFunction's `fn` names it
        self.__name__ = f"kernel_fitting_{fits}"

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def run(*args: Any, num_stages: int, **kwargs: Any) -> None:
            self.tried.append(num_stages)
            if num_stages > self.fits:
                from triton.runtime.errors import OutOfResources

                raise OutOfResources(num_stages * 50_000, self.fits * 50_000, "shared memory")

        return run


def test_launch_falls_back_to_the_stages_that_fit_and_remembers_them() -> None:
    pytest.importorskip("triton")
    kernel = _Kernel(fits=1)
    fit_shared.launch(kernel, (1,), 0, num_stages=3, BLOCK=64, num_warps=4)
    assert kernel.tried == [3, 2, 1]
    fit_shared.launch(kernel, (1,), 0, num_stages=3, BLOCK=64, num_warps=4)
    assert kernel.tried[3:] == [1]  # the configuration's fit is remembered
    fit_shared.launch(kernel, (1,), 0, num_stages=3, BLOCK=32, num_warps=4)
    assert kernel.tried[4:] == [3, 2, 1]  # another configuration tries afresh
    roomy = _Kernel(fits=3)
    fit_shared.launch(roomy, (1,), num_stages=3, BLOCK=64)
    assert roomy.tried == [3]


def test_launch_raises_where_one_stage_does_not_fit() -> None:
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    with pytest.raises(OutOfResources):
        fit_shared.launch(_Kernel(fits=0), (1,), num_stages=2, BLOCK=128)


def test_the_largest_attention_configs_fit_a_4090_with_fewer_stages() -> None:
    """Compiled for sm89 (no GPU needed): HiP's block-sparse attention with RoPE in the kernel
    (128-wide heads, prefill's 256-row tiles and decode's) asks for more than its 99 KB at its
    tuned 3 stages, so a 4090 would refuse the launch; with fewer stages every one fits."""
    pytest.importorskip("triton.backends.nvidia")
    from tests.triton_shared_fit import SM89_SHARED

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "tests.triton_shared_fit", "sparse_attn_fwd", "buffers_attn_fwd"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {r["kernel"] for r in rows} == {"sparse_attn_fwd", "buffers_attn_fwd"}
    over = [r for r in rows if max(r["shared"].values()) > SM89_SHARED]
    assert any(r["kernel"] == "sparse_attn_fwd" for r in over), "the fallback is no longer needed on sm89"
    for r in rows:
        assert min(r["shared"].values()) <= SM89_SHARED, f"{r['kernel']} {r['variant']}: {r['shared']}"


def test_the_pruning_kernel_tallest_rows_fit_a_4090() -> None:
    """Compiled for sm89 (no GPU needed): the pruning kernel's tallest rows, a stage-0 group of
    1,024 queries pooled 4 with 4 heads a KV head (`--hip-stage0 1024` on Llama-3's shapes),
    float32 queries of 128- and 256-wide heads, run in tiles whose queries fit a 4090's shared
    memory. One tile of them asked 272 KiB of an H100's 227 and failed
    (bench/results/hip_cli_speed_512k_fast_stage0_more.json)."""
    pytest.importorskip("triton.backends.nvidia")
    from tests.triton_shared_fit import SM89_SHARED

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "tests.triton_shared_fit", "_bisect_kernel"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {r["variant"].split()[1] for r in rows} == {"D=128", "D=256"}
    for r in rows:
        assert max(r["shared"].values()) <= SM89_SHARED, f"{r['variant']}: {r['shared']}"
