"""Method specs as text, `NAME[,key=value...]` (eval's `--method`, `LLM.generate(method=...)`).

    head,head_group=1        -> MethodChoice(kv="head", head_group=1)
    int4                     -> MethodChoice(kv_quant="int4")
    quest,kv_budget=1k       -> MethodChoice(attention="quest", kv_budget=1024)
    kv=layer,evict=h2o,kv_budget=512

A name is a placement (`kvtier.planner.placement.POLICIES`) or a registered method; keys are
`MethodChoice`'s fields. Both lists come from the registry, so a new method needs nothing here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from kvtier.errors import ConfigError
from kvtier.methods.choice import MethodChoice
from kvtier.methods.registry import FAMILIES, OPTIONS, REGISTRY
from kvtier.planner.placement import POLICIES
from kvtier.units import parse_int

PLACEMENT_HELP = {
    "auto": "kvtier's planner picks the placement (default)",
    "gpu": "whole KV cache on the GPU",
    "layer": "KV layer-wise offloaded to host memory",
    "head": "KV head-group-wise offloaded to host memory",
}


def spec_names() -> tuple[str, ...]:
    """Every name a spec may start with: the placements, then the registered methods."""
    return ("auto", *(p for p in POLICIES if p != "auto"), *REGISTRY)


def name_help(name: str) -> str:
    return PLACEMENT_HELP[name] if name in POLICIES else REGISTRY[name].help


def name_kwargs(name: str) -> dict[str, Any]:
    """The `MethodChoice` fields a name stands for (`head` -> kv=head, `int4` -> kv_quant=int4)."""
    if name in POLICIES:
        return {"kv": name}
    entry = REGISTRY[name]
    return {} if entry.family == "head_sparsity" else {entry.family: name}


def name_requires(name: str) -> tuple[str, ...]:
    return () if name in POLICIES else REGISTRY[name].requires


def name_example(name: str, key: str) -> str:
    return "N" if name in POLICIES else REGISTRY[name].examples.get(key, "N")


def key_parsers() -> Mapping[str, Callable[[str], Any]]:
    """How each `MethodChoice` field is read from text."""
    parsers: dict[str, Callable[[str], Any]] = {
        "kv": str,
        "head_group": lambda s: parse_int(s, "head_group", 1),
        **{f: str for f in FAMILIES if f not in OPTIONS},
        **{k: o.parse for k, o in OPTIONS.items()},
    }
    known = {f.name for f in fields(MethodChoice)}
    return {k: v for k, v in parsers.items() if k in known}


def parse_choice(text: str) -> MethodChoice:
    """A spec as a `MethodChoice` (ConfigError naming the valid names or keys)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    kwargs: dict[str, Any] = {}
    if parts and "=" not in parts[0]:
        name = parts.pop(0)
        if name not in spec_names():
            raise ConfigError(f"unknown method {name!r}; choose one of {', '.join(spec_names())}")
        kwargs.update(name_kwargs(name))
    parsers = key_parsers()
    for part in parts:
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or key not in parsers:
            raise ConfigError(f"method {text!r}: {part!r} is not one of {', '.join(parsers)} = value")
        kwargs[key] = parsers[key](value)
    return MethodChoice(**kwargs)


def method_spec(choice: MethodChoice) -> str:
    """`choice` as a spec of its non-default fields, `key=value` in field order
    (`attention=hip,hip_preset=lean`); "auto" for the default choice."""
    default = MethodChoice()
    parts = []
    for f in fields(MethodChoice):
        value = getattr(choice, f.name)
        if value != getattr(default, f.name):
            shown = {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value
            parts.append(f"{f.name}={shown}")
    return ",".join(parts) or "auto"
