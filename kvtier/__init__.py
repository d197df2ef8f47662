"""kvtier: long-context inference with a tiered (GPU / host) KV cache.

>>> from kvtier import LLM, SamplingParams
>>> LLM().generate("Hello", SamplingParams(max_tokens=8))[0].text

`kvtier.hf.TieredCache` runs a Hugging Face transformers model over the same store
(`model.generate(..., past_key_values=cache)`); `kvtier.hf` is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtier.errors import KvtierError

if TYPE_CHECKING:
    from kvtier.engine.llm import LLM
    from kvtier.engine.outputs import GenerationStats, RequestOutput
    from kvtier.engine.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "GenerationStats", "KvtierError", "RequestOutput", "SamplingParams", "__version__"]

_LAZY = {
    "LLM": "kvtier.engine.llm",
    "GenerationStats": "kvtier.engine.outputs",
    "RequestOutput": "kvtier.engine.outputs",
    "SamplingParams": "kvtier.engine.sampling",
}


def __getattr__(name: str) -> Any:
    """The engine's classes and the `hf` subpackage, imported on first use.

    NOTE: lazy so that `import kvtier` does not import torch: the `kvtier` script imports this
    package before `main` runs, and a Ctrl-C during torch's import would escape main's handler.
    """
    if name == "hf":
        return importlib.import_module("kvtier.hf")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
