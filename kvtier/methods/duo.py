"""`--head-sparsity R [--kv-budget N]`: DuoAttention-style streaming heads
(`kvtier.policies.head_sparsity`). The fraction R of KV heads that score lowest on a calibration
prompt keep sinks + recent tokens; the rest keep every token."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from kvtier.errors import ConfigError
from kvtier.methods.registry import BuildContext, MethodEntry, Option, Placement, PlanWith, register
from kvtier.planner.compact import CompactSlices
from kvtier.planner.inputs import PlanInputs
from kvtier.policies import PolicyParts
from kvtier.policies.head_sparsity import HeadStreamingEvictor, head_scores
from kvtier.units import parse_finite_float

DUO_SINKS, DUO_RECENT = 64, 256  # DuoAttention's streaming heads at evaluation


def _ratio(text: str) -> float:
    return parse_finite_float(text, "--head-sparsity", 0.0, 1.0, lo_open=True, hi_open=True)


def _kept(options: Mapping[str, Any]) -> int:
    """Tokens a streaming head keeps: the sinks and the recent window (`--kv-budget` in all)."""
    budget = options.get("kv_budget")
    return DUO_SINKS + DUO_RECENT if budget is None else int(budget)


def _plan(inputs: PlanInputs, options: Mapping[str, Any], _: PlanWith) -> Placement:
    """The streaming heads' slices stay on the GPU holding their sinks and recent tokens (plus a
    step's); only the retrieval heads' slices are placed, so the host tier holds just theirs."""
    compact = CompactSlices(float(options["head_sparsity"]), _kept(options))
    return Placement(replace(inputs, compact=compact).plan())


def _build(ctx: BuildContext) -> PolicyParts:
    ratio, budget = float(ctx.options["head_sparsity"]), ctx.options.get("kv_budget")
    if ctx.model is None:
        raise ConfigError("--head-sparsity classifies heads on a calibration prompt: pass the model")
    if budget is not None and budget <= DUO_SINKS:
        raise ConfigError(
            f"--kv-budget {budget} with --head-sparsity must exceed the {DUO_SINKS} sink tokens"
        )
    recent = DUO_RECENT if budget is None else int(budget) - DUO_SINKS
    evictor = HeadStreamingEvictor(
        head_scores(ctx.model, cache_dir=ctx.head_cache),
        ratio,
        DUO_SINKS,
        recent,
        strict_budget=budget is not None,
    )
    return PolicyParts(evictor=evictor, describe=f"head-sparsity {ratio:g}")


DUO = register(
    MethodEntry(
        "duo",
        "head_sparsity",
        "DuoAttention-style streaming heads: --head-sparsity R of the KV heads keep 64 sinks + recent",
        _build,
        takes=("head_sparsity", "kv_budget"),
        requires=("head_sparsity",),
        examples={"head_sparsity": "0.5"},
        plan=_plan,
        borrows_pages=True,  # its compact and whole resident slices and staging (`region_buffers`)
        exact_at=lambda options, _, context: context <= _kept(options),  # streaming heads keep all
    ),
    Option("head_sparsity", "--head-sparsity", _ratio, "fraction of KV heads that become streaming heads"),
)
