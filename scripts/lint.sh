#!/usr/bin/env bash
# The tools that hold the code's shape (seconds each; installed by the test extra, pyproject.toml):
#   ruff check       pyflakes, pycodestyle's errors, import order ([tool.ruff] in pyproject.toml)
#   ruff format      the formatter's style (black's, 120 columns): --check fails on a file it would change
#   lint-imports     the import contracts: rooms in layers, a pure router and verdict, the leaves, no cycles between
#                    sibling packages ([tool.importlinter]; docs/ARCHITECTURE.md, "Rooms")
#   mypy             types over slurm_router/ and analysis/ (through slurm_router/analysis), [tool.mypy]: mypy's
#                    default strictness (annotated functions checked, untyped ones not), missing stubs ignored
#   long modules     a review warning, never a failure: the modules over 400 lines, listed (files split by concept,
#                    not by count; a long one is worth a look in review)
# Run by scripts/test.sh before the tests, so by .ci/run too.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m ruff check --quiet slurm_router analysis tests benchmarks
python3 -m ruff format --check --quiet slurm_router analysis tests benchmarks
lint-imports --no-cache --quiet 2>/dev/null || lint-imports --no-cache
python3 -m mypy slurm_router
python3 - <<'EOF'
from pathlib import Path

LIMIT = 400
files = [p for p in Path("slurm_router").rglob("*.py") if "analysis" not in p.parts] + list(Path("analysis").glob("*.py"))
long = sorted(((len(p.read_text().splitlines()), str(p)) for p in files), reverse=True)
long = [(n, p) for n, p in long if n > LIMIT]
if long:
    print(f"lint.sh: review: {len(long)} module(s) over {LIMIT} lines (a warning, not a failure):")
    for n, p in long:
        print(f"  {n:5d}  {p}")
EOF
echo "lint.sh: ruff (lint and format), the import contracts and mypy are clean"
