"""Prefill attention on CUDA: PyTorch's flash kernel (one lower-right causal call) against
cuDNN's (prefix and chunk as two calls merged by log-sum-exp, `kvtier.attention.cudnn_split`).

For llama-3-8b's heads (32 query, 8 KV; and one KV head with its 4 query heads, as head-wise
offload calls it), an 8K chunk after prefixes of 0, 24K and 120K tokens: time of each path,
TFLOP/s, and the largest difference between them relative to the output's scale; a small case
is also checked against a float64 reference. Prints a table last, writes
$OUT/attn_backends.json, and exits 0 only if cuDNN is within bf16 rounding and faster in total
(so a script can pick `KVTIER_ATTN_BACKEND` from it):

    python bench/attn_backends.py && export KVTIER_ATTN_BACKEND=cudnn
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, timed, write_results
from kvtier.attention import cudnn_split, dense

DEV = torch.device("cuda")


def flash(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    qt = q.transpose(0, 1).unsqueeze(0)
    k = kv[:, 0].transpose(0, 1).unsqueeze(0)
    v = kv[:, 1].transpose(0, 1).unsqueeze(0)
    return torch.ops.aten._scaled_dot_product_flash_attention(qt, k, v, 0.0, True)[0][0].transpose(0, 1)


def reference(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    t, hq, d = q.shape
    s, _, hkv, _ = kv.shape
    k = kv[:, 0].double().repeat_interleave(hq // hkv, 1).transpose(0, 1)
    v = kv[:, 1].double().repeat_interleave(hq // hkv, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(-1, -2) / d**0.5
    keep = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    return (scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v).transpose(0, 1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def time_it(fn: Any, reps: int = 5) -> float:
    fn()
    return median([timed(fn)[0] for _ in range(reps)])


def main() -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    ok = True
    q = torch.randn(256, 8, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    kv = torch.randn(1024, 2, 2, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    ref = reference(q, kv)
    exact = {
        "flash_vs_fp64": rel_err(flash(q, kv), ref),
        "cudnn_vs_fp64": rel_err(cudnn_split.attend_split(q, kv), ref),
    }
    ok &= exact["cudnn_vs_fp64"] <= 2 * exact["flash_vs_fp64"] + 1e-2
    rows: list[dict[str, Any]] = []
    total = {"flash": 0.0, "cudnn": 0.0}
    for hq, hkv in ((32, 8), (4, 1)):
        for prefix in (0, 24576, 122880):
            chunk = 8192
            q = torch.randn(chunk, hq, 128, device=DEV, dtype=torch.bfloat16, generator=g)
            kv = torch.randn(prefix + chunk, 2, hkv, 128, device=DEV, dtype=torch.bfloat16, generator=g)
            t_f = time_it(lambda q=q, kv=kv: flash(q, kv))
            t_c = time_it(lambda q=q, kv=kv: cudnn_split.attend_split(q, kv))
            err = rel_err(cudnn_split.attend_split(q, kv), flash(q, kv))
            flops = 4 * chunk * 128 * hq * (prefix + chunk / 2)
            rows.append(
                {
                    "q_heads": hq,
                    "kv_heads": hkv,
                    "prefix": prefix,
                    "chunk": chunk,
                    "flash_s": t_f,
                    "cudnn_s": t_c,
                    "flash_tflops": flops / t_f / 1e12,
                    "cudnn_tflops": flops / t_c / 1e12,
                    "rel_diff": err,
                }
            )
            total["flash"] += t_f
            total["cudnn"] += t_c
            ok &= err <= 2e-2
    ok &= total["cudnn"] < total["flash"]
    path = write_results(
        "attn_backends", {"exact": exact, "rows": rows, "total_s": total, "cudnn_chosen": bool(ok)}
    )
    print(f"results: {path}")
    print(f"small case vs fp64: flash {exact['flash_vs_fp64']:.2e}, cudnn {exact['cudnn_vs_fp64']:.2e}")
    print(
        f"{'Hq/Hkv':>7} {'prefix':>7} {'flash ms':>9} {'cudnn ms':>9} "
        f"{'flash TF':>9} {'cudnn TF':>9} {'rel diff':>9}"
    )
    for r in rows:
        print(
            f"{r['q_heads']:>3}/{r['kv_heads']:<3} {r['prefix']:>7} {r['flash_s'] * 1e3:>9.2f} "
            f"{r['cudnn_s'] * 1e3:>9.2f} {r['flash_tflops']:>9.0f} {r['cudnn_tflops']:>9.0f} "
            f"{r['rel_diff']:>9.1e}"
        )
    print("cudnn chosen" if ok else "flash kept")
    assert dense.ATTN_BACKEND in ("flash", "cudnn")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
