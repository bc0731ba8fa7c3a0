"""The README and the docs pages quote only what a results file says (issue 25): every figure a page takes from
benchmarks/results/ is tagged `<!--fig:FILE:NAME-->VALUE<!--/fig-->`, and benchmarks/readme_figures.py computes each
one from its file. The figures moved from the README into docs/ pages with their tags (issue 41, finding 11).
Pure file reading: no benchmark runs here. After regenerating a results file, `python benchmarks/readme_figures.py
--write` brings every page's tagged figures up to date (and the diff shows what moved)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import readme_figures as rf  # noqa: E402

README = rf.README.read_text()
PAGE_TAGS = rf.page_tags()
TAGS = [(k, v) for _, k, v in PAGE_TAGS]
# results files a page points to without quoting a figure from them
POINTED_TO_ONLY = {"throughput-cuda-profile.txt": "a GPU profile docs/throughput.md names as where time goes"}
HEADER = ("Command: `", "Commit: ", "Machine: ", "Date: ")


def test_the_pages_tag_their_figures():
    assert len(TAGS) >= 40, "the pages' benchmark figures lost their tags (<!--fig:FILE:NAME-->VALUE<!--/fig-->)"
    assert rf.tags(README), "the README's own figures (its 'Measured' table) lost their tags"
    for page in rf.pages():
        text = page.read_text()
        assert text.count("<!--fig:") == len(rf.tags(text)) == text.count("<!--/fig-->"), (
            f"{page.relative_to(rf.REPO)}: an unclosed or nested tag"
        )


@pytest.mark.parametrize("page,key,quoted", PAGE_TAGS, ids=[f"{p}:{k}@{i}" for i, (p, k, _) in enumerate(PAGE_TAGS)])
def test_each_quoted_figure_is_what_its_results_file_says(page, key, quoted):
    assert key in rf.FIGURES, f"{page} tags {key!r}, which benchmarks/readme_figures.py does not know"
    assert rf.compute(key) == quoted, (
        f"{page} says {quoted!r} for {key}, benchmarks/results/{key.rsplit(':', 1)[0]} says {rf.compute(key)!r}: "
        "regenerate the file with the command at its top, or run `python benchmarks/readme_figures.py --write`"
    )


def test_every_known_figure_is_quoted():
    unused = sorted(set(rf.FIGURES) - {k for k, _ in TAGS})
    assert not unused, f"benchmarks/readme_figures.py computes figures no page quotes any more: {unused}"


@pytest.mark.parametrize("page", [p.relative_to(rf.REPO).as_posix() for p in rf.pages() if rf.tags(p.read_text())])
def test_every_results_file_a_page_with_figures_names_has_its_figures_tagged(page):
    """A page that quotes figures tags one from each results file it names. (docs/BENCHMARKS.md, the index, and the
    design pages name results files without quoting them.)"""
    text = (rf.REPO / page).read_text()
    named = set(re.findall(r"benchmarks/results/([\w./-]+\w)", text))
    # "results in `benchmarks/results/throughput-cuda.md`, `packing.md`, ...": the names listed after a path too
    named |= {m for m in re.findall(r"`([\w-]+\.(?:md|json|txt))`", text) if (rf.RESULTS / m).exists()}
    page_tags = rf.tags(text)
    tagged = {k.rsplit(":", 1)[0].split("/")[0] for k, _ in page_tags}
    stems = {Path(k.rsplit(":", 1)[0]).stem for k, _ in page_tags}
    missing = sorted(
        n for n in named if n not in POINTED_TO_ONLY and n.rstrip("/") not in tagged and Path(n).stem not in stems
    )
    assert not missing, f"{page} names these results files but tags no figure from them: {missing}"


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
