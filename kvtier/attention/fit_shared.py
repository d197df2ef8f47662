"""Launch a Triton kernel with fewer software-pipeline stages where the GPU's shared memory per
block cannot hold the stages a tile choice asks for.

The tile choices were tuned on an H100/H200 (227 KB of shared memory a block). A 24 GB card such
as the RTX 4090 (sm89) has 99 KB: compiled for it, HiP's block-sparse attention with RoPE in the
kernel (Llama-3's 128-wide heads, 3 stages) takes 103-115 KB and its launch fails with Triton's
`OutOfResources` (tests/test_triton_compile.py compiles those configs for sm89). Each stage
buffers one more key tile, so fewer stages need less memory and compute the same values.

`launch` tries the asked stages, then one fewer at a time, and remembers per kernel and
configuration what fit, so only the first launch of a configuration on a small card retries.
"""

from __future__ import annotations

from typing import Any

# (kernel name, its constexprs and num_warps) -> the most stages that fit this process's GPU
_FITTED: dict[tuple[str, tuple[tuple[str, Any], ...]], int] = {}


def _out_of_resources() -> type[Exception]:
    from triton.runtime.errors import OutOfResources

    return OutOfResources


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, num_stages: int, **kwargs: Any) -> None:
    """`kernel[grid](*args, num_stages=..., **kwargs)` with as many stages, up to `num_stages`,
    as the device's shared memory holds. Where even one stage does not fit, Triton's
    OutOfResources propagates (it names the bytes asked and the limit). Under Triton's
    interpreter nothing is out of resources: the asked stages run."""
    name = getattr(getattr(kernel, "fn", None), "__name__", None) or repr(kernel)
    key = (name, tuple(sorted(kwargs.items())))
    stages = min(num_stages, _FITTED.get(key, num_stages))
    too_big = _out_of_resources()
    while True:
        try:
            kernel[grid](*args, num_stages=stages, **kwargs)
        except too_big:
            if stages <= 1:
                raise
            stages -= 1
            continue
        _FITTED[key] = stages
        return
