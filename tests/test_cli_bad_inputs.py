"""Bad input to every `kvtier` subcommand: exit code 2, one stderr line `kvtier: error: ...`, no
traceback, and no model loaded (`LLM` is replaced by a test failure for the error cases).

The table holds inputs a user found failing with a traceback, or late, or silently misread. Also
here: prompts that are not UTF-8, and the `SamplingParams` the server builds from requests. Bad
files and paths: test_cli_bad_files.py; checks at startup and Ctrl-C: test_cli_startup.py.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli.main import build_parser
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError
from tests.cli_helpers import GEN, PLAN, CapSys, expect_error, refuse_model_loads


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case here must fail before a model loads."""
    refuse_model_loads(monkeypatch)


HUGE = "9" * 400  # float() of it is inf
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
