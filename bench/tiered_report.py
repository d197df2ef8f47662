"""What `bench/tiered_store.py` reports at the end: each lossy row's decode speedup over the
lossless `head` row at its context, and the table of every row."""

from __future__ import annotations

from typing import Any


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """Set `decode_speedup_vs_head` on each "+METHOD" row that decoded, where a plain `head` row
    of its context did too."""
    lossless = {r["context"]: r.get("decode_s_per_token") for r in rows if r["policy"] == "head"}
    for r in rows:
        base = lossless.get(r["context"])
        if base and r.get("decode_s_per_token") and "+" in r["policy"]:
            r["decode_speedup_vs_head"] = base / r["decode_s_per_token"]


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per row: peak and planned GPU GB, prefill tokens/s, decode s/token, its PCIe
    floor and ratio, H2D GB/token (and the speedup over `head`); skipped and OOM rows say why."""
    print(
        f"{'context':>8} {'policy':>13} {'peak GB':>8} {'plan GB':>8} {'prefill t/s':>11} "
        f"{'decode s/t':>10} {'floor s':>8} {'x floor':>7} {'H2D GB/t':>8}"
    )
    for r in rows:
        if "skipped" in r or "oom" in r:
            print(
                f"{r['context']:>8} {r['policy']:>13}   "
                f"{('skipped: ' + r.get('skipped', r.get('oom', '')))[:90]}"
            )
            continue
        print(
            f"{r['context']:>8} {r['policy']:>13} {r.get('peak_gpu_bytes', 0) / 1e9:>8.2f} "
            f"{r.get('predicted_gpu_bytes', 0) / 1e9:>8.2f} {r.get('prefill_tok_s', 0):>11.0f} "
            f"{r.get('decode_s_per_token', 0):>10.4f} {r.get('pcie_floor_s', 0) or 0:>8.4f} "
            f"{(r.get('decode_vs_floor') or 0):>7.2f} {r.get('h2d_bytes_per_token', 0) / 1e9:>8.2f}"
            + (f"  {r['decode_speedup_vs_head']:.2f}x vs head" if "decode_speedup_vs_head" in r else "")
        )
