"""Do HiP's and Quest's selections find planted needles in structured KV? (issue 19)

Fills a store with `kvtier.kv.structured.fill_structured` (keys with a low-rank structure, no
repetition, `--needles` needles per (layer, KV head) between 10% and 90% depth), once per
`--scenarios` entry (needle length, strength, halo), then asks each method to select keys for
the needle queries of a decode step at the end of the context, slice by slice, and reports the
fraction of needle tokens each keeps:

- HiP (`kvtier.sparse.pruning.run_stages`, what `HipKernel` runs on a decode step that
  recomputes stage 0): per preset, recall after each pruning stage and of the final selection
  (sinks + final stage + window). With `extend` (every preset) keys are scored un-rotated with
  HiP's extension RoPE; "hip-scaled" is `HipConfig.scaled(tokens)` (the 3K preset's ratios).
- Quest (`QuestKernel`'s page bounds and top pages, at `--quest-budget` tokens, 16-token pages,
  first 2 layers dense) over keys rotated at their true positions.
- dense: the needle queries' attention mass on the needles, and an oracle: the needle tokens
  among the `--quest-budget` keys of highest attention score.

A needle is "found" when at least half its tokens are kept. The store keeps un-rotated keys
(HiP's layout); methods that need rotated keys get them rotated at their true positions, the
same values as a rotated fill (tests/test_structured_kv.py). Results: $OUT/hip_recall.json.

    .venv/bin/python bench/hip_recall.py                          # CPU: 64K tokens, ~40 s on 2 cores
    python bench/hip_recall.py --device cuda --model llama-3-8b --layers 0 --tokens 512K
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.attention.interface import SliceStep
from kvtier.kv.store import TieredKVStore
from kvtier.kv.structured import Needles, fill_structured
from kvtier.loading.presets import preset_config
from kvtier.model.rope import Rotary
from kvtier.planner.placement import KVPlan
from kvtier.policies.quest import QuestKernel
from kvtier.sparse import HIP_PRESETS, HipConfig
from kvtier.sparse.pruning import run_stages
from kvtier.sparse.rope_ext import RopeTable
from kvtier.units import parse_count

QUEST_PAGE = 16


@dataclass
class Tally:
    """Needle tokens one method keeps, by layer (mutable, filled slice by slice)."""

    kept: dict[int, list[int]] = field(default_factory=dict)  # layer -> per stage, then final
    found: dict[int, int] = field(default_factory=dict)  # layer -> needles with >= half kept
    total: dict[int, int] = field(default_factory=dict)  # layer -> needle tokens
    needles: dict[int, int] = field(default_factory=dict)  # layer -> needles
    mass: list[float] = field(default_factory=list)  # dense only: attention mass on the needles
    seconds: float = 0.0

    def add(self, layer: int, sets: list[torch.Tensor], needles: Needles, head: int) -> None:
        """`sets`: positions kept by each stage, the final selection last (any order)."""
        pos = needles.positions(layer, head)
        kept = [torch.isin(pos, s.cpu()) for s in sets]
        row = self.kept.setdefault(layer, [0] * len(sets))
        for i, k in enumerate(kept):
            row[i] += int(k.sum())
        per_needle = kept[-1].view(-1, needles.length).float().mean(1)  # [N]
        self.found[layer] = self.found.get(layer, 0) + int((per_needle >= 0.5).sum())
        self.total[layer] = self.total.get(layer, 0) + pos.numel()
        self.needles[layer] = self.needles.get(layer, 0) + per_needle.numel()

    def summary(self) -> dict[str, Any]:
        layers = sorted(self.kept)
        last = len(self.kept[layers[0]]) - 1

        def recall(i: int, which: list[int]) -> float:
            total = sum(self.total[layer] for layer in which)
            return sum(self.kept[layer][i] for layer in which) / total if total else float("nan")

        return {
            "token_recall": recall(last, layers),
            "needles_found": sum(self.found.values()) / sum(self.needles.values()),
            "stage_recall": [recall(i, layers) for i in range(last)],
            "recall_layers_0_3": recall(last, [layer for layer in layers if layer < 4]),
            "recall_layers_4_up": recall(last, [layer for layer in layers if layer >= 4]),
            "per_layer": [round(self.kept[layer][last] / self.total[layer], 4) for layer in layers],
            "needle_tokens": sum(self.total.values()),
            "dense_mass": sum(self.mass) / len(self.mass) if self.mass else None,
            "seconds": round(self.seconds, 3),
        }


def hip_select(
    hip: HipConfig, table: RopeTable, q: torch.Tensor, keys: torch.Tensor, layer: int, start: int
) -> list[list[torch.Tensor]]:
    """A decode query's selection at position `start` over keys [start, G, D] (HiP's first
    decode step): per KV head of the slice, each stage's kept positions and the final set."""
    g = keys.shape[1]
    w0 = max(hip.sink, start - hip.window + 1)
    cand = torch.arange(hip.sink, w0, device=keys.device)
    pos = torch.full((1,), start, dtype=torch.long, device=keys.device)
    dev = keys.device
    fixed = torch.cat((torch.arange(min(hip.sink, start), device=dev), torch.arange(w0, start, device=dev)))

    def stages(qh: torch.Tensor, kh: torch.Tensor) -> list[torch.Tensor]:
        outs = run_stages(
            qh,
            pos,
            kh,
            cand,
            chunk_sizes=hip.chunk_sizes,
            budgets=hip.stage_budgets(layer),
            strides=hip.query_strides,
            mode=hip.scoring_rope(layer),
            rotary=table if hip.extend else None,
            window=hip.window,
            head_score=hip.head_score,
            span=hip.sink,
        )
        return [*outs, torch.cat((fixed, outs[-1]))]

    if not hip.per_head:
        return [stages(q, keys)] * g
    r = q.shape[1] // g
    return [stages(q[:, h * r : (h + 1) * r], keys[:, h : h + 1]) for h in range(g)]


