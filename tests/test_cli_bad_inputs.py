"""Bad input to every `kvtier` subcommand: exit code 2, one stderr line `kvtier: error: ...`, no
traceback, and no model loaded (`LLM` is replaced by a test failure for the error cases).

The table holds inputs a user found failing with a traceback, or late, or silently misread.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main as cli_main
from kvtier.cli.main import build_parser, main
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError

CapSys = pytest.CaptureFixture[str]


def run_cli(argv: list[str]) -> int:
    """main(argv)'s exit code; argparse's own usage errors exit through SystemExit."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def expect_error(capsys: CapSys, argv: list[str], *fragments: str) -> str:
    """Exit code 2, nothing on stdout, one stderr line `kvtier: error: ...` holding `fragments`."""
    rc = run_cli(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvtier: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case here must fail before a model loads."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was loaded: the error should have come before")

    for module in ("generate_cmd", "serve_cmd"):
        monkeypatch.setattr(f"kvtier.cli.{module}.LLM", refuse)


@pytest.fixture
def embedded(embedded_hf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The CLI's conversion cache pointed at the session's converted embedded model."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(embedded_hf_dir.parents[1]))
    return embedded_hf_dir


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


HUGE = "9" * 400  # float() of it is inf
GEN = ["generate", "--prompt", "hi"]
PLAN = ["plan", "--model", "llama-3-8b"]
SEED_RANGE = "--seed must be in 0..18446744073709551615"

BAD_INPUTS: list[tuple[list[str], list[str]]] = [
    # seeds: 0 <= seed < 2**64 wherever --seed exists (was: ValueError: Overflow)
    ([*GEN, "--temperature", "0.7", "--seed", "99999999999999999999999"], [SEED_RANGE]),
    ([*GEN, "--seed", str(2**64)], [SEED_RANGE]),
    ([*GEN, "--seed", "-1"], [SEED_RANGE]),
    ([*GEN, "--seed", "one"], ["--seed: cannot read 'one' as an integer"]),
    (["eval", "passkey", "--seed", str(2**64)], [SEED_RANGE]),
    (["serve", "--seed", "-5"], [SEED_RANGE]),
    # floats are finite and in range (nan failed after loading, inf was accepted)
    ([*GEN, "--temperature", "nan"], ["--temperature must be a finite number, got 'nan'"]),
    ([*GEN, "--temperature", "inf"], ["--temperature must be a finite number, got 'inf'"]),
    ([*GEN, "--temperature", "1e999"], ["--temperature must be a finite number"]),
    ([*GEN, "--temperature", "-0.5"], ["--temperature must be >= 0, got -0.5"]),
    ([*GEN, "--temperature", "warm"], ["--temperature: cannot read 'warm' as a number"]),
    ([*GEN, "--top-p", "nan"], ["--top-p must be a finite number"]),
    ([*GEN, "--top-p", "0"], ["--top-p must be in (0, 1], got 0"]),
    ([*GEN, "--top-p", "1.5"], ["--top-p must be in (0, 1]"]),
    ([*GEN, "--top-k", "-1"], ["--top-k must be at least 0, got -1"]),
    ([*GEN, "--head-sparsity", "nan"], ["--head-sparsity must be a finite number"]),
    ([*GEN, "--head-sparsity", "2"], ["--head-sparsity must be in (0, 1), got 2"]),
    ([*GEN, "--head-sparsity", "0"], ["--head-sparsity must be in (0, 1), got 0"]),
    ([*GEN, "--max-new-tokens", "0"], ["--max-new-tokens must be at least 1, got 0"]),
    ([*GEN, "--max-new-tokens", "lots"], ["--max-new-tokens: cannot read 'lots'"]),
    ([*GEN, "--head-group", "x"], ["--head-group: cannot read 'x' as an integer"]),
    ([*PLAN, "--tflops", "nan"], ["--tflops must be a finite number, got 'nan'"]),
    ([*PLAN, "--tflops", "inf"], ["--tflops must be a finite number, got 'inf'"]),
    ([*PLAN, "--tflops", "0"], ["--tflops must be > 0, got 0"]),
    ([*PLAN, "--head-sparsity", "inf"], ["--head-sparsity must be a finite number"]),
    ([*PLAN, "--head-sparsity", "1"], ["--head-sparsity must be in (0, 1), got 1"]),
    ([*PLAN, "--hip-host-keys", "on"], ["--hip-host-keys applies only with --attention hip"]),
    ([*PLAN, "--hip-probes", "on"], ["--hip-probes applies only with --attention hip"]),
    ([*PLAN, "--attention", "hip", "--hip-host-keys", "yes"], ["--hip-host-keys takes on, off or auto"]),
    # sizes and counts: the same rules in every subcommand; too large for a float is no size
    ([*GEN, "--gpu-memory", "0"], ["--gpu-memory must be at least 1 byte, got '0'"]),
    ([*GEN, "--gpu-memory", "abc"], ["--gpu-memory: cannot read 'abc' as a size"]),
    ([*GEN, "--gpu-memory", HUGE + "GB"], ["--gpu-memory: cannot read"]),
    ([*PLAN, "--gpu-memory", "0"], ["--gpu-memory must be at least 1 byte, got '0'"]),
    ([*PLAN, "--gpu-memory", "abc"], ["--gpu-memory: cannot read 'abc' as a size"]),
    (["eval", "passkey", "--gpu-memory", "abc"], ["--gpu-memory: cannot read 'abc' as a size"]),
    (["serve", "--gpu-memory", "0"], ["--gpu-memory must be at least 1 byte, got '0'"]),
    (["serve", "--gpu-memory", "abc"], ["--gpu-memory: cannot read 'abc' as a size"]),
    ([*PLAN, "--hbm-bw", "0"], ["--hbm-bw must be at least 1 byte"]),
    ([*PLAN, "--context", HUGE], ["--context: cannot read"]),
    ([*PLAN, "--block-size", "0"], ["--block-size must be at least 1, got 0"]),
    (["eval", "passkey", "--samples", "0"], ["--samples must be at least 1, got 0"]),
    # the planner's message names the flag of the command: --head-group (plan: --group-size too)
    ([*PLAN, "--head-group", "3"], ["--head-group 3 must divide the model's 8 KV heads"]),
    ([*PLAN, "--group-size", "3"], ["--head-group 3 must divide the model's 8 KV heads"]),
    # no abbreviations: `--kv` was read as --kv-quant
    ([*PLAN, "--kv-q", "int4"], ["unrecognized arguments: --kv-q int4"]),
    ([*PLAN, "--gpu-mem", "24GB"], ["unrecognized arguments: --gpu-mem"]),
    ([*GEN, "--max-new", "3"], ["unrecognized arguments: --max-new"]),
    (["eval", "passkey", "--sampl", "2"], ["unrecognized arguments: --sampl"]),
    (["serve", "--max-num", "2"], ["unrecognized arguments: --max-num"]),
    # serve: checked at parse time
    (["serve", "--api-key", ""], ["--api-key is empty"]),
    (["serve", "--cpu-attention", "auto"], ["--cpu-attention is for kvtier generate"]),
    (["serve", "--api-key", " key"], ["--api-key must be printable ASCII"]),
    (["serve", "--max-body-bytes", "0"], ["--max-body-bytes must be at least 1, got 0"]),
    (["serve", "--max-prompt-tokens", "0"], ["--max-prompt-tokens must be at least 1, got 0"]),
    (["serve", "--max-num-seqs", "0"], ["--max-num-seqs must be at least 1, got 0"]),
    (["serve", "--decode-steps", "0"], ["--decode-steps must be at least 1, got 0"]),
    (["serve", "--tiered-share", "1.5"], ["--tiered-share must be in [0, 1], got 1.5"]),
    (["serve", "--tiered-share", "nan"], ["--tiered-share must be a finite number"]),
    (["serve", "--tiered-keep-tokens", "-1"], ["--tiered-keep-tokens must be at least 0, got -1"]),
    (["serve", "--max-num-batched-tokens", "0"], ["--max-num-batched-tokens must be at least 1, got 0"]),
    (["serve", "--page-size", "0"], ["--page-size must be at least 1, got 0"]),
    (["serve", "--num-pages", "0"], ["--num-pages must be at least 1, got 0"]),
    (["serve", "--num-pages", "10000000000"], ["--num-pages must be at most 2147483647, got 10000000000"]),
    (["serve", "--num-host-pages", "-1"], ["--num-host-pages must be at least 0, got -1"]),
    (["serve", "--threads", "0"], ["--threads must be at least 1, got 0"]),
    (["serve", "--port", "0"], ["--port must be in 1..65535, got 0"]),
    (["serve", "--port", "70000"], ["--port must be in 1..65535, got 70000"]),
    # output paths are checked before any work
    ([*PLAN, "--plot", "/nonexistent-kvtier/m.png"], ["--plot", "/nonexistent-kvtier does not exist"]),
    (["eval", "passkey", "--out", "/nonexistent-kvtier/r.json"], ["--out", "does not exist"]),
    (["eval", "passkey", "--plot", "/nonexistent-kvtier/p.png"], ["--plot", "does not exist"]),
    # argv that is not UTF-8 arrives with surrogate escapes
    (["generate", "--prompt", "caf\udce9"], ["--prompt is not valid UTF-8 (byte 0xe9 at offset 3)"]),
    ([*GEN, "--stop", "\udcff"], ["--stop is not valid UTF-8 (byte 0xff at offset 0)"]),
    ([*GEN, "--stop", ""], ["--stop must not be empty"]),
    (["serve", "--served-model-name", "m\udcff"], ["--served-model-name is not valid UTF-8"]),
]


@pytest.mark.parametrize(
    ("argv", "fragments"), BAD_INPUTS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD_INPUTS]
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], fragments: list[str], capsys: CapSys) -> None:
    expect_error(capsys, argv, *fragments)


