"""docs/ARCHITECTURE.md is the map, and the map is checked (issue 26, item 6): every module of the package and of the
report is on docs/modules.md, generated from its docstring by scripts/gen_module_map.py (issue 49), every section a
code comment cites (on the map, a design page under docs/design/ or any other docs page) is a heading of that page,
every module path the map and the design pages name exists, and the map's import-contract summary is
pyproject.toml's. Pure: reads files, imports nothing of the package and runs nothing."""

from __future__ import annotations

import importlib.util
import os
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "ARCHITECTURE.md"
DESIGN = REPO / "docs" / "design"  # the design essays the map links to (issue 39, item 5)
PACKAGE = REPO / "slurm_router"
ANALYSIS = REPO / "analysis"  # slurm_router/analysis is a symlink to it
# Where code comments cite the map's sections. Not tests/: this file's own docstrings would count.
CITING_DIRS = ("slurm_router", "analysis", "benchmarks", "scripts", "conf", "sbatch_templates")
CITING_FILES = ("README.md", "pyproject.toml")
CITING_SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".md", ".toml", ".sbatch", ".tmpl", ".txt"}

# A path token: a name ending in .py, not preceded by another path character (so `cli/status.py` does not name the
# top-level `status.py`, nor `analysis/__main__.py` the package's `__main__.py`).
PY_PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]*\w\.py)(?!\w)")
DOTTED = re.compile(r"(?<![\w.])slurm_router(?:\.\w+)+")
# `docs/PAGE.md, "Title"` and `docs/PAGE.md ("Title")`, once line breaks and comment markers are joined
CITATION = re.compile(r"(docs/[\w./-]+\.md)(?:\s*,\s*|\s*\(\s*)\"([^\"]+)\"")


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def package_modules() -> list[str]:
    """Every module under slurm_router/ but the analysis symlink and __init__.py files, relative to slurm_router/."""
    found = []
    for root, dirs, files in os.walk(PACKAGE):  # os.walk does not descend into the analysis symlink
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not (Path(root) / d).is_symlink())
        for f in sorted(files):
            if f.endswith(".py") and f != "__init__.py":
                found.append((Path(root) / f).relative_to(PACKAGE).as_posix())
    return found


def analysis_modules() -> list[str]:
    return [f"analysis/{p.name}" for p in sorted(ANALYSIS.glob("*.py")) if p.name != "__init__.py"]


def named_paths(text: str) -> set[str]:
    return set(PY_PATH.findall(text))


def headings(text: str) -> list[str]:
    """The markdown headings, outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.+?)\s*#*\s*$", line)
        if m and not fenced:
            out.append(m.group(1))
    return out


def citations_in(text: str) -> list[tuple[str, str]]:
    """(page, title) of each section cited in a file's text. A citation may wrap onto the next line of a docstring
    or of a # comment: line breaks, with the next line's comment markers, become one space."""
    joined = re.sub(r"[ \t]*\n[ \t]*(?:#+[ \t]*)?", " ", text)
    return [(page, re.sub(r"\s+", " ", title).strip()) for page, title in CITATION.findall(joined)]


def design_pages() -> list[Path]:
    return sorted(DESIGN.glob("*.md"))


def cited_sections() -> dict[tuple[str, str], list[str]]:
    """(page, section title) -> the files that cite it."""
    files = [REPO / f for f in CITING_FILES if (REPO / f).is_file()]
    for d in CITING_DIRS:
        for root, dirs, names in os.walk(REPO / d):  # analysis is walked once, as the top-level folder
            dirs[:] = [x for x in dirs if x != "__pycache__" and not (Path(root) / x).is_symlink()]
            files += [Path(root) / n for n in names if Path(n).suffix in CITING_SUFFIXES]
    cited: dict[tuple[str, str], list[str]] = {}
    for f in files:
        for page_title in citations_in(f.read_text(encoding="utf-8", errors="replace")):
            cited.setdefault(page_title, []).append(f.relative_to(REPO).as_posix())
    return cited


def exists(path: str) -> bool:
    """A path the map names: relative to slurm_router/ (analysis/ included) or to the repository's root."""
    return (PACKAGE / path).is_file() or (REPO / path).is_file()


