"""Device resolution: a plain "cuda" (or "auto" on a GPU machine) becomes an indexed device.

`torch.cuda.set_per_process_memory_fraction(fraction, torch.device("cuda"))` raises "Expected a
torch.device with a specified index", which crashed every `--gpu-memory` run on CUDA with the
default `--device auto`. These tests fake a CUDA machine, so they run on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.config import EngineConfig
from kvtier.errors import ConfigError


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


@pytest.mark.parametrize(("spec", "index"), [("auto", 1), ("cuda", 1), ("cuda:0", 0), ("cuda:1", 1)])
def test_cuda_devices_carry_an_index(two_gpus: None, spec: str, index: int) -> None:
    assert EngineConfig(device=spec).torch_device() == torch.device("cuda", index)


def test_a_gpu_the_machine_lacks_is_a_config_error(two_gpus: None) -> None:
    with pytest.raises(ConfigError, match=r"2 GPU\(s\), cuda:0\.\.1"):
        EngineConfig(device="cuda:2").torch_device()


def test_auto_without_cuda_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig(device="auto").torch_device() == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        EngineConfig(device="cuda").torch_device()


@pytest.mark.parametrize("spec", ["gpu", "meta", "tpu:0"])
def test_unsupported_devices_are_config_errors(spec: str) -> None:
    with pytest.raises(ConfigError, match="--device"):
        EngineConfig(device=spec).torch_device()
