"""Slurm lives in its backend (issue 39): outside `slurm_router/backends/slurm/`, no code of the package runs a Slurm
command or reads a Slurm variable. Every other room reaches Slurm through the registry (scheduler/registry.py): the
run's `Backend` on the submit side, the process's `JobEnvironment` in a job.

The rule, precisely. Each module of `slurm_router/` (and `analysis/`, shipped as `slurm_router.analysis`) outside
`slurm_router/backends/slurm/` is parsed; comments and docstrings (any string that stands alone as a statement)
may name Slurm's commands and variables, since prose says what a module replaces or where to look. In every other
string literal (an f-string read with `{}` in place of its fields):
- a `SLURM_` variable: `SLURM_` followed by a capital letter, except the project's own `SLURM_ROUTER_*` variables;
- a Slurm command (sbatch, squeue, sacct, scontrol, scancel, srun, sinfo) used as a command: a string that starts
  with the command and an argument (`"sbatch --parsable ..."`), a command substitution or a backticked command
  (`"$(squeue ..."`, "`scontrol ping`"), the first word of an argument vector (`["scontrol", "requeue", ...]`), or
  the argument of `shutil.which`.
A bare name elsewhere is not a command: `launcher=sbatch` names a launcher kind, `submit.sbatch` a file.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLURM_BACKEND = REPO / "slurm_router" / "backends" / "slurm"
COMMANDS = ("sbatch", "squeue", "sacct", "scontrol", "scancel", "srun", "sinfo")
_NAMES = "|".join(COMMANDS)
SLURM_VARIABLE = re.compile(r"SLURM_(?!ROUTER_)[A-Z]")
COMMAND_LINE = re.compile(rf"^\s*(?:{_NAMES})\s+\S")
COMMAND_INSIDE = re.compile(rf"(?:\$\(|`)\s*(?:{_NAMES})\b")


def modules() -> list[Path]:
    found = {p.resolve() for p in (REPO / "slurm_router").rglob("*.py")} | {
        p.resolve() for p in (REPO / "analysis").glob("*.py")
    }
    return sorted(p for p in found if SLURM_BACKEND not in p.parents)


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v) or "{}" for v in node.values)
    return None


def code_strings(tree: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """(node, its text) of every string literal in the code: prose (a string that stands alone as a statement) and
    the pieces of an f-string (read whole, `{}` for its fields) left out. tests/test_backend_owns_itself.py reads
    the same strings."""
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and _text(n.value) is not None}
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        text = _text(node)
        if text is not None and id(node) not in prose and id(node) not in parts:
            yield node, text


def violations(source: str) -> list[str]:
    """Each Slurm command or variable the rule above finds in this module's code: 'line N: what'."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)) and node.elts and _text(node.elts[0]) in COMMANDS:
            found.append(f"line {node.lineno}: the command {_text(node.elts[0])!r} in an argument vector")
        if isinstance(node, ast.Call) and node.args and _text(node.args[0]) in COMMANDS:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "which":
                found.append(f"line {node.lineno}: which({_text(node.args[0])!r})")
    for node, text in code_strings(tree):
        if SLURM_VARIABLE.search(text):
            found.append(f"line {getattr(node, 'lineno', 0)}: a Slurm variable in {text[:60]!r}")
        if COMMAND_LINE.search(text) or COMMAND_INSIDE.search(text):
            found.append(f"line {getattr(node, 'lineno', 0)}: a Slurm command in {text[:60]!r}")
    return found


def test_the_rule_finds_what_it_says_and_leaves_prose_alone():
    code = '''
"""A docstring may say sbatch --parsable and SLURM_JOB_ID."""
import os, shutil, subprocess
# a comment may too: squeue -h
subprocess.run(["scontrol", "requeue", job])
os.environ.get("SLURM_JOB_ID")
line = f"{var}=$(sbatch --parsable {script})"
shutil.which("sacct")
hint = "try again once `scontrol ping` says UP"
kind = "sbatch"
env = "SLURM_ROUTER_THREADS"
name = "submit.sbatch"
'''
    found = violations(code)
    assert sorted(f.split(":")[0] for f in found) == ["line 5", "line 6", "line 7", "line 8", "line 9"], found


def test_no_slurm_outside_its_backend():
    found = {str(p.relative_to(REPO)): v for p in modules() if (v := violations(p.read_text(encoding="utf-8")))}
    assert not found, (
        "Slurm commands or SLURM_ variables outside slurm_router/backends/slurm/ (reach Slurm through the run's "
        f"backend, scheduler/registry.py): {found}"
    )
