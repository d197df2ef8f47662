"""What a served request's store keeps on the GPU with and without borrowed pool pages, per method.

`kvtier.serve.store_plan.plan_store` plans a request that names a method (or is too long for the
page pool) within the GPU memory the server leaves for stores of their own (`--offload-reserve`)
plus the pool pages it may borrow now; the buffers `region_buffers` lists are carved from those
pages. This prints, for each method and server GPU budget, the plan with an offer of pages and
the plan over the reserve alone: pages lent, resident slices, GPU KV bytes. Planner arithmetic
only (no model, no GPU): Llama-3-8B shapes, bf16, 16-token pages, the H200's rates.

    python bench/serve_lend_plans.py --context 256K --budgets 17,17.5,19,21 --offer 661

Writes $OUT/serve_lend_plans.json (else bench/results/).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import CapacityError
from kvtier.loading.presets import preset_config
from kvtier.methods import parse_choice
from kvtier.methods.plan import LOSSLESS
from kvtier.planner.hardware import hardware_preset
from kvtier.planner.inputs import PlanInputs
from kvtier.serve.store_plan import plan_store
from kvtier.units import parse_count

CFG = preset_config("llama-3-8b")
PAGE_TOKENS = 16
PAGE_BYTES = PAGE_TOKENS * CFG.kv_bytes_per_token(2)  # a page holds its tokens of every layer
METHODS = ";".join(
    (
        "auto",
        "int4",
        "int8",
        "h2o,kv_budget=2048",
        "snapkv,kv_budget=2048",
        "duo,head_sparsity=0.5",
        "hip",
        "quest,kv_budget=2048",
    )
)


@dataclass
class Server:
    """What `plan_store` asks of the serving engine (`kvtier.serve.store_plan.OffloadHost`): a GPU
    budget for stores of their own and `offer` pool pages lendable; records what it lends."""

    budget: int
    offer: int
    lent: list[int] = field(default_factory=list)
    wider: int | None = None  # pages lendable without the batch's keep (None: `offer`)
    paged: bool = True
    pool_tokens: int = 2_647 * PAGE_TOKENS
    device: torch.device = field(default_factory=lambda: torch.device("cuda"))

    def __post_init__(self) -> None:
        hardware = hardware_preset("h200")

        def plan_inputs(context: int, method: object, new_tokens: int | None = None) -> PlanInputs:
            return PlanInputs(
                CFG, context, hardware=hardware, dtype_bytes=2, gpu_budget=self.budget, new_tokens=new_tokens
            )

        self.llm = SimpleNamespace(
            model_config=CFG,
            config=SimpleNamespace(block_size=256),
            dtype=torch.bfloat16,
            method=LOSSLESS,
            plan_inputs=plan_inputs,
        )

    @property
    def page_bytes(self) -> int:
        return PAGE_BYTES

    def offload_gpu_budget(self) -> int:
        return self.budget

    def lendable_pages(self, keep_batch: bool = True) -> int:
        return self.offer if keep_batch or self.wider is None else self.wider

    def lend(self, count: int) -> int:
        self.lent.append(count)
        return 1


def planned(server: Server, seq: Any) -> dict[str, Any]:
    """The plan's resident slices and GPU KV, or why it fits nowhere."""
    try:
        plan, _, first = plan_store(server, seq)  # type: ignore[arg-type]
    except CapacityError as e:
        return {"fits": False, "error": str(e)}
    return {
        "fits": True,
        "lent_pages": server.lent[0] if first is not None else 0,
        "resident_slices": plan.resident_slices,
        "num_slices": plan.num_slices,
        "streamed_slices": plan.streamed_slices,
        "chunk_size": plan.chunk_size,
        "gpu_kv_gb": round(plan.gpu_kv_bytes / 1e9, 3),
    }


def _short(r: dict[str, Any]) -> str:
    if not r["fits"]:
        return "fits nowhere"
    return f"{r['lent_pages']:>3} lent {r['resident_slices']:>3} res {r['gpu_kv_gb']:6.2f} GB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="256K", help="prompt tokens, comma list (16 more are generated)")
    ap.add_argument("--budgets", default="17,17.5,19,21", help="server GPU budgets in GB (1e9), comma list")
    ap.add_argument("--offer", type=int, default=661, help="pool pages a run may borrow (661: 1.39 GB)")
    ap.add_argument("--methods", default=METHODS, help="';'-separated method specs")
    ap.add_argument(
        "--kept",
        action="store_true",
        help="the batch's keep holds the whole pool (an 8B model's under 24 GiB): the offer is "
        "only lent to a request that fits nowhere else",
    )
    ap.add_argument("--name", default="serve_lend_plans")
    args = ap.parse_args()
    prompts = [parse_count(c, "--context") for c in args.context.split(",")]
    rows = []
    for prompt in prompts:
        for spec in args.methods.split(";"):
            for gb in (float(x) for x in args.budgets.split(",")):
                seq = SimpleNamespace(
                    prompt=[1] * prompt, params=SamplingParams(max_tokens=16), method=parse_choice(spec)
                )
                budget = int(gb * 1e9)
                offered = Server(budget, 0, wider=args.offer) if args.kept else Server(budget, args.offer)
                row = {
                    "context": prompt,
                    "method": spec,
                    "budget_gb": gb,
                    "with_pages": planned(offered, seq),
                    "reserve_alone": planned(Server(budget, 0), seq),
                }
                rows.append(row)
                w, a = _short(row["with_pages"]), _short(row["reserve_alone"])
                print(f"{prompt:>8} {spec:<26} {gb:5.2f} GB  pages: {w:<31}  alone: {a}", flush=True)
    path = write_results(
        args.name,
        {
            "note": "planner arithmetic (kvtier.serve.store_plan.plan_store), no model or GPU; Llama-3-8B "
            "shapes, bf16, 16-token pages, H200 rates; 16 new tokens",
            "code": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip(),
            "command": "bench/serve_lend_plans.py " + " ".join(sys.argv[1:]),
            "contexts": prompts,
            "offer_pages": args.offer,
            "offer_only_past_the_keep": args.kept,
            "page_bytes": PAGE_BYTES,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
