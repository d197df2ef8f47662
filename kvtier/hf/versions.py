"""Which transformers versions `kvtier.hf` runs on, and the check made before it is used.

The hooks kvtier.hf relies on (a `Cache` of per-layer `CacheLayerMixin` objects with one
`update(k, v, layer_idx, ...)` entry point, the `AttentionInterface` / `AttentionMaskInterface`
registries, `model.set_attn_implementation`) have this shape from transformers 5.x on; the
versions below are the ones the tests ran on.
"""

from __future__ import annotations

from importlib import metadata

from packaging.version import InvalidVersion, Version

from kvtier.errors import KvtierError

MIN_VERSION = Version("5.17.0")
"""The oldest transformers kvtier.hf is tested with (the GPU machine's)."""

BELOW_VERSION = Version("6.0.0")
"""The first transformers release kvtier.hf refuses: a major release may change the Cache API."""

TESTED = ("5.17.0", "5.24.0")
"""Versions the CPU tests passed on (CI runs the newest on PyPI within the range)."""

SUPPORTED = f">={MIN_VERSION},<{BELOW_VERSION}"


class UnsupportedTransformersError(KvtierError):
    """The installed transformers is outside the versions kvtier.hf supports."""


def installed_version() -> str | None:
    """The installed transformers version, None when it is not installed."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def check_version(version: str | None) -> Version:
    """`version` parsed, or UnsupportedTransformersError naming the supported range."""
    fix = f'install one with `pip install "transformers{SUPPORTED}"` (tested: {", ".join(TESTED)})'
    if version is None:
        raise UnsupportedTransformersError(f"kvtier.hf needs Hugging Face transformers; {fix}")
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise UnsupportedTransformersError(
            f"cannot read the transformers version {version!r}; kvtier.hf supports {SUPPORTED}: {fix}"
        ) from None
    # NOTE: compared without dev/rc suffixes, so 6.0.0.dev0 is refused and 5.30.0rc1 accepted.
    release = Version(parsed.base_version)
    if not MIN_VERSION <= release < BELOW_VERSION:
        raise UnsupportedTransformersError(
            f"transformers {version} is installed, but kvtier.hf supports transformers{SUPPORTED}; {fix}"
        )
    return parsed
