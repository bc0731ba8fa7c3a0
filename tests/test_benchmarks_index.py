"""docs/BENCHMARKS.md names every results file with the commit it was measured at (the one its header names) and
why it still holds at HEAD: a figure is never older than the index says."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
ROW = re.compile(r"^\| `([\w.-]+\.md)` \| ([0-9a-f]{12}(?:\+dirty)?) \| (.+) \|$")


def index() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in (REPO / "docs" / "BENCHMARKS.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def header_commit(path: Path) -> str:
    line = next(l for l in path.read_text().splitlines() if l.startswith("Commit: "))
    return line.removeprefix("Commit: ").strip()


def test_every_results_file_is_indexed_with_the_commit_its_header_names_and_a_reason():
    rows = index()
    files = sorted(p.name for p in RESULTS.glob("*.md"))
    assert sorted(rows) == files, {
        "not indexed": sorted(set(files) - set(rows)),
        "gone": sorted(set(rows) - set(files)),
    }
    for name, (commit, why) in rows.items():
        assert header_commit(RESULTS / name) == commit, f"{name}: measured at {header_commit(RESULTS / name)}"
        assert len(why.split()) >= 5, f"{name}: say why its figures still hold"
