"""Comments and docstrings that name a file name one that exists (issue 49: a path in a comment goes stale when the
file moves). Every `folder/module.py` and `conf/.../name.yaml` in the comments and docstrings of slurm_router/ (and
analysis/) must exist relative to slurm_router/ or to the repository's root. The run directory's forms
(`RUN_DIR/...`, `tasks/<name>/...`) and placeholders (`<kind>`, `*`) are not repository paths and are left alone.
Pure: reads files, imports and runs nothing."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "slurm_router"
ANALYSIS = REPO / "analysis"  # slurm_router/analysis is a symlink to it
# A path with at least one folder, not inside a longer path or a placeholder (`RUN_DIR/x/y.py` is read whole)
PATH = re.compile(r"(?<![\w/.$<>{}*-])((?:[\w.-]+/)+[\w.-]*\w\.py|conf/(?:[\w.-]+/)*[\w.-]+\.yaml)(?![\w/<*{])")
RUN_DIR_FORMS = ("RUN_DIR/", "run_dir/", "tasks/", "runs/")  # a run directory's paths, not the repository's


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line number, text) of each comment and each line of a module's, class's or function's docstring."""
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    found += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return found


def named_paths(text: str) -> list[str]:
    return [p for p in PATH.findall(text) if not p.startswith(RUN_DIR_FORMS)]


def exists(path: str) -> bool:
    return (PACKAGE / path).exists() or (REPO / path).exists()


def modules() -> list[Path]:
    package = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(p for p in package if not p.resolve().is_relative_to(ANALYSIS)) + sorted(ANALYSIS.glob("*.py"))


def test_the_path_reader():
    text = "# see train/data.py and conf/data/jsonl.yaml, not RUN_DIR/tasks/x.py, conf/launcher/<kind>.yaml or a.py"
    assert named_paths(text) == ["train/data.py", "conf/data/jsonl.yaml"]
    assert named_paths("(`cli/status.py`: tasks/<name>/events.jsonl)") == ["cli/status.py"]
    lines = comments_and_docstrings('"""Doc: x/y.py\nmore."""\n\nA = 1  # z/w.py\n')
    assert lines == [(4, "# z/w.py"), (1, "Doc: x/y.py"), (2, "more.")]


def test_every_path_a_comment_names_exists():
    files = modules()
    assert len(files) > 50, "the walk found too few modules: is the package where this test looks?"
    stale = [
        f"{f.relative_to(REPO)}:{line}: {path}"
        for f in files
        for line, text in comments_and_docstrings(f.read_text(encoding="utf-8"))
        for path in named_paths(text)
        if not exists(path)
    ]
    assert not stale, (
        "comments or docstrings name files that exist neither under slurm_router/ nor under the repository's root "
        f"(write the path from one of them): {stale}"
    )
