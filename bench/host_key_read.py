"""How fast can a decode refresh read only the keys of a host-tier slice? (issue 19)

HiP's stage 0 reruns every `refresh[0]` decode steps over every key of a streamed slice, and the
store streams the whole slice for it: keys and values, token-major `[S, 2, G, D]`. At 512K that
is ~69 GB a refresh (Llama-3.1-8B shapes, 1.25 s at 55 GB/s) where the scores need the keys
alone, and the values only of the rows then selected. This times the pieces of a keys-only
refresh on one slice, to decide whether to build it:

- `dma_kv`: the copy the store makes today (the whole slice, one DMA), the baseline;
- `dma_k_strided`: torch's copy of the key half (`host[:, 0]`: strided, so a host-side copy first);
- `zero_copy_k`: a Triton kernel that reads the key rows from pinned host memory (UVA) into a
  contiguous GPU buffer;
- `zero_copy_scores`: the same reads, scored in place (each key against its KV head's R query
  heads, max over them): no GPU copy of the keys at all;
- `zero_copy_gather`: the K/V rows of `--gather-blocks` random blocks of `--block` tokens (what a
  refresh would then fetch for its selection and block cache).

    python bench/host_key_read.py --tokens 512K --heads 8 --name host_key_read

Synthetic data (random bf16). `--check` compares every kernel with torch on small slices first
(on the CPU with TRITON_INTERPRET=1 and `--device cpu`). Results: $OUT/<name>.json (else
bench/results/).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton
import triton.language as tl

from bench.common import cuda_ms, write_results
from kvtier.units import parse_count


@triton.jit
def _copy_keys(src, dst, n, ROW: tl.constexpr, BT: tl.constexpr):  # type: ignore[no-untyped-def]
    """dst[t] = src[t, 0] for tokens t of this program: src [n, 2, ROW] (ROW = G * D), dst [n, ROW]."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.arange(0, ROW)
    mask = (t < n)[:, None]
    rows = tl.load(src + t[:, None].to(tl.int64) * (2 * ROW) + c[None, :], mask=mask)
    tl.store(dst + t[:, None].to(tl.int64) * ROW + c[None, :], rows, mask=mask)


