"""Compile kernel variants all the way to a cubin for a smaller GPU (sm89, the RTX 4090: 99 KB of
shared memory a block) and report the shared memory each needs at its asked pipeline stages and
at each fewer: what `kvtier.attention.fit_shared.launch` falls back through. Run by
`tests/test_fit_shared.py` in a process with TRITON_INTERPRET unset (as
`tests.triton_compile_variants`, whose signatures it uses over `tests.triton_variants`); no GPU needed.

    python -m tests.triton_shared_fit sparse_attn_fwd buffers_attn_fwd

prints one JSON line a variant it keeps: {"kernel", "variant", "shared": {stages: bytes}}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

SM89_SHARED = 101_376  # bytes of shared memory a block may opt into on sm86/sm89 (99 KB)


def _largest(kernel: str) -> list[Any]:
    """The variants of `kernel` that ask for the most shared memory by their tile shapes: the
    widest heads, the float32 queries and the RoPE-in-kernel cases at the largest tiles."""
    from tests.triton_variants import variants

    keep = []
    for v in variants([kernel]):
        case = v.case
        if kernel == "sparse_attn_fwd":
            wanted = case.get("ROTATE") and not case.get("SPLIT") and not case.get("STREAMING")
            wanted = wanted and case.get("PER_BLOCK_WINDOW") and case.get("D") == 128
        elif kernel == "_bisect_kernel":  # the tallest rows (tiles within TILE_QUERY_BYTES)
            wanted = case.get("rows") == 1024
        else:  # buffers_attn_fwd: float32 queries of 256-wide heads (Gemma-2's) hold the most
            wanted = case.get("D") == 256 and case.get("dtype") == "float32"
        if wanted:
            keep.append(v)
    return keep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("kernels", nargs="+")
    parser.add_argument("--capability", type=int, default=89)
    opts = parser.parse_args(argv)
    if "triton" not in sys.modules:
        os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    from tests.triton_compile_variants import Compiler
    from tests.triton_variants import KERNELS

    compiler = Compiler()
    compiler.target = GPUTarget("cuda", opts.capability, 32)
    compiler.backend = CUDABackend(compiler.target)
    for kernel in opts.kernels:
        fn = getattr(importlib.import_module(KERNELS[kernel]), kernel)
        for v in _largest(kernel):
            asked = int(v.options.get("num_stages", 3))
            shared = {}
            for stages in range(asked, 0, -1):
                src = ASTSource(fn, *compiler.signature(fn, v.args))
                options = {**v.options, "num_stages": stages}
                shared[stages] = triton_compile(src, target=compiler.target, options=options).metadata.shared
            print(json.dumps({"kernel": kernel, "variant": v.label, "shared": shared}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