def module_exists(dotted: str) -> bool:
    """A dotted name the map uses: a module or package, where pyproject.toml's package-dir puts it
    (slurm_router.conf is conf/, slurm_router.sbatch_templates is sbatch_templates/)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    package_dir = config["tool"]["setuptools"].get("package-dir", {})
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):  # the longest mapped package it is in
        folder = package_dir.get(".".join(parts[:n]))
        if folder is not None:
            rel = Path(folder, *parts[n:])
            break
    else:
        rel = Path(*parts)
    return (REPO / rel).with_suffix(".py").is_file() or (REPO / rel).is_dir()


# ---- the parsers themselves -----------------------------------------------------------------------------------------
def test_a_path_names_only_itself():
    assert named_paths("`cli/status.py` and `analysis/__main__.py`") == {"cli/status.py", "analysis/__main__.py"}
    assert "status.py" in named_paths("(`status.py`, `__main__.py`)")


def test_citations_are_read_across_lines_and_comment_markers():
    text = (
        '"""launcher.container (docs/ARCHITECTURE.md, "How a\njob runs"). More."""\n'
        '# see docs/ARCHITECTURE.md, "Target\n#   masks": and docs/ARCHITECTURE.md ("The model")\n'
        '"""docs/ARCHITECTURE.md, "A task\'s lifecycle": `cached`)"""'
    )
    assert citations_in(text) == [
        ("docs/ARCHITECTURE.md", "How a job runs"),
        ("docs/ARCHITECTURE.md", "Target masks"),
        ("docs/ARCHITECTURE.md", "The model"),
        ("docs/ARCHITECTURE.md", "A task's lifecycle"),
    ]
    assert citations_in('# see docs/design/router.md, "The router\'s\n# invariant"') == [
        ("docs/design/router.md", "The router's invariant")
    ]


def test_headings_outside_code_blocks_only():
    assert headings("## Rooms\n```\n# not a heading\n```\n### Every module ##\n") == ["Rooms", "Every module"]


# ---- the map ----------------------------------------------------------------------------------------------------
def module_map():
    """scripts/gen_module_map.py, loaded from its file (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("gen_module_map", REPO / "scripts" / "gen_module_map.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_module_is_on_the_generated_page():
    """docs/modules.md is generated from the docstrings: a module without one, or a page not regenerated after a
    module came, went or changed its first sentence, fails here with the command to run."""
    gen = module_map()
    modules = [rel for rel, _ in gen.modules()]
    assert len(modules) > 50, "the module walk found too few modules: is the package where this test looks?"
    assert set(package_modules() + analysis_modules()) <= set(modules), "the generator walks fewer modules"
    page, missing = gen.render()
    assert not missing, f"modules without a docstring (its first sentence is its line in docs/modules.md): {missing}"
    assert (REPO / "docs" / "modules.md").read_text(encoding="utf-8") == page, (
        f"docs/modules.md is stale: run {gen.COMMAND}"
    )
    assert "(modules.md)" in doc_text(), "docs/ARCHITECTURE.md does not point at docs/modules.md"


def test_the_module_sentence_is_the_docstrings_first():
    gen = module_map()
    assert gen.first_sentence(PACKAGE / "fileio.py").startswith("Atomic file writes")
    assert gen.SENTENCE_END.search("A, e.g. b. C").start() == 9  # "e.g." ends no sentence


def test_every_cited_section_exists():
    cited = cited_sections()
    assert len(cited) >= 5, f"found too few citations of docs sections: {sorted(cited)}"
    assert any(page == "docs/ARCHITECTURE.md" for page, _ in cited), "no code comment cites the map any more"
    missing = {
        f"{page}, {title!r}": files
        for (page, title), files in sorted(cited.items())
        if not (REPO / page).is_file() or title not in headings((REPO / page).read_text(encoding="utf-8"))
    }
    assert not missing, f"sections cited in code comments that their page has no heading for (citing files): {missing}"


@pytest.mark.parametrize("page", ["ARCHITECTURE.md", *(f"design/{p.name}" for p in design_pages())])
def test_every_module_path_on_the_map_exists(page):
    """The map and its design pages name only paths and modules that exist."""
    text = (REPO / "docs" / page).read_text(encoding="utf-8")
    stale = sorted(p for p in named_paths(text) if not exists(p))
    assert not stale, (
        f"docs/{page} names these .py paths, which exist neither under slurm_router/ nor "
        f"under the repository's root: {stale}"
    )
    stale_dotted = sorted(d for d in set(DOTTED.findall(text)) if not module_exists(d))
    assert not stale_dotted, f"docs/{page} names modules that do not exist: {stale_dotted}"


def test_the_map_links_every_design_page():
    text = doc_text()
    unlinked = [p.name for p in design_pages() if f"(design/{p.name})" not in text]
    assert len(design_pages()) >= 5 and not unlinked, f"design pages docs/ARCHITECTURE.md does not link: {unlinked}"


def test_every_room_is_in_the_rooms_table():
    text = doc_text()
    rooms_section = text.split("## Rooms", 1)[1].split("\n## ", 1)[0]
    rooms = sorted({Path(m).parent.as_posix() + "/" for m in package_modules() if "/" in m} | {"analysis/"})
    missing = [r for r in rooms if f"`{r}`" not in rooms_section]
    assert not missing, f"rooms missing from the Rooms table of docs/ARCHITECTURE.md: {missing}"


def test_the_import_contracts_are_pyprojects():
    """The layers block under 'Import contracts' lists pyproject.toml's layers in order, and both ignored imports are
    named: the map says what lint-imports checks."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    layers_contract = next(c for c in contracts if c["type"] == "layers")
    expected = [
        " | ".join(part.strip().removeprefix("slurm_router.") for part in layer.split("|"))
        for layer in layers_contract["layers"]
    ]
    text = doc_text()
    section = text.split("### Import contracts", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    listed = [re.split(r"\s{2,}", line.strip())[0] for line in block.splitlines() if line.strip()]
    assert listed == expected, f"docs/ARCHITECTURE.md's layers {listed} are not pyproject.toml's {expected}"
    flat = re.sub(r"\s+", " ", section)
    for contract in contracts:
        for ignored in contract.get("ignore_imports", []):
            assert ignored in flat, f"the ignored import {ignored!r} is not described under 'Import contracts'"