@triton.jit
def _score_keys(src, q, out, n, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, BT: tl.constexpr):  # type: ignore[no-untyped-def]
    """out[t, g] = max_r q[g, r] . src[t, 0, g]: src [n, 2, G, D], q [G, R, D] fp32, out [n, G] fp32."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.arange(0, D)
    mask = (t < n)[:, None]
    for g in tl.static_range(G):
        k = tl.load(src + t[:, None].to(tl.int64) * (2 * G * D) + g * D + d[None, :], mask=mask).to(
            tl.float32
        )
        best = tl.full((BT,), float("-inf"), tl.float32)
        for r in tl.static_range(R):
            qr = tl.load(q + (g * R + r) * D + d)
            best = tl.maximum(best, tl.sum(k * qr[None, :], axis=1))
        tl.store(out + t.to(tl.int64) * G + g, best, mask=t < n)


@triton.jit
def _gather_blocks(src, blocks, dst, BLOCK: tl.constexpr, ROW2: tl.constexpr):  # type: ignore[no-untyped-def]
    """dst[i] = src[blocks[i] * BLOCK : (blocks[i] + 1) * BLOCK]: src [n, ROW2], dst [k, BLOCK, ROW2]."""
    i = tl.program_id(0)
    b = tl.load(blocks + i).to(tl.int64)
    t = tl.arange(0, BLOCK)
    c = tl.arange(0, ROW2)
    rows = tl.load(src + (b * BLOCK + t[:, None]) * ROW2 + c[None, :])
    tl.store(dst + (i * BLOCK + t[:, None]).to(tl.int64) * ROW2 + c[None, :], rows)


def copy_keys(host: torch.Tensor, dst: torch.Tensor, bt: int = 16) -> None:
    n, _, g, d = host.shape
    _copy_keys[(triton.cdiv(n, bt),)](host, dst, n, ROW=g * d, BT=bt)


def score_keys(host: torch.Tensor, q: torch.Tensor, out: torch.Tensor, bt: int = 32) -> None:
    n, _, g, d = host.shape
    _score_keys[(triton.cdiv(n, bt),)](host, q, out, n, G=g, R=q.shape[1], D=d, BT=bt)


def gather_blocks(host: torch.Tensor, blocks: torch.Tensor, dst: torch.Tensor, block: int) -> None:
    _, two, g, d = host.shape
    _gather_blocks[(blocks.shape[0],)](host, blocks, dst, BLOCK=block, ROW2=two * g * d)


def check(device: torch.device) -> None:
    """Every kernel against torch on a small slice (pinned host memory when on CUDA)."""
    gen = torch.Generator().manual_seed(0)
    n, g, r, d, block = 1008, 4, 4, 64, 16  # 63 blocks; copies and scores end mid-program
    host = torch.randn(n, 2, g, d, generator=gen).to(torch.bfloat16)
    if device.type == "cuda":
        host = host.pin_memory()
    q = torch.randn(g, r, d, generator=gen).to(device)
    keys = torch.empty(n, g, d, dtype=host.dtype, device=device)
    copy_keys(host, keys)
    assert torch.equal(keys.cpu(), host[:, 0]), "copy_keys"
    scores = torch.empty(n, g, device=device)
    score_keys(host, q, scores)
    want = torch.einsum("ngd,grd->ngr", host[:, 0].float(), q.cpu()).amax(dim=2)
    assert torch.allclose(scores.cpu(), want, atol=1e-3, rtol=1e-4), "score_keys"
    blocks = torch.tensor([3, 0, 41, 7], device=device)
    got = torch.empty(4, block, 2, g, d, dtype=host.dtype, device=device)
    gather_blocks(host, blocks, got, block)
    want_rows = host.view(-1, block, 2, g, d)[blocks.cpu()]
    assert torch.equal(got.cpu(), want_rows), "gather_blocks"


def run(
    tokens: int, heads: int, head_dim: int, r: int, block: int, gather: int, reps: int
) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    host = torch.empty(tokens, 2, heads, head_dim, dtype=torch.bfloat16).pin_memory()
    host.view(-1)[::4096].normal_()  # touch the pages; the values do not matter
    kv = torch.empty(host.shape, dtype=host.dtype, device=dev)
    keys = torch.empty(tokens, heads, head_dim, dtype=host.dtype, device=dev)
    q = torch.randn(heads, r, head_dim, device=dev)
    scores = torch.empty(tokens, heads, device=dev)
    blocks = torch.randperm(tokens // block, device=dev)[:gather].sort().values
    rows = torch.empty(gather, block, 2, heads, head_dim, dtype=host.dtype, device=dev)
    kv_bytes = host.numel() * host.element_size()
    cases: dict[str, tuple[Callable[[], object], int]] = {
        "dma_kv": (lambda: kv.copy_(host, non_blocking=True), kv_bytes),
        "dma_k_strided": (lambda: keys.copy_(host[:, 0], non_blocking=True), kv_bytes // 2),
        "zero_copy_k": (lambda: copy_keys(host, keys), kv_bytes // 2),
        "zero_copy_scores": (lambda: score_keys(host, q, scores), kv_bytes // 2),
        "zero_copy_gather": (lambda: gather_blocks(host, blocks, rows, block), rows.numel() * 2),
    }
    out: list[dict[str, Any]] = []
    for name, (fn, nbytes) in cases.items():
        ms = cuda_ms(fn, reps, warmup=1)
        out.append(
            {"case": name, "ms": round(ms, 3), "bytes": nbytes, "gb_per_s": round(nbytes / ms / 1e6, 2)}
        )
        print(f"{name:18s} {ms:9.3f} ms  {nbytes / 1e9:7.3f} GB  {nbytes / ms / 1e6:7.2f} GB/s", flush=True)
    base = out[0]["ms"]
    for row in out:
        row["vs_dma_kv"] = round(base / row["ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="512K", help="tokens of the slice (default 512K)")
    ap.add_argument(
        "--heads", type=int, default=8, help="KV heads of the slice (default 8: a Llama-3.1-8B layer)"
    )
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--q-per-kv", type=int, default=4, help="query heads per KV head (default 4)")
    ap.add_argument("--block", type=int, default=64, help="tokens per gathered block (default 64)")
    ap.add_argument(
        "--gather-blocks", type=int, default=256, help="blocks gathered (default 256: 16K tokens)"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check", action="store_true", help="check the kernels against torch first")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for --check alone (TRITON_INTERPRET=1)")
    ap.add_argument("--name", default="host_key_read")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.check:
        check(dev)
        print("check: every kernel equals torch", flush=True)
    if dev.type != "cuda":
        return
    tokens = parse_count(args.tokens)
    rows = run(tokens, args.heads, args.head_dim, args.q_per_kv, args.block, args.gather_blocks, args.reps)
    config = {"tokens": tokens, "heads": args.heads, "head_dim": args.head_dim, "q_per_kv": args.q_per_kv,
              "block": args.block, "gather_blocks": args.gather_blocks, "reps": args.reps}  # fmt: skip
    path = write_results(args.name, {"config": config, "data": "synthetic (random bf16)", "rows": rows})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
