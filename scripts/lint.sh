#!/usr/bin/env bash
# The tools that hold the code's shape (seconds each; installed by the test extra, pyproject.toml):
#   ruff check       pyflakes, pycodestyle's errors, import order ([tool.ruff] in pyproject.toml)
#   ruff format      the formatter's style (black's, 120 columns): --check fails on a file it would change
#   lint-imports     the import contracts: rooms in layers, a pure router and verdict, the leaves, no cycles between
#                    sibling packages ([tool.importlinter]; docs/ARCHITECTURE.md, "Rooms")
#   mypy             types over slurm_router/ and analysis/ (through slurm_router/analysis), [tool.mypy]: mypy's
#                    default strictness (annotated functions checked, untyped ones not), missing stubs ignored
# Run by scripts/test.sh before the tests, so by .ci/run too.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m ruff check --quiet slurm_router analysis tests benchmarks
python3 -m ruff format --check --quiet slurm_router analysis tests benchmarks
lint-imports --no-cache --quiet 2>/dev/null || lint-imports --no-cache
python3 -m mypy slurm_router
echo "lint.sh: ruff (lint and format), the import contracts and mypy are clean"
