"""`--kv-quant int8|int4|fp8`: KV stored packed in both tiers (`kvtier.policies.quant`).

A codec method is the codec plus this entry: the planner sizes the packed cache from `codec`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.kv.hooks import KVCodec
from kvtier.methods.registry import BuildContext, MethodEntry, register
from kvtier.policies import PolicyParts
from kvtier.policies.quant import Fp8Codec, KiviCodec


def codec_entry(name: str, make: Callable[[], KVCodec], help: str) -> MethodEntry:
    """The registry entry of a KV codec (`make` returns a fresh codec)."""

    def build(_: BuildContext) -> PolicyParts:
        return PolicyParts(codec=make(), describe=f"kv-quant {name}")

    return MethodEntry(name, "kv_quant", help, build, codec=make, borrows_pages=True)


INT8 = register(codec_entry("int8", lambda: KiviCodec(bits=8), "KIVI-style 8-bit integer KV"))
INT4 = register(codec_entry("int4", lambda: KiviCodec(bits=4), "KIVI-style 4-bit integer KV"))
FP8 = register(codec_entry("fp8", Fp8Codec, "FP8 E4M3 KV"))
