"""`kvtier --version`: one line with kvtier.__version__, the version the package metadata carries
(pyproject.toml reads it from there)."""

from __future__ import annotations

from importlib import metadata

import pytest

import kvtier
from kvtier.cli.main import build_parser, main


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag_prints_one_line(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([flag]) == 0
    assert capsys.readouterr().out == f"kvtier {kvtier.__version__}\n"


def test_the_parser_knows_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"kvtier {kvtier.__version__}\n"


def test_the_installed_metadata_has_the_same_version() -> None:
    assert metadata.version("kvtier") == kvtier.__version__
