#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, brings up the single-node Slurm test
# cluster (root + apt), then runs every test, with whichever python3 is first on the PATH (the system's, or
# your active venv/conda env's).
#   bash scripts/test.sh [pytest args]
#   bash scripts/test.sh --venv DIR [pytest args]     # in a fresh venv at DIR (created if missing), as a new user
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--venv" ]; then
  venv=${2:?usage: test.sh --venv DIR [pytest args]}; shift 2
  [ -x "$venv/bin/python3" ] || python3 -m venv "$venv"
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
fi

# torch first, pinned: an unpinned resolve would pull a multi-GB CUDA build onto a CPU machine.
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[test,tracking]"

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  bash scripts/slurm_test_cluster.sh
  # a second, 2-node cluster beside it (slurmd in network namespaces) for tests/test_multinode.py
  bash scripts/slurm_multinode_cluster.sh --nodes 2 \
    || echo "test.sh: multi-node cluster not available: the multi-node tests will be skipped" >&2
  # headless Chromium opens report.html in the report test (the cluster script ran apt-get update)
  install_chromium() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; }
  command -v chromium >/dev/null || install_chromium || { apt-get update -qq && install_chromium; } \
    || echo "test.sh: chromium not installed: the report screenshot test will be skipped" >&2
else
  echo "test.sh: not root or no apt-get: the Slurm and screenshot tests will be skipped" >&2
fi

# Most tests wait on Slurm or on worker processes: files run side by side (a file's tests stay together, in
# order, and share its fixtures); `-n 0` (or any -n of yours, which comes later and wins) changes that.
# Four files at once load a 2-core machine heavily, and a few real-cluster tests depend on timing (a signal
# mid-run, a task started before another ended): tests that fail there run again one at a time, and only a
# failure that repeats fails the suite (both runs' results are printed).
status=0
python3 -m pytest -q -ra -n 4 --dist loadfile --no-loadscope-reorder "$@" || status=$?
if [ "$status" = 1 ]; then
  echo "test.sh: running the failed tests again, one at a time" >&2
  python3 -m pytest -q -ra -n 0 --last-failed --last-failed-no-failures none "$@"
else
  exit "$status"
fi
