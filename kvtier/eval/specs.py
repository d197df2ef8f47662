"""`kvtier eval --method SPEC`: a method spec with engine overrides, from the method registry.

A spec is a placement or a registered method (`kvtier.methods`), optionally followed by
`key=value` overrides, or only overrides::

    gpu                      -> kv="gpu"
    head,head_group=1        -> kv="head", head_group=1
    kv=head,head_group=1     -> the same
    int4                     -> kv_quant="int4"
    quest,kv_budget=1k       -> attention="quest", kv_budget=1024
    snapkv,kv_budget=2k,kv_quant=int8
    auto,chunk_size=256      -> an engine option (a second load of the model when it differs)

Keys are `MethodChoice`'s fields (run on the one loaded model, per request) and the engine
options in `ENGINE_KEYS`. A new method is registered in `kvtier.methods`; nothing here changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvtier.errors import ConfigError
from kvtier.methods import MethodChoice, spec_names
from kvtier.methods.spec import key_parsers, name_example, name_kwargs, name_requires
from kvtier.units import parse_count

ENGINE_KEYS: dict[str, Callable[[str], Any]] = {
    "chunk_size": lambda s: parse_count(s, "chunk_size"),
    "block_size": int,
    "gpu_memory": str,
    "dtype": str,
}
"""Options of the loaded engine, not of a request: a spec that changes one loads the model again."""


def option_types() -> dict[str, Callable[[str], Any]]:
    """Every key a spec may carry, placement keys first, and how its value is read."""
    parsers = dict(key_parsers())
    first = {k: parsers.pop(k) for k in ("kv", "head_group")}
    return {**first, **ENGINE_KEYS, **parsers}


@dataclass(frozen=True)
class MethodSpec:
    """A parsed `--method`: its canonical label, the `LLM(...)` keyword arguments it stands for,
    and whether it is lossless."""

    label: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    lossless: bool = True

    def choice(self) -> MethodChoice:
        """The request-level part: what runs on a model already loaded."""
        return MethodChoice(**{k: v for k, v in self.kwargs.items() if k not in ENGINE_KEYS})

    def engine(self) -> dict[str, Any]:
        """The engine-level part (a different value needs another load)."""
        return {k: v for k, v in self.kwargs.items() if k in ENGINE_KEYS}


def parse_method(spec: str) -> MethodSpec:
    """Parse one `--method` value (ConfigError naming the valid methods or keys)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    names = spec_names()
    if not parts:
        raise ConfigError(f"empty --method; choose one of {', '.join(names)}")
    types = option_types()
    base: str | None = None
    if "=" not in parts[0]:
        base = _name(parts.pop(0))
    overrides: dict[str, Any] = {}
    for part in parts:
        key, eq, text = (s.strip() for s in part.partition("="))
        if not eq or not key or not text:
            raise ConfigError(f"--method {spec!r}: {part!r} is not key=value")
        if key not in types:
            raise ConfigError(f"--method {spec!r}: unknown key {key!r}; valid keys: {', '.join(types)}")
        if key in overrides:
            raise ConfigError(f"--method {spec!r}: {key!r} given twice")
        try:
            overrides[key] = types[key](text)
        except (ValueError, ConfigError):
            raise ConfigError(f"--method {spec!r}: {key}={text!r} is not a valid value") from None
    if base is None:
        if "kv" not in overrides:
            raise ConfigError(
                f"--method {spec!r}: name a method first or give kv=; methods: {', '.join(names)}"
            )
        base = _name(str(overrides.pop("kv")))
    missing = [k for k in name_requires(base) if k not in overrides]
    if missing:
        example = ",".join([base, *(f"{k}={name_example(base, k)}" for k in missing)])
        raise ConfigError(f"--method {base} needs {', '.join(missing)}; e.g. --method {example}")
    kwargs = {**name_kwargs(base), **overrides}
    spec_ = MethodSpec(
        ",".join([base, *(f"{k}={v}" for k, v in sorted(overrides.items()))]), MappingProxyType(kwargs)
    )
    lossless = spec_.choice().lossless  # also validates the combination before any model loads
    return MethodSpec(spec_.label, spec_.kwargs, lossless)


def parse_methods(specs: list[str] | None) -> tuple[MethodSpec, ...]:
    """All `--method` values (default: `auto`); a label given twice is an error."""
    methods = tuple(parse_method(s) for s in (specs or ["auto"]))
    labels = [m.label for m in methods]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ConfigError(f"--method {', '.join(dup)} given more than once")
    return methods


def _name(name: str) -> str:
    if name not in spec_names():
        raise ConfigError(f"unknown method {name!r}; choose one of {', '.join(spec_names())}")
    return name
