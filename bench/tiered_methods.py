"""The "+METHOD" of a `bench/tiered_store.py` policy spec (`head+int4`, `head+quest4096p16`,
`head+heads50`): the registry's `MethodChoice` it names, the KV fill its rows take, the store
keyword arguments it builds and the GPU bytes it keeps beside the store's plan."""

from __future__ import annotations

import re
from typing import Any

import torch

from kvtier.methods import MethodChoice, parse_choice, plan_for
from kvtier.planner.hardware import hardware_preset
from kvtier.planner.inputs import PlanInputs
from kvtier.policies.head_sparsity import HeadStreamingEvictor

DEV = torch.device("cuda")  # as bench/tiered_store.py's: it runs on CUDA only


def method_choice(method: str) -> MethodChoice:
    """A policy's "+METHOD" as a registry `MethodChoice` ('' = lossless): a kv_quant name
    (`int4`), `quest<budget>p<page>` or `heads<percent>`, short for the specs
    `quest,kv_budget=<budget>,quest_page=<page>` and `head_sparsity=<percent/100>`."""
    quest = re.fullmatch(r"quest(\d+)p(\d+)", method)
    heads = re.fullmatch(r"heads(\d+)", method)
    if quest:
        method = f"quest,kv_budget={quest[1]},quest_page={quest[2]}"
    elif heads:
        method = f"head_sparsity={int(heads[1]) / 100}"
    return parse_choice(method)


def kv_fill(kind: str, method: str) -> str:
    """The fill of a row: `--kv-fill`, with "auto" structured for Quest (its pages are chosen by
    the keys) and synthetic otherwise."""
    if kind != "auto":
        return kind
    return "structured" if method_choice(method).attention == "quest" else "synthetic"


def method_parts(cfg: Any, model: Any, method: str) -> dict[str, Any]:
    """Store keyword arguments of a lossy method ('' = lossless), built by the registry. With
    random weights head scores mean nothing: heads<N> classifies heads by seeded random scores
    (the same costs) instead of a calibration prefill."""
    choice = method_choice(method)
    if choice.head_sparsity is not None:
        scores = torch.rand(cfg.num_layers, cfg.num_kv_heads, generator=torch.Generator().manual_seed(0))
        return {"evictor": HeadStreamingEvictor(scores, choice.head_sparsity, sinks=64, recent=256)}
    return choice.build(cfg, DEV, model, head_cache=None).store_kwargs()


def method_reserve(cfg: Any, method: str, context: int, policy: str) -> int:
    """GPU bytes a named method keeps beside the store's plan (`Placement.reserve_bytes`: Quest's
    page bounds, HiP's caches), as `plan_for` counts them; 0 without a method. This bench plans
    the store itself (`plan_kv`, so a row can force a policy and chunk), so its predicted peak
    adds them here: Quest's 4.3 GB of bounds at 512K had been left out (-19% error)."""
    if not method:
        return 0
    h200 = hardware_preset("h200")
    inputs = PlanInputs(cfg, context, hardware=h200, dtype_bytes=2, gpu_budget=None, kv=policy)
    return plan_for(inputs, method_choice(method)).reserve_bytes
