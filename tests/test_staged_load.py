"""KVTIER_LOAD=staged (`kvtier.loading.staged`): a shard read in windows and copied into the
parameters gives exactly the parameters `safe_open` gives, across window edges, dtype
conversions and tensors the model does not take; bad files are refused by name."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import kvtier.loading.staged as staged
from kvtier.errors import ConfigError, ModelLoadError
from kvtier.loading.staged import load_mode, read_header, read_shard_staged
from kvtier.loading.weights import load_safetensors_folder


def test_the_load_setting_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_LOAD", raising=False)
    assert load_mode() == "safetensors"
    monkeypatch.setenv("KVTIER_LOAD", " Staged ")
    assert load_mode() == "staged"
    monkeypatch.setenv("KVTIER_LOAD", "mmap")
    with pytest.raises(ConfigError, match=r"KVTIER_LOAD='mmap': use safetensors \(the default\) or staged"):
        load_mode()


@pytest.mark.parametrize("window", [7, 1000, 1 << 20])
def test_windows_of_any_size_give_the_tensors_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(33, 17, generator=gen).to(torch.bfloat16),
        "skipped": torch.randn(50, generator=gen),
        "b": torch.randn(5, 3, generator=gen),  # float32 in the file, bfloat16 in the model
        "c": torch.arange(11, dtype=torch.int64),
        "d": torch.randn(400, generator=gen).to(torch.float16),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    params = {
        "a": torch.nn.Parameter(torch.zeros(33, 17, dtype=torch.bfloat16), requires_grad=False),
        "b": torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.bfloat16), requires_grad=False),
        "c": torch.nn.Parameter(torch.zeros(11, dtype=torch.int64), requires_grad=False),
        "d": torch.nn.Parameter(torch.zeros(400, dtype=torch.float16), requires_grad=False),
    }
    monkeypatch.setattr(staged, "WINDOW_BYTES", window)
    read: list[int] = []
    seen = read_shard_staged(path, params, read.append)
    assert seen == {"a", "b", "c", "d"}
    for name in seen:
        assert torch.equal(params[name], tensors[name].to(params[name].dtype)), name
    assert sum(read) == sum(t.numel() * t.element_size() for n, t in tensors.items() if n != "skipped")


def test_a_folder_loads_the_same_model_either_way(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_LOAD", raising=False)
    ref, _ = load_safetensors_folder(tiny, torch.device("cpu"), torch.float32)
    monkeypatch.setenv("KVTIER_LOAD", "staged")
    monkeypatch.setattr(staged, "WINDOW_BYTES", 4096)
    got, _ = load_safetensors_folder(tiny, torch.device("cpu"), torch.float32)
    want = dict(ref.named_parameters())
    for name, p in got.named_parameters():
        assert torch.equal(p, want[name]), name


def test_a_shape_the_config_does_not_imply_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(4, 3)}, str(path))
    params = {"a": torch.nn.Parameter(torch.zeros(3, 4), requires_grad=False)}
    with pytest.raises(ModelLoadError, match=r"a has shape \(4, 3\), the config implies \(3, 4\)"):
        read_shard_staged(path, params, lambda _: None)


def test_broken_files_are_refused_with_what_is_wrong(tmp_path: Path) -> None:
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(ModelLoadError, match="too short for a safetensors header"):
        read_header(short)
    claims = tmp_path / "claims.safetensors"
    claims.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ModelLoadError, match="its header claims"):
        read_header(claims)
    entry = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    cut = tmp_path / "cut.safetensors"
    head = json.dumps(entry).encode()
    cut.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 8)  # 8 of its 16 bytes
    with pytest.raises(ModelLoadError, match="tensor a's header entry does not fit"):
        read_header(cut)
