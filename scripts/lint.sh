#!/usr/bin/env bash
# The tools that hold the code's shape (seconds each; installed by the test extra, pyproject.toml):
#   ruff check       pyflakes, pycodestyle's errors, import order ([tool.ruff] in pyproject.toml)
#   lint-imports     the import contracts: rooms in layers, a pure router, the leaves, no cycles between
#                    sibling packages ([tool.importlinter]; docs/ARCHITECTURE.md, "Rooms")
# Run by scripts/test.sh before the tests, so by .ci/run too.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m ruff check --quiet slurm_router analysis tests benchmarks
lint-imports --no-cache --quiet 2>/dev/null || lint-imports --no-cache
echo "lint.sh: ruff and the import contracts are clean"