def test_every_parser_refuses_abbreviations() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert not parser.allow_abbrev
    assert set(subparsers.choices) == {"generate", "plan", "eval", "serve"}
    assert all(not p.allow_abbrev for p in subparsers.choices.values())


# -- prompts that are not UTF-8 ---------------------------------------------------------------


def test_prompt_file_that_is_not_utf8(tmp_path: Path, capsys: CapSys) -> None:
    path = tmp_path / "x.txt"
    path.write_bytes(b"abc\xffdef")
    expect_error(
        capsys,
        ["generate", "--prompt-file", str(path)],
        f"--prompt-file {path} is not valid UTF-8 (byte 0xff at offset 3)",
    )


def test_prompt_on_stdin_that_is_not_utf8(monkeypatch: pytest.MonkeyPatch, capsys: CapSys) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("héllo".encode("latin-1"))))
    expect_error(
        capsys,
        ["generate", "--prompt-file", "-"],
        "the prompt on stdin (--prompt-file -) is not valid UTF-8 (byte 0xe9 at offset 1)",
    )


def test_argv_bytes_that_are_not_utf8() -> None:
    """The real path: the OS hands Python bytes, which arrive as surrogate escapes."""
    env = {**os.environ, "LC_ALL": "C.UTF-8", "PYTHONUTF8": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier", "generate", "--prompt", b"caf\xe9 au lait"],
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err.splitlines() == ["kvtier: error: --prompt is not valid UTF-8 (byte 0xe9 at offset 3)"]


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


# -- checks against the model's config, before its weights load -------------------------------


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_head_group_that_does_not_divide_the_kv_heads(
    command: str, embedded: Path, free_port: int, capsys: CapSys
) -> None:
    argv = [*GEN] if command == "generate" else ["serve", "--port", str(free_port)]
    expect_error(
        capsys,
        [*argv, "--device", "cpu", "--head-group", "7"],
        "--head-group 7 must divide the model's 3 KV heads; use one of 1, 3",
    )


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_gpu_memory_smaller_than_the_weights(
    command: str, embedded: Path, free_port: int, capsys: CapSys
) -> None:
    argv = [*GEN] if command == "generate" else ["serve", "--port", str(free_port)]
    expect_error(
        capsys,
        [*argv, "--device", "cpu", "--gpu-memory", "1KB"],
        "--gpu-memory 1000 B is smaller than the model's weights alone",
        "use a larger --gpu-memory",
    )


# -- serve: the address is checked before the model loads -------------------------------------


@pytest.fixture
def held_port() -> Iterator[int]:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_serve_on_a_port_in_use(held_port: int, capsys: CapSys) -> None:
    start = time.monotonic()
    expect_error(
        capsys,
        ["serve", "--host", "127.0.0.1", "--port", str(held_port)],
        f"cannot listen on 127.0.0.1:{held_port}",
        "pick another --port or --host",
    )
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("host", ["999.1.1.1", "no-such-host.invalid"])
def test_serve_on_a_host_that_is_no_address(host: str, free_port: int, capsys: CapSys) -> None:
    start = time.monotonic()
    expect_error(
        capsys, ["serve", "--host", host, "--port", str(free_port)], f"cannot listen on {host}:{free_port}"
    )
    assert time.monotonic() - start < 5


# -- Ctrl-C while the parser is built ---------------------------------------------------------


def test_interrupt_while_building_the_parser(monkeypatch: pytest.MonkeyPatch, capsys: CapSys) -> None:
    def interrupted(name: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main.importlib, "import_module", interrupted)
    try:
        rc = main(["plan", "--model", "llama-3-8b"])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt escaped main: a traceback for the user")
    assert rc == 130
    out, err = capsys.readouterr()
    assert out == "" and err == "kvtier: interrupted\n"


def test_the_script_imports_no_torch_before_main() -> None:
    """`kvtier` imports kvtier.cli.main before main's try: that import must be quick (no torch),
    or a Ctrl-C during it is a traceback."""
    code = "import sys, kvtier.cli.main; print('torch' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout.strip() == "False"


# -- SamplingParams (the server builds them from requests) ------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": -1.0},
        {"top_p": float("nan")},
        {"top_p": 0.0},
        {"top_k": -1},
        {"max_tokens": 0},
        {"seed": 2**64},
        {"seed": -(2**63) - 1},
    ],
)
def test_sampling_params_refuse_values_the_sampler_cannot_use(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_sampling_params_take_the_seeds_torch_takes() -> None:
    for seed in (0, 2**64 - 1, -1, -(2**63)):
        assert SamplingParams(temperature=1.0, seed=seed).seed == seed


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
