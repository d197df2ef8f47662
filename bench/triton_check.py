"""GPU check of the Triton block-sparse attention kernel against the pure-torch reference.

Times `attend_block_reference` (gather + SDPA) against `attend_block_triton` on HiP-sized shapes
(512K-token cache, ~3.3K keys attended: 64 sinks + 2240 selected + 1024 window; G=1 KV head,
r=4 query heads per KV head, D=128, bf16): decode (1 query), one 64-query prefill block, and 16
prefill blocks (reference loop vs one batched launch), with and without rotary (streaming).
Checks the max abs error, prints a table last and writes $OUT/triton_check.json.

    python bench/triton_check.py [--seq 524288] [--iters 50]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cuda_ms, write_results
from kvtier.config import RopeConfig
from kvtier.model.rope import Rotary
from kvtier.sparse.block_sparse import attend_block_reference
from kvtier.sparse.rope_ext import RopeTable

SINK, SELECTED, WINDOW, BLOCK = 64, 2240, 1024, 64


def _prefix(last_query: int, gen: torch.Generator, dev: torch.device) -> tuple[torch.Tensor, int]:
    """Sinks + SELECTED sorted random positions below the window of a block ending at last_query."""
    w0 = max(SINK, last_query - BLOCK - WINDOW + 2)
    sel = torch.randperm(w0 - SINK, generator=gen)[:SELECTED] + SINK
    return torch.cat((torch.arange(SINK), sel.sort().values)).to(dev), w0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=512 * 1024, help="cache length S")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--groups", type=int, default=1, help="KV heads G")
    ap.add_argument("--ratio", type=int, default=4, help="query heads per KV head r")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("triton_check needs a CUDA GPU")

    import triton

    from kvtier.sparse.triton_attn import attend_block_triton, attend_blocks_triton

    dev, dtype = torch.device("cuda"), torch.bfloat16
    s, g, r, d = args.seq, args.groups, args.ratio, args.head_dim
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(s, 2, g, d, generator=gen).to(dev, dtype)
    q_all = torch.randn(BLOCK * 16, g * r, d, generator=gen).to(dev, dtype)
    rope = RopeTable(Rotary(RopeConfig(), d, device=dev))
    rows: list[dict[str, Any]] = []

    def case(name: str, ref: Callable[[], torch.Tensor], tri: Callable[[], torch.Tensor], keys: int) -> None:
        err = (ref().float() - tri().float()).abs().max().item()
        t_ref, t_tri = cuda_ms(ref, args.iters), cuda_ms(tri, args.iters)
        rows.append(
            {"case": name, "keys": keys, "torch_ms": t_ref, "triton_ms": t_tri, "speedup": t_ref / t_tri}
            | {"max_abs_err": err}
        )
        print(f"{name}: torch {t_ref:.3f} ms, triton {t_tri:.3f} ms, err {err:.2e}", flush=True)

    # decode: one query at the end of the cache
    q_pos = torch.tensor([s - 1], device=dev)
    prefix, w0 = _prefix(s - 1, gen, dev)
    q1 = q_all[:1]
    n_keys = prefix.numel() + s - w0
    for rot in (None, "streaming"):
        rt, mode = (rope, rot) if rot else (None, "absolute")
        case(
            f"decode{'+rope' if rot else ''}",
            lambda: attend_block_reference(q1, q_pos, kv, prefix, w0, rotary=rt, mode=mode),
            lambda: attend_block_triton(q1, q_pos, kv, prefix, w0, rotary=rt, mode=mode),
            n_keys,
        )

    # prefill: 64-query blocks ending at the end of the cache
    n_blocks = 16
    starts = [s - BLOCK * (n_blocks - i) for i in range(n_blocks)]
    blocks = []
    for st in starts:
        pos = torch.arange(st, st + BLOCK, device=dev)
        pre, bw0 = _prefix(st + BLOCK - 1, gen, dev)
        blocks.append((pos, pre, bw0))
    pos0, pre0, w00 = blocks[-1]
    qb = q_all[:BLOCK]
    for rot in (None, "streaming"):
        rt, mode = (rope, rot) if rot else (None, "absolute")
        case(
            f"prefill 1x64{'+rope' if rot else ''}",
            lambda: attend_block_reference(qb, pos0, kv, pre0, w00, rotary=rt, mode=mode),
            lambda: attend_block_triton(qb, pos0, kv, pre0, w00, rotary=rt, mode=mode),
            pre0.numel() + BLOCK + s - BLOCK - w00,
        )
    q_b = q_all.view(n_blocks, BLOCK, g * r, d)
    q_pos_b = torch.stack([b[0] for b in blocks])
    prefix_b = torch.stack([b[1] for b in blocks])
    w0_b = torch.tensor([b[2] for b in blocks], device=dev)

    def ref_loop() -> torch.Tensor:
        return torch.stack(
            [attend_block_reference(q_b[i], p, kv, pre, bw0) for i, (p, pre, bw0) in enumerate(blocks)]
        )

    def tri_loop() -> torch.Tensor:
        return torch.stack(
            [attend_block_triton(q_b[i], p, kv, pre, bw0) for i, (p, pre, bw0) in enumerate(blocks)]
        )

    keys16 = prefix_b.shape[1] + WINDOW + BLOCK - 1
    case("prefill 16x64 loop", ref_loop, tri_loop, keys16)
    case(
        "prefill 16x64 batched",
        ref_loop,
        lambda: attend_blocks_triton(q_b, q_pos_b, kv, prefix_b, w0_b),
        keys16,
    )

    shape = {"seq": s, "G": g, "r": r, "D": d, "dtype": "bf16", "sink": SINK, "selected": SELECTED}
    versions = {"torch": torch.__version__, "triton": triton.__version__}
    gpu = torch.cuda.get_device_name()
    path = write_results("triton_check", {"gpu": gpu, "versions": versions, "shape": shape, "rows": rows})
    print(f"\nwrote {path}")
    print(f"{gpu}, S={s} G={g} r={r} D={d} bf16, median of {args.iters}")
    print(f"{'case':<24}{'keys':>7}{'torch ms':>10}{'triton ms':>11}{'speedup':>9}{'max err':>10}")
    for row in rows:
        print(
            f"{row['case']:<24}{row['keys']:>7}{row['torch_ms']:>10.3f}{row['triton_ms']:>11.3f}"
            f"{row['speedup']:>8.1f}x{row['max_abs_err']:>10.1e}"
        )


if __name__ == "__main__":
    main()
