"""Every results JSON the README and docs/ cite exists and records how it was made: a number's
source can be opened and rerun.

A cited name is a backticked token ending in `.json`: a bare name is a file of bench/results/,
a path is from the repository's root. `{a,b}` stands for both names, `*` for at least one.
Tokens that continue an earlier name (`_512k.json`, `..._161_probe.json`) and plain file names
of a model folder (`config.json`) are not citations of a result.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CITED = re.compile(r"`([^`\s]+\.json)`")


def expand(name: str) -> list[str]:
    """The names `{a,b}` alternatives stand for, every brace expanded."""
    m = re.search(r"\{([^{}]*)\}", name)
    if m is None:
        return [name]
    return [e for alt in m.group(1).split(",") for e in expand(name[: m.start()] + alt + name[m.end() :])]


def cited(text: str) -> list[str]:
    """The results files a page cites, braces expanded (paths from the root, else bare names)."""
    names = []
    for token in CITED.findall(text):
        if token.startswith(("_", ".", "$")) or "<" in token or ("_" not in token and "/" not in token):
            continue
        names += expand(token)
    return names


def missing(name: str) -> bool:
    """Whether a cited name matches no file."""
    base = ROOT if "/" in name else RESULTS
    return not any(base.glob(name)) if "*" in name else not (base / name).exists()


def test_the_citation_rules() -> None:
    """Braces expand, continuations and model files are skipped, globs need one match."""
    assert expand("a_{x,y}_{1,2}.json") == ["a_x_1.json", "a_x_2.json", "a_y_1.json", "a_y_2.json"]
    text = "`_512k.json` `..._b.json` `config.json` `x_{a,b}.json` `docs/d_e.json` `$OUT/r_s.json`"
    assert cited(text) == ["x_a.json", "x_b.json", "docs/d_e.json"]
    assert missing("no_such_result.json") and missing("no_such_*.json")


def test_every_cited_results_file_exists() -> None:
    """Each results file the README or a docs page cites is committed (616 citations today)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    absent = [f"{p.relative_to(ROOT)}: {n}" for p in pages for n in cited(p.read_text()) if missing(n)]
    assert not absent, "cited results files that do not exist:\n" + "\n".join(absent)
    assert sum(len(cited(p.read_text())) for p in pages) > 500  # the rules still find the citations


def test_every_cited_results_file_records_its_command() -> None:
    """Each cited JSON holds the command that made it (`command`, `commands`, or `kvtier ...`
    commands as keys, as docs/multi_gpu_plans.json's plans)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    names = {n for p in pages for n in cited(p.read_text()) if "*" not in n and not missing(n)}
    silent = []
    for name in sorted(names):
        text = ((ROOT if "/" in name else RESULTS) / name).read_text()
        if not any(mark in text for mark in ('"command', '"kvtier ')):
            silent.append(name)
    assert not silent, "cited results files without the command that made them:\n" + "\n".join(silent)
