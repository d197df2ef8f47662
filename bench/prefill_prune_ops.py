"""Operators one layer's HiP prefill pruning launches on CUDA, counted on the CPU with its Triton
kernels stubbed: what bounds a small model's HiP prefill once its kernels are short.

SmolLM2's HiP prefill at 16K was bound by launches on an H100 (0.124x dense, the GPU idle 0.49 s
of a 0.77 s profiled prefill: `bench/results/hip_small_prefill_head_score.json`). This runs
`prune_whole_blocks` and `attend_blocks` for one layer of `--model`'s shapes over a prompt of
`--context` tokens as one prefill chunk, along the CUDA path (`triton=True`): the pruning kernel,
the head score's two passes and the block-sparse attention each count as one launch and return
random values of their outputs' shapes, so the torch operators around them run as on the GPU
(`kvtier.sparse.opcount`: non-view aten operators). Rows: each `--prune-mib` (0: the preset's
default batch, `PRUNE_BATCH_BYTES`; else `HipConfig.prune_bytes`, which a plan with room raises
to a whole chunk's, `kvtier.sparse.planning.whole_chunk_pruning`).

    python bench/prefill_prune_ops.py --model smollm2-135m --context 16K --preset lean --prune-mib 0,1500

Counts do not depend on values; random bf16 queries and keys. NOTE: on the CPU, RoPE's rotation
of queries counts as torch's operators (~8), where CUDA runs the fused kernel (1-3).
Results: $OUT/<name>.json (else bench/results/).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # importable without CUDA; no kernel runs here

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kvtier.sparse.block_sparse as block_sparse
import kvtier.sparse.prefill as prefill
import kvtier.sparse.triton_attn as triton_attn
import kvtier.sparse.triton_bisect as triton_bisect
import kvtier.sparse.triton_head_score as triton_head_score
from bench.common import write_results
from kvtier.loading.presets import preset_config
from kvtier.model.rope import Rotary
from kvtier.sparse import HIP_PRESETS
from kvtier.sparse.kernel import HipKernel
from kvtier.sparse.opcount import OpCounter
from kvtier.sparse.prune_memory import bisect_block_c
from kvtier.sparse.rope_ext import RopeTable
from kvtier.units import parse_count

_counter: list[OpCounter] = []  # the active counter (the stubs count into it)


def _launch(name: str) -> None:
    if _counter:
        _counter[-1].launched(name)


def _bisect(q: torch.Tensor, keys: Any, candidates: Any, first: int, lengths: torch.Tensor, chunk: int,
            **kw: Any) -> torch.Tensor:  # fmt: skip
    """`bisect_triton`'s outputs, random: [B, C], or with per_row the rows' view [B, C, G, rows],
    or with softmax_scale the head score [B, C] (its launches counted as the wrapper makes them)."""
    _launch("_bisect_kernel")
    bsz, nq, g, r, _ = q.shape
    if kw.get("softmax_scale") is not None:
        programs = -(-lengths.shape[1] // triton_head_score.BLOCK_CHUNKS)
        parts = -(-lengths.shape[1] // (triton_bisect.BLOCK_C or bisect_block_c(True)))
        if bsz * programs * g * nq * r * parts > triton_head_score.FOLD_PARTS_MAX:
            _launch("_combine_lse")
        _launch("_chunk_score")
        return torch.rand(bsz, lengths.shape[1])
    if kw.get("per_row"):
        return torch.randn(bsz, g, nq * r, lengths.shape[1]).permute(0, 3, 1, 2)
    return torch.randn(bsz, lengths.shape[1])


def _head_score(rows: torch.Tensor, live: torch.Tensor, scale: float) -> torch.Tensor:
    _launch("_row_lse")
    _launch("_chunk_score")
    return torch.rand(rows.shape[0], rows.shape[1])


def _attend(q: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
    _launch("sparse_attn_fwd")
    return torch.zeros_like(q)


def _stub() -> Callable[[], None]:
    """Replace the kernels (and the CUDA checks) with counted stand-ins; returns the undo."""
    saved = [
        (triton_bisect, "bisect_triton", _bisect),
        (triton_head_score, "softmax_head_score_triton", _head_score),
        (triton_attn, "attend_blocks_triton", _attend),
        (block_sparse, "use_triton", lambda: True),
    ]
    run_block_stages = prefill.run_block_stages

    def on_cuda_path(*args: Any, **kw: Any) -> Any:
        return run_block_stages(*args, **{**kw, "triton": True})

    saved.append((prefill, "run_block_stages", on_cuda_path))
    old = [(mod, name, getattr(mod, name)) for mod, name, _ in saved]
    for mod, name, new in saved:
        setattr(mod, name, new)

    def undo() -> None:
        for mod, name, value in old:
            setattr(mod, name, value)

    return undo


def count(model: str, context: int, preset: str, prune_mib: int, layer: int) -> dict[str, Any]:
    """One layer's pruning and attention over a `context`-token chunk: operators and launches."""
    cfg = preset_config(model)
    hip = HIP_PRESETS[preset]
    if prune_mib:
        hip = replace(hip, prune_bytes=prune_mib << 20)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(context, cfg.num_heads, cfg.head_dim, generator=gen).to(torch.bfloat16)
    kv = torch.randn(context, 2, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(torch.bfloat16)
    rope = RopeTable(Rotary(cfg.rope, cfg.head_dim))
    kernel = HipKernel(hip, Rotary(cfg.rope, cfg.head_dim))
    starts = [kernel._window_start(b) for b in range(0, context, hip.block_q)]

    def layer_step() -> None:
        prefix, _ = prefill.prune_whole_blocks(q, 0, kv[:, 0], starts, hip, layer, rope)
        block_sparse.attend_blocks(
            q, 0, hip.block_q, kv, prefix, starts, rotary=rope, mode=hip.attention_rope, triton=True
        )

    layer_step()  # the RoPE table grows once, as in a model's first layer
    ops = OpCounter(by_function=True)
    _counter.append(ops)
    with ops:
        layer_step()
    _counter.pop()
    launches = {k: v for k, v in ops.counts.items() if k.startswith("triton:")}
    stand_ins = sum(ops.counts[k] for k in ("randn", "rand", "zeros_like"))  # the stubs' own values
    return {
        "prune_mib": prune_mib or None,
        "layer": layer,
        "pruning_rope": hip.scoring_rope(layer),
        "operators": ops.total - stand_ins,
        "kernel_launches": launches,
        "syncs": ops.sync_total,
        "by_function": dict(ops.by_function.most_common()) if ops.by_function is not None else {},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a preset: its shapes")
    ap.add_argument("--context", default="16K", help="prompt tokens, one prefill chunk")
    ap.add_argument("--preset", default="lean", help="a HIP_PRESETS name")
    ap.add_argument("--prune-mib", default="0,1500", help="pruning batch bounds, MiB (0: the default)")
    ap.add_argument("--layers", default="2,10", help="layers (0-3: chunk-indexed scoring RoPE)")
    ap.add_argument("--name", default="prefill_prune_ops")
    args = ap.parse_args()
    if args.preset not in HIP_PRESETS:
        ap.error(f"--preset {args.preset!r}: use one of {', '.join(HIP_PRESETS)}")
    context = parse_count(args.context, "--context")
    undo = _stub()
    try:
        rows = [
            count(args.model, context, args.preset, int(mib), int(layer))
            for mib in args.prune_mib.split(",")
            for layer in args.layers.split(",")
        ]
    finally:
        undo()
    for row in rows:
        print(f"prune {row['prune_mib'] or 'default':>8} MiB  layer {row['layer']:>2} ({row['pruning_rope']})"
              f"  operators {row['operators']:>4}  launches {row['kernel_launches']}")  # fmt: skip
    path = write_results(args.name, {
        "model": args.model, "context": context, "preset": args.preset, "data": "random bf16",
        "note": "CPU count along the CUDA path with the Triton kernels stubbed (one launch each)",
        "rows": rows,
    })  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
