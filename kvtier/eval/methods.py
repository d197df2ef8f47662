"""KV methods to evaluate: a small registry from a name to keyword arguments of `LLM(...)`.

A `--method` spec is a registered name, optionally followed by `key=value` overrides, or only
overrides::

    gpu                      -> LLM(kv="gpu")
    head,head_group=1        -> LLM(kv="head", head_group=1)
    kv=head,head_group=1     -> the same
    int4                     -> LLM(kv="auto", kv_quant="int4")
    quest,kv_budget=1k       -> LLM(kv="auto", attention="quest", kv_budget=1024)
    snapkv,kv_budget=2k,kv_quant=int8

The lossless placements come first; the opt-in lossy methods of `kvtier.engine.methods` (HiP,
Quest, KV quantization, eviction, head sparsity) follow. A new one is one `register_method`
call; the parser and the runner need no change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvtier.errors import ConfigError
from kvtier.policies.evict import EVICT
from kvtier.policies.quant import KV_QUANT
from kvtier.units import parse_count


@dataclass(frozen=True)
class Method:
    """A named KV method: the `LLM(...)` keyword arguments it stands for."""

    name: str
    kwargs: Mapping[str, Any]
    lossless: bool = True
    help: str = ""
    requires: tuple[str, ...] = ()  # override keys a spec must give, e.g. kv_budget for quest


@dataclass(frozen=True)
class MethodSpec:
    """A parsed `--method`: its canonical label and the `LLM(...)` keyword arguments."""

    label: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    lossless: bool = True


METHODS: dict[str, Method] = {}
"""Registered methods by name; `register_method` adds one."""

OPTION_TYPES: dict[str, Callable[[str], Any]] = {
    "kv": str,
    "head_group": int,
    "chunk_size": int,
    "block_size": int,
    "gpu_memory": str,
    "dtype": str,
    "attention": str,
    "hip_preset": str,
    "kv_quant": str,
    "evict": str,
    "kv_budget": lambda s: parse_count(s, "kv_budget"),
    "head_sparsity": float,
}
"""The `key=value` overrides a spec may carry, and how each value is read."""


def register_method(method: Method, **option_types: Callable[[str], Any]) -> None:
    """Add `method` (and any new override keys it needs, with their parsers) to the registry."""
    METHODS[method.name] = Method(
        method.name, MappingProxyType(dict(method.kwargs)), method.lossless, method.help, method.requires
    )
    OPTION_TYPES.update(option_types)


for _name, _help in (
    ("auto", "kvtier's planner picks the placement (default)"),
    ("gpu", "whole KV cache on the GPU"),
    ("layer", "KV layer-wise offloaded to host memory"),
    ("head", "KV head-group-wise offloaded to host memory"),
):
    register_method(Method(_name, {"kv": _name}, lossless=True, help=_help))
register_method(
    Method("hip", {"attention": "hip"}, False, "InfiniteHiP-style sparse attention, extends context")
)
register_method(Method("quest", {"attention": "quest"}, False, "Quest page selection", ("kv_budget",)))
for _q in KV_QUANT:
    register_method(Method(_q, {"kv_quant": _q}, False, f"{_q} KV quantization"))
for _e in EVICT:
    register_method(Method(_e, {"evict": _e}, False, f"{_e} KV eviction", ("kv_budget",)))
register_method(Method("duo", {}, False, "DuoAttention-style streaming heads", ("head_sparsity",)))


_EXAMPLES = {"kv_budget": "1k", "head_sparsity": "0.5"}
_LOSSY_KEYS = ("attention", "hip_preset", "kv_quant", "evict", "kv_budget", "head_sparsity")


def parse_method(spec: str) -> MethodSpec:
    """Parse one `--method` value (ConfigError naming the valid methods or keys)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise ConfigError(f"empty --method; choose one of {', '.join(METHODS)}")
    base: Method | None = None
    if "=" not in parts[0]:
        base = _method(parts.pop(0))
    overrides: dict[str, Any] = {}
    for part in parts:
        key, eq, text = (s.strip() for s in part.partition("="))
        if not eq or not key or not text:
            raise ConfigError(f"--method {spec!r}: {part!r} is not key=value")
        if key not in OPTION_TYPES:
            raise ConfigError(
                f"--method {spec!r}: unknown key {key!r}; valid keys: {', '.join(OPTION_TYPES)}"
            )
        if key in overrides:
            raise ConfigError(f"--method {spec!r}: {key!r} given twice")
        try:
            overrides[key] = OPTION_TYPES[key](text)
        except ValueError:
            raise ConfigError(f"--method {spec!r}: {key}={text!r} is not a valid value") from None
    if base is None:
        if "kv" not in overrides:
            raise ConfigError(
                f"--method {spec!r}: name a method first or give kv=; methods: {', '.join(METHODS)}"
            )
        base = _method(str(overrides.pop("kv")))
    missing = [k for k in base.requires if k not in overrides]
    if missing:
        example = ",".join([base.name, *(f"{k}={_EXAMPLES.get(k, 'N')}" for k in missing)])
        raise ConfigError(f"--method {base.name} needs {', '.join(missing)}; e.g. --method {example}")
    kwargs = {**base.kwargs, **overrides}
    lossy = [k for k, v in overrides.items() if k in _LOSSY_KEYS and not (k == "attention" and v == "dense")]
    label = ",".join([base.name, *(f"{k}={v}" for k, v in sorted(overrides.items()))])
    return MethodSpec(label, MappingProxyType(kwargs), base.lossless and not lossy)


def parse_methods(specs: list[str] | None) -> tuple[MethodSpec, ...]:
    """All `--method` values (default: `auto`); a label given twice is an error."""
    methods = tuple(parse_method(s) for s in (specs or ["auto"]))
    labels = [m.label for m in methods]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ConfigError(f"--method {', '.join(dup)} given more than once")
    return methods


def _method(name: str) -> Method:
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]