def quest_select(
    quest: QuestKernel, q: torch.Tensor, kv: torch.Tensor, layer: int, group: int, start: int
) -> list[torch.Tensor]:
    """Quest's decode selection at position `start` over rotated kv [start, 2, G, D]: per KV
    head, the tokens of its pages (all tokens in dense layers or a context within budget).

    NOTE: uses QuestKernel's page bounds and top-page choice (`_minmax`, `_top_pages`): the
    selection its decode step reads, which the kernel does not expose."""
    g, p = kv.shape[2], quest.page
    step = SliceStep(layer, group, start)
    sparse, pages, top_k = quest._sparse(step, start + 1)
    if not sparse:
        return [torch.arange(start)] * g
    lo, hi = quest._minmax(kv, step)
    m = start // p
    top = quest._top_pages(q, lo[:m], hi[:m], pages, top_k)  # [G, r, K]
    tokens = torch.arange(p, device=kv.device)
    return [(top[h, 0][:, None] * p + tokens).flatten() for h in range(g)]


def measure(
    store: TieredKVStore,
    needles: Needles,
    hips: dict[str, HipConfig],
    quest: QuestKernel,
    budget: int,
    group: int,
) -> dict[str, Tally]:
    """Every method's selection for the needle queries of every slice of a filled store (keys
    stored un-rotated), tallied per method."""
    lay, tokens, dev = store.layout, store.length, store.device
    rotary = store.rotary
    table = RopeTable(rotary)
    tallies = {name: Tally() for name in hips}
    tallies["quest"] = Tally()
    tallies["dense-oracle"] = Tally()
    cos, sin = rotary.cos_sin(torch.arange(tokens, device=dev), lay.dtype)
    for layer in range(lay.num_layers):
        q_raw = needles.query(layer, lay.q_per_kv).to(dev, lay.dtype)  # [1, H_q, D] pre-RoPE
        q_rot = needles.query(layer, lay.q_per_kv, rotary).to(dev, lay.dtype)
        for g in range(lay.num_groups):
            kv = store.resident[lay.slice_index(layer, g)][:tokens]  # [T, 2, G, D]
            heads, qs = range(g * group, (g + 1) * group), lay.q_heads(g)
            for name, hip in hips.items():
                t = time.perf_counter()
                q = q_raw[:, qs] if hip.extend else q_rot[:, qs]
                sel = hip_select(hip, table, q, kv[:, 0], layer, tokens)
                tallies[name].seconds += time.perf_counter() - t
                for j, h in enumerate(heads):
                    tallies[name].add(layer, sel[j], needles, h)
            rot = torch.stack((Rotary.apply(kv[:, 0], cos, sin), kv[:, 1]), dim=1)  # [T, 2, G, D]
            t = time.perf_counter()
            sel_q = quest_select(quest, q_rot[:, qs], rot, layer, g, tokens)
            tallies["quest"].seconds += time.perf_counter() - t
            for j, h in enumerate(heads):
                tallies["quest"].add(layer, [sel_q[j]], needles, h)
                score = rot[:, 0, j].float() @ q_rot[0, qs][j * lay.q_per_kv].float()  # [T]
                probs = torch.softmax(score / lay.head_dim**0.5, dim=0)
                oracle = tallies["dense-oracle"]
                oracle.mass.append(float(probs[needles.positions(layer, h).to(dev)].sum()))
                oracle.add(layer, [score.topk(budget).indices], needles, h)
        quest.clear()  # NOTE: this layer's page bounds are not read again
    return tallies


