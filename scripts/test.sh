#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, brings up the single-node Slurm test
# cluster (root + apt), then runs every test. Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

# torch first, pinned: an unpinned resolve would pull a multi-GB CUDA build onto a CPU machine.
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[test]"

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  bash scripts/slurm_test_cluster.sh
  # headless Chromium opens report.html in the report test (the cluster script ran apt-get update)
  install_chromium() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; }
  command -v chromium >/dev/null || install_chromium || { apt-get update -qq && install_chromium; } \
    || echo "test.sh: chromium not installed: the report screenshot test will be skipped" >&2
else
  echo "test.sh: not root or no apt-get: the Slurm and screenshot tests will be skipped" >&2
fi

python3 -m pytest -q -ra "$@"
