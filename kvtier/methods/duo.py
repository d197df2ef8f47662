"""`--head-sparsity R [--kv-budget N]`: DuoAttention-style streaming heads
(`kvtier.policies.head_sparsity`). The fraction R of KV heads that score lowest on a calibration
prompt keep sinks + recent tokens; the rest keep every token."""

from __future__ import annotations

from kvtier.errors import ConfigError
from kvtier.methods.registry import BuildContext, MethodEntry, Option, register
from kvtier.policies import PolicyParts
from kvtier.policies.head_sparsity import HeadStreamingEvictor, head_scores
from kvtier.units import parse_finite_float

DUO_SINKS, DUO_RECENT = 64, 256  # DuoAttention's streaming heads at evaluation


def _ratio(text: str) -> float:
    return parse_finite_float(text, "--head-sparsity", 0.0, 1.0, lo_open=True, hi_open=True)


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
    ),
    Option("head_sparsity", "--head-sparsity", _ratio, "fraction of KV heads that become streaming heads"),
)
