"""`kvtier` errors found at startup, before the weights load: a --head-group or --gpu-memory that
does not fit the model's config, a serve address that cannot be listened on, and Ctrl-C while
the parser is built. Errors are one stderr line and a non-zero exit (2; 130 for Ctrl-C), with
no traceback and no model loaded (`LLM` is replaced by a test failure).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.cli import main as cli_main
from kvtier.cli.main import main
from tests.cli_helpers import GEN, CapSys, expect_error, refuse_model_loads


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case here must fail before a model loads."""
    refuse_model_loads(monkeypatch)


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


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


def test_building_the_parser_imports_no_torch_dynamo() -> None:
    """The commands' modules (the methods, the planner, attention) import torch but not
    torch._dynamo, ~1.6-2 s of every command's start on a CPU (`kvtier plan` took 4.5 s with it,
    2.5 without): `causal_lower_right`'s module imports it, so `kvtier.attention.dense` imports
    that on first use."""
    code = (
        "import sys; from kvtier.cli.main import build_parser; build_parser(); "
        "print('torch._dynamo' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert proc.stdout.strip() == "False"
