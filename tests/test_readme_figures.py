"""The README quotes only what a results file says (issue 25): every figure it takes from benchmarks/results/ is
tagged `<!--fig:FILE:NAME-->VALUE<!--/fig-->`, and benchmarks/readme_figures.py computes each one from its file.
Pure file reading: no benchmark runs here. After regenerating a results file, `python benchmarks/readme_figures.py
--write` brings the README's tagged figures up to date (and the diff shows what moved)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import readme_figures as rf  # noqa: E402

README = rf.README.read_text()
TAGS = rf.tags(README)
# results files the README points to without quoting a figure from them
POINTED_TO_ONLY = {"throughput-cuda-profile.txt": "a GPU profile the README names as where time goes"}
HEADER = ("Command: `", "Commit: ", "Machine: ", "Date: ")


def test_the_readme_tags_its_figures():
    assert len(TAGS) >= 40, "the README's benchmark figures lost their tags (<!--fig:FILE:NAME-->VALUE<!--/fig-->)"
    assert README.count("<!--fig:") == len(TAGS) == README.count("<!--/fig-->"), "an unclosed or nested tag"


@pytest.mark.parametrize("key,quoted", TAGS, ids=[f"{k}@{i}" for i, (k, _) in enumerate(TAGS)])
def test_each_quoted_figure_is_what_its_results_file_says(key, quoted):
    assert key in rf.FIGURES, f"README tags {key!r}, which benchmarks/readme_figures.py does not know"
    assert rf.compute(key) == quoted, (
        f"README says {quoted!r} for {key}, benchmarks/results/{key.rsplit(':', 1)[0]} says {rf.compute(key)!r}: "
        "regenerate the file with the command at its top, or run `python benchmarks/readme_figures.py --write`"
    )


def test_every_known_figure_is_quoted():
    unused = sorted(set(rf.FIGURES) - {k for k, _ in TAGS})
    assert not unused, f"benchmarks/readme_figures.py computes figures the README no longer quotes: {unused}"


def test_every_results_file_the_readme_names_has_its_figures_tagged():
    named = set(re.findall(r"benchmarks/results/([\w./-]+\w)", README))
    # "results in `benchmarks/results/throughput-cuda.md`, `packing.md`, ...": the names listed after a path too
    named |= {m for m in re.findall(r"`([\w-]+\.(?:md|json|txt))`", README) if (rf.RESULTS / m).exists()}
    tagged = {k.rsplit(":", 1)[0].split("/")[0] for k, _ in TAGS}
    stems = {Path(k.rsplit(":", 1)[0]).stem for k, _ in TAGS}
    missing = sorted(
        n for n in named if n not in POINTED_TO_ONLY and n.rstrip("/") not in tagged and Path(n).stem not in stems
    )
    assert not missing, f"the README names these results files but tags no figure from them: {missing}"


@pytest.mark.parametrize("path", sorted(p.name for p in rf.RESULTS.glob("*.md")))
def test_each_results_file_starts_with_its_command_commit_machine_and_date(path):
    lines = (rf.RESULTS / path).read_text().splitlines()
    assert lines[0].startswith("# "), f"{path}: no title line"
    head = lines[2:6]
    assert [line.startswith(h) for line, h in zip(head, HEADER)] == [True] * 4, (
        f"{path} does not start with its regenerating command, commit, machine and date (benchmarks/provenance.py "
        f"header): {head}"
    )
    assert re.match(r"Command: `python benchmarks/[\w.]+\.py[^`]*`", head[0]), head[0]
