"""Bad files and paths given to `kvtier`: `plan --model` with a GGUF file, or a file or folder
that is no model; output paths that cannot be written; and tokenizer files that must load
without a warning. Errors are exit code 2 and one stderr line `kvtier: error: ...`, with no
traceback and no model loaded (`LLM` is replaced by a test failure).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.cli.main import main
from tests.cli_helpers import PLAN, CapSys, expect_error, refuse_model_loads


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case here must fail before a model loads."""
    refuse_model_loads(monkeypatch)


# -- plan --model: GGUF files and files that are no model -------------------------------------


def test_plan_reads_a_gguf_file(embedded: Path, capsys: CapSys) -> None:
    from kvtier.loading.embedded import embedded_gguf_path

    argv = ["plan", "--model", str(embedded_gguf_path()), "--context", "64K", "--gpu-memory", "4GiB"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommended"]["num_slices"] == 30  # SmolLM2-135M: 30 layers x 3 KV heads, one group
    assert doc["recommended"]["resident_slices"] == 30


def test_gguf_config_from_metadata_matches_the_conversion(embedded: Path, tmp_path: Path) -> None:
    """Without a cached conversion the config comes from the GGUF's metadata: the same config."""
    from kvtier.config import ModelConfig
    from kvtier.loading.embedded import embedded_gguf_path
    from kvtier.loading.gguf import gguf_cache_folder, gguf_model_config

    empty_cache = tmp_path / "cache"
    assert not gguf_cache_folder(embedded_gguf_path(), empty_cache).exists()
    from_metadata = gguf_model_config(embedded_gguf_path(), empty_cache)
    assert from_metadata == ModelConfig.from_json(embedded / "config.json")
    assert not (empty_cache / "gguf").exists()  # nothing converted


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (bytes(range(256)) * 4, "is not a config.json (not UTF-8 JSON) nor a .gguf file"),
        (b"model: llama\n", "is not a config.json (not UTF-8 JSON) nor a .gguf file"),
        (b"[1, 2]", "holds JSON but not an object"),
    ],
)
def test_plan_model_file_that_is_no_config(
    content: bytes, message: str, tmp_path: Path, capsys: CapSys
) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(content)
    expect_error(capsys, ["plan", "--model", str(path)], f"--model {path}", message)


def test_plan_model_folder_with_a_binary_config_json(tmp_path: Path, capsys: CapSys) -> None:
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    expect_error(capsys, ["plan", "--model", str(tmp_path)], "config.json", "as JSON")


# -- output paths -----------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_eval_output_that_is_a_folder(flag: str, tmp_path: Path, capsys: CapSys) -> None:
    expect_error(capsys, ["eval", "passkey", flag, str(tmp_path)], f"{flag} {tmp_path} is a folder")


def test_plan_plot_in_a_path_whose_parent_is_a_file(tmp_path: Path, capsys: CapSys) -> None:
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "m.png"
    expect_error(capsys, [*PLAN, "--plot", str(target)], "--plot", "is not a folder")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_eval_output_in_a_read_only_folder(tmp_path: Path, capsys: CapSys) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        expect_error(capsys, ["eval", "passkey", "--out", str(folder / "r.json")], "is not writable")
    finally:
        folder.chmod(0o755)


# -- tokenizer loading is quiet ---------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_log() -> Iterator[_Records]:
    """transformers' log records (its logger does not propagate to the root logger), with its
    warn-once memory cleared so a warning seen earlier in the session shows again."""
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()
    handler = _Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        hf_logging.warning_once.cache_clear()


@pytest.mark.parametrize("clean_up", [None, True])
def test_tokenizer_load_and_decode_do_not_warn_about_clean_up(
    clean_up: bool | None, embedded: Path, tmp_path: Path, transformers_log: _Records
) -> None:
    """The embedded model's tokenizer, as converted (None) and as an older transformers saved it
    (clean_up_tokenization_spaces true): no "Ignoring clean_up_tokenization_spaces" line."""
    from kvtier.loading.resolve import _load_tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(embedded / "tokenizer.json", folder)
    config = json.loads((embedded / "tokenizer_config.json").read_text())
    if clean_up is not None:
        config["clean_up_tokenization_spaces"] = clean_up
    (folder / "tokenizer_config.json").write_text(json.dumps(config))

    tokenizer = _load_tokenizer(folder)
    text = "Hello , world ! It's 3 p.m ."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert not [m for m in transformers_log.messages if "clean_up_tokenization_spaces" in m]
    if clean_up and hasattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    ):
        # The capture works: with the flag back on, this transformers does warn (and ignores it).
        tokenizer.clean_up_tokenization_spaces = True
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
        assert [m for m in transformers_log.messages if "Ignoring clean_up_tokenization_spaces" in m]