def scenario(text: str) -> tuple[int | None, float, float]:
    """'needle_tokens:strength:halo' (needle_tokens 'block': a whole store block)."""
    tokens, strength, halo = text.split(":")
    return None if tokens == "block" else int(tokens), float(strength), float(halo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a preset of kvtier.loading.presets")
    ap.add_argument("--layers", type=int, default=8, help="first N layers of the model (0: all)")
    ap.add_argument("--tokens", default="64K")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--group", type=int, default=1, help="KV heads per slice (HiP selects per slice)")
    ap.add_argument("--hip", default="default,5k,long,scaled", help="HiP presets, and 'scaled'")
    ap.add_argument("--quest-budget", type=int, default=None, help="tokens (default: hip-default's)")
    ap.add_argument("--needles", type=int, default=4, help="needles per (layer, KV head)")
    ap.add_argument(
        "--scenarios",
        default="block:0.5:0,16:0.5:0,16:0.5:32,16:0.15:32",
        help="fills, each needle_tokens:strength:halo (see fill_structured)",
    )
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="hip_recall")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = preset_config(args.model)
    if args.layers:
        cfg = replace(cfg, num_layers=min(args.layers, cfg.num_layers))
    tokens = parse_count(args.tokens, "--tokens")
    hips = {
        f"hip-{n}": HipConfig.scaled(tokens) if n == "scaled" else HIP_PRESETS[n] for n in args.hip.split(",")
    }
    default = HIP_PRESETS["default"]
    budget = args.quest_budget or default.sink + default.budgets[-1] + default.window
    kept = {name: h.sink + h.budgets[-1] + h.window for name, h in hips.items()}  # outside wide_layers
    kept.update({"quest": budget, "dense-oracle": budget})
    plan = KVPlan("gpu", args.group, cfg.num_layers * cfg.num_kv_heads // args.group, 2048, 0, 0)
    print(f"{args.model} x {cfg.num_layers} layers, {tokens} tokens, {args.needles} needles per KV head")
    runs = []
    for needle_tokens, strength, halo in map(scenario, args.scenarios.split(",")):
        store = TieredKVStore(cfg, plan, device=dev, dtype=dtype, capacity=tokens, rotate_keys=False)
        t = time.perf_counter()
        needles = fill_structured(
            store,
            tokens,
            args.seed,
            needles=args.needles,
            rank=args.rank,
            needle_tokens=needle_tokens,
            strength=strength,
            halo=halo,
        )
        if dev.type == "cuda":
            torch.cuda.synchronize()
        fill_s = time.perf_counter() - t
        kv_bytes = sum(b.numel() * b.element_size() for b in store.resident.values())
        with torch.inference_mode():
            tallies = measure(store, needles, hips, QuestKernel(budget, page=QUEST_PAGE), budget, args.group)
        store.close()
        rows = {name: tally.summary() for name, tally in tallies.items()}
        mass = rows["dense-oracle"]["dense_mass"]
        runs.append(
            {
                "needle_tokens": needles.length,
                "strength": strength,
                "halo": halo,
                "fill_seconds": round(fill_s, 3),
                "fill_gb_per_s": round(kv_bytes / fill_s / 1e9, 3),
                "methods": rows,
            }
        )
        print(
            f"\nneedles of {needles.length} tokens, strength {strength}, halo {halo}: dense attention mass "
            f"on them {mass:.3f} (fill: {kv_bytes / 1e9:.2f} GB in {fill_s:.1f} s)"
        )
        head = f"{'method':<13} {'keys kept':>9} {'tokens':>7} {'needles':>7} {'L0-3':>6} {'L4+':>6}  stages"
        print(head + "\n" + "-" * len(head))
        for name, row in rows.items():
            print(
                f"{name:<13} {kept[name]:>9} {row['token_recall']:>7.3f} {row['needles_found']:>7.3f} "
                f"{row['recall_layers_0_3']:>6.3f} {row['recall_layers_4_up']:>6.3f}  "
                + " ".join(f"{x:.2f}" for x in row["stage_recall"])
            )
    results = {
        "model": args.model,
        "layers": cfg.num_layers,
        "tokens": tokens,
        "device": str(dev),
        "dtype": str(dtype),
        "group": args.group,
        "needles_per_head": args.needles,
        "rank": args.rank,
        "seed": args.seed,
        "hip_configs": {
            name: {
                k: getattr(h, k)
                for k in ("sink", "window", "chunk_sizes", "budgets", "wide_budget", "head_score")
            }
            for name, h in hips.items()
        },
        "keys_kept": kept,
        "runs": runs,
    }
    print(f"wrote {write_results(args.name, results)}")


if __name__ == "__main__":
    main()
