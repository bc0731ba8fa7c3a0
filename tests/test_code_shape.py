"""The shape the code keeps (issue 26; docs/ARCHITECTURE.md, "Rooms"): at most eight modules at the top of the
package, and no import cycle between any two modules of it (in-function and type-checking imports included;
lint-imports checks the rooms' layers). A module's length is not a test: files split by concept, and
scripts/lint.sh lists the modules over 400 lines for review (issue 49)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_TOP = 8


def test_few_modules_at_the_top_of_the_package():
    top = sorted(p.name for p in (REPO / "slurm_router").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP, top


def test_no_import_cycle_between_modules():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("slurm_router", cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:  # Tarjan: each strongly connected component of more than one module is a cycle
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    assert not cycles, f"modules that import each other (directly or through others): {cycles}"


def test_the_verdict_loads_without_torch_pandas_or_the_rest_of_the_package():
    """The statistics the worker prunes with and the report judges with are a pure room (docs/ARCHITECTURE.md,
    "Rooms"): importing every verdict module in a fresh interpreter loads no torch, pandas or config library, and
    nothing of the package outside verdict/."""
    code = (
        "import sys, slurm_router.verdict.stats, slurm_router.verdict.pruning, slurm_router.verdict.sentences\n"
        "heavy = ('torch', 'transformers', 'peft', 'pandas', 'omegaconf', 'hydra', 'submitit')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in heavy}"
        " | {m for m in sys.modules if m.startswith('slurm_router.') and not m.startswith('slurm_router.verdict')}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", f"importing slurm_router.verdict loaded: {out.stdout.strip()}"
