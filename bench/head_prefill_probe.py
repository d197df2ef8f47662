"""Where head-wise prefill loses time: attention of one prefill chunk per KV head vs per layer.

Times `kvtier.attention.dense.attend` for one 8K chunk over a 32K prefix (llama-3-8b shapes:
32 query heads, 8 KV heads, D 128, bf16) as one call over all 8 KV heads, as 8 calls of one
KV head, and as 8 calls of one head on copies laid out contiguously, then the same for the
split-free prefix-LSE path. Prints a table last and writes $OUT/head_prefill_probe.json.

    python bench/head_prefill_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, timed, write_results
from kvtier.attention.dense import attend

DEV = torch.device("cuda")


def time_it(fn: Any, reps: int = 5) -> float:
    fn()
    return median([timed(fn)[0] for _ in range(reps)])


def main() -> None:
    rows: list[dict[str, Any]] = []
    hq, hkv, d = 32, 8, 128
    for prefix, chunk in ((24576, 8192), (122880, 8192)):
        s = prefix + chunk
        q = torch.randn(chunk, hq, d, device=DEV, dtype=torch.bfloat16)
        kv = torch.randn(s, 2, hkv, d, device=DEV, dtype=torch.bfloat16)
        r = hq // hkv
        heads = [kv[:, :, h : h + 1].contiguous() for h in range(hkv)]
        qs = [q[:, h * r : (h + 1) * r].contiguous() for h in range(hkv)]
        t_layer = time_it(lambda: attend(q, kv))
        t_heads = time_it(lambda: [attend(qs[h], heads[h]) for h in range(hkv)])
        t_strided = time_it(
            lambda: [attend(q[:, h * r : (h + 1) * r], kv[:, :, h : h + 1]) for h in range(hkv)]
        )
        flops = 4 * chunk * d * hq * (prefix + chunk / 2)
        rows.append(
            {
                "prefix": prefix,
                "chunk": chunk,
                "layer_call_s": t_layer,
                "eight_head_calls_s": t_heads,
                "eight_strided_head_calls_s": t_strided,
                "layer_tflops": flops / t_layer / 1e12,
                "head_tflops": flops / t_heads / 1e12,
            }
        )
    path = write_results("head_prefill_probe", {"rows": rows})
    print(f"results: {path}")
    print(
        f"{'prefix':>8} {'layer ms':>9} {'8 heads ms':>10} {'strided ms':>10} {'layer TF':>9} {'head TF':>8}"
    )
    for r in rows:
        print(
            f"{r['prefix']:>8} {r['layer_call_s'] * 1e3:>9.2f} {r['eight_head_calls_s'] * 1e3:>10.2f} "
            f"{r['eight_strided_head_calls_s'] * 1e3:>10.2f} {r['layer_tflops']:>9.0f} "
            f"{r['head_tflops']:>8.0f}"
        )


if __name__ == "__main__":
    main()
