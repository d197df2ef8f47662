"""Fixtures shared by the test files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def embedded_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF converted to an HF folder, once per session.

    The conversion (~40 s on a CPU) is cached in `$KVTIER_CACHE_DIR` when set, so repeated test
    runs can skip it; otherwise in a fresh temp folder.
    """
    from kvtier.loading.embedded import embedded_gguf_path
    from kvtier.loading.gguf import gguf_to_hf_folder

    cache_dir = os.environ.get("KVTIER_CACHE_DIR") or tmp_path_factory.mktemp("kvtier-cache")
    return gguf_to_hf_folder(embedded_gguf_path(), cache_dir)


@pytest.fixture
def embedded(embedded_hf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The CLI's conversion cache pointed at the session's converted embedded model:
    `embedded_hf_dir` is `<cache root>/gguf/<stem>-<key>`, so the CLI finds it without converting."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(embedded_hf_dir.parents[1]))
    return embedded_hf_dir


@pytest.fixture(scope="module")
def gqa(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """A tiny random Llama with GQA (3 layers, 4 query heads, 2 KV heads, head dim 16), fp32."""
    import torch

    from kvtier.loading.weights import load_safetensors_folder
    from tests.hf_reference import make_hf_model

    folder: Path = tmp_path_factory.mktemp("gqa")
    make_hf_model("llama-gqa", folder)
    return load_safetensors_folder(folder, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GQA Llama as an HF folder (`tests.hf_reference`), one per test module."""
    from tests.hf_reference import make_hf_model

    folder = tmp_path_factory.mktemp("tiny")
    make_hf_model("llama-gqa", folder)
    return folder


@pytest.fixture(
    params=[
        "torch",
        pytest.param("native", marks=pytest.mark.skipif(shutil.which("c++") is None, reason="no c++")),
    ]
)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each CPU attention backend in turn, as the decoder every store of the test shares
    (`kvtier.kv.cpu_attend.shared_decoder`), with two threads."""
    import kvtier.kv.cpu_attend as cpu_attend
    from kvtier.attention.cpu_decode import CpuDecoder

    dec = CpuDecoder(2, backend=request.param)
    monkeypatch.setattr(cpu_attend, "shared_decoder", lambda: dec)
    return str(request.param)
