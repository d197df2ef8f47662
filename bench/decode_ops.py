"""Operators and host syncs per decode token of `LLM.generate` under a method, by where they come
from: the launch count that bounds a small model's eager decode on a GPU, measured on the CPU.

HiP decode on the embedded SmolLM2 ran 13-19 tok/s on the H200 where the same store's dense path
ran 42-60 (`bench/results/hip_small_prefill_paths.json`), both eager. A GPU step whose kernels
are small costs its launches (~10-15 us each from Python) and its syncs (each drains the queue).
This counts both for one prompt: a generate of 1 token and one of `--tokens` + 1, the
difference divided by `--tokens`, so prefill drops out. Operators are non-view aten operators
(`kvtier.sparse.opcount`), attributed to the innermost `kvtier/sparse` function on the stack
("model and store" otherwise); syncs are the tensor-to-Python conversions on the stack's
innermost three kvtier frames.

    python bench/decode_ops.py --lengths 4K --methods "auto;hip,hip_preset=long;hip,hip_preset=lean"

`--prefill` counts the prompt's prefill instead (a generate of one token, whose sampling is a
handful of operators): what bounds a small model's HiP prefill on a GPU when its kernels are short.

Random weights of `--model` (a preset) and random prompt ids: the counts do not depend on values.
Results: $OUT/decode_ops.json (else bench/results/).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kvtier.attention.dense as dense
from bench.common import write_results
from bench.profiling import SYNC_METHODS
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.units import parse_count


def _where(depth: int) -> str:
    """The innermost kvtier frames of the caller's stack (`depth` of them), or the innermost
    kvtier/sparse function alone when depth is 0."""
    f = sys._getframe(2)
    names: list[str] = []
    while f is not None:
        path = f.f_code.co_filename
        if depth == 0 and "/kvtier/sparse/" in path:
            return f"{path.split('/kvtier/')[1]}:{f.f_code.co_name}"
        if depth and "/kvtier/" in path:
            names.append(f"{path.split('/kvtier/')[1]}:{f.f_lineno}:{f.f_code.co_name}")
            if len(names) == depth:
                break
        f = f.f_back
    return " < ".join(names) if depth else "model and store"


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.counts[_where(0)] += 1
        return func(*args, **(kwargs or {}))


def counted(llm: LLM, ids: list[int], method: str, tokens: int) -> tuple[Counter[str], Counter[str]]:
    """(operators, syncs) of one generate of `tokens` new tokens, by source."""
    syncs: Counter[str] = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def wrap(name: str) -> Any:
        def inner(*a: Any, **k: Any) -> Any:
            syncs[f"{name} at {_where(3)}"] += 1
            return saved[name](*a, **k)

        return inner

    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        with _Ops() as ops:
            llm.generate(ids, SamplingParams(max_tokens=tokens, ignore_eos=True), method=method)
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
    return ops.counts, syncs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a preset (random weights)")
    ap.add_argument("--lengths", default="4K", help="prompt lengths in tokens (comma list)")
    ap.add_argument("--methods", default="auto;hip,hip_preset=long;hip,hip_preset=lean", help="';'-separated")
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens counted")
    ap.add_argument("--prefill", action="store_true", help="count the prefill (one token generated)")
    ap.add_argument("--chunk-size", type=int, default=None, help="prefill chunk (default: the plan's)")
    ap.add_argument(
        "--fixed-shapes",
        action="store_true",
        help="Quest decodes in CUDA's fixed shapes (quest.FIXED_SHAPES), not the CPU's union",
    )
    ap.add_argument("--name", default="decode_ops")
    args = ap.parse_args()
    if args.fixed_shapes:
        import kvtier.policies.quest as quest

        quest.FIXED_SHAPES = True
    # NOTE: PyTorch's causal-bias tensor subclass cannot be made under a dispatch mode; a boolean
    # mask gives the same prefill (which the difference drops anyway).
    dense.causal_lower_right = lambda t, s: torch.ones(t, s, dtype=torch.bool).tril(s - t)  # type: ignore[assignment]
    lengths = [parse_count(x, "--lengths") for x in args.lengths.split(",")]
    llm = LLM(
        args.model, device="cpu", max_model_len=max(lengths) + args.tokens + 64, chunk_size=args.chunk_size
    )
    rows = []
    for length in lengths:
        ids = torch.randint(
            0, llm.model_config.vocab_size, (length,), generator=torch.Generator().manual_seed(0)
        )
        for method in [m for m in args.methods.split(";") if m]:
            ops1, syncs1 = counted(llm, ids.tolist(), method, 1)
            if args.prefill:
                ops, syncs, n, what = ops1, syncs1, 1, "prefill"
            else:
                ops, syncs = counted(llm, ids.tolist(), method, args.tokens + 1)
                ops.subtract(ops1)
                syncs.subtract(syncs1)
                n, what = args.tokens, "token"
            row = {
                "method": method,
                "prompt_tokens": length,
                "counted": what,
                f"operators_per_{what}": round(sum(ops.values()) / n, 1),
                f"syncs_per_{what}": round(sum(syncs.values()) / n, 2),
                "operators_by_source": {k: round(v / n, 1) for k, v in ops.most_common() if v > 0},
                "syncs_by_source": {k: round(v / n, 2) for k, v in syncs.most_common() if v > 0},
            }
            rows.append(row)
            print(f"{length:>7} {method:<24} {row[f'operators_per_{what}']:>8} ops/{what} "
                  f"{row[f'syncs_per_{what}']:>5} syncs/{what}", flush=True)  # fmt: skip
    path = write_results(
        args.name,
        {
            "model": f"{args.model} (random weights), CPU",
            "decode_tokens": None if args.prefill else args.tokens,
            "chunk_size": args.chunk_size,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
