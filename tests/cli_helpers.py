"""What the CLI error tests share (test_cli_bad_inputs.py, test_cli_bad_files.py,
test_cli_startup.py): `kvtier` run in-process, the one-line error each case expects, and the
refusal of any model load."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.cli.main import main

CapSys = pytest.CaptureFixture[str]

GEN = ["generate", "--prompt", "hi"]
PLAN = ["plan", "--model", "llama-3-8b"]


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


def refuse_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `LLM` in the CLI's commands a test failure (each test file's autouse
    `no_model_load`: every case there must fail before a model loads)."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was loaded: the error should have come before")

    for module in ("generate_cmd", "serve_cmd"):
        monkeypatch.setattr(f"kvtier.cli.{module}.LLM", refuse)
