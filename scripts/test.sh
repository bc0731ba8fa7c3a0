#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, brings up the single-node Slurm test
# cluster (root + apt), then runs every test, with whichever python3 is first on the PATH (the system's, or
# your active venv/conda env's).
#   bash scripts/test.sh [pytest args]
#   bash scripts/test.sh --venv DIR [pytest args]     # in a fresh venv at DIR (created if missing), as a new user
#   bash scripts/test.sh --quick [pytest args]        # the edit-test loop: unit tests + one real end-to-end run
# Each test runs once: its first result is the verdict (only the tests named in tests/conftest.py FLAKY may run
# twice; every rerun is printed and appended to the rerun record, test-results/reruns.txt or
# $SLURM_ROUTER_RERUN_RECORD). Each test has a time limit (pytest-timeout; pyproject.toml): a hang fails it
# with its stack.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="" quick=""
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv=${2:?usage: test.sh [--venv DIR] [--quick] [pytest args]}; shift 2 ;;
    --quick) quick=1; shift ;;
    *) break ;;
  esac
done
if [ -n "$venv" ]; then
  [ -x "$venv/bin/python3" ] || python3 -m venv "$venv"
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
fi

# torch first, pinned: an unpinned resolve would pull a multi-GB CUDA build onto a CPU machine.
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[test,tracking,docs,lm-eval]"   # docs: mkdocs (test_docs_build.py); lm-eval: test_metrics.py
bash scripts/lint.sh            # ruff and the import contracts first: seconds, and a broken shape fails at once

# Outside CI a tier that cannot be installed is skipped, and said so; in CI (CI=true) that stops the run.
missing() {
  if [ "${CI:-}" = true ]; then echo "test.sh: FAILED in CI (CI=true): $1; every tier must run there" >&2; exit 1; fi
  echo "test.sh: $1: $2 will be skipped" >&2
}
if [ -n "$quick" ]; then
  :   # the quick tier's tests need neither Slurm nor a browser (tests/conftest.py QUICK_FILES, QUICK_RUN)
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  bash scripts/slurm_test_cluster.sh
  # a second, 2-node cluster beside it (slurmd in network namespaces) for tests/test_multinode.py
  bash scripts/slurm_multinode_cluster.sh --nodes 2 \
    || missing "multi-node cluster not available" "the multi-node tests"
  # headless Chromium opens report.html in the report test (the cluster script ran apt-get update)
  install_chromium() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; }
  command -v chromium >/dev/null || install_chromium || { apt-get update -qq && install_chromium; } \
    || missing "chromium not installed" "the report screenshot test"
else
  missing "not root or no apt-get" "the Slurm and screenshot tests"
fi

# Most tests wait on Slurm or on worker processes: files run side by side (a file's tests stay together, in
# order, and share its fixtures; the slowest files first, tests/conftest.py SLOW_FILES); `-n 0` (or any -n of
# yours, which comes later and wins) changes that. The quick tier runs 2 files at once.
record=${SLURM_ROUTER_RERUN_RECORD:-test-results/reruns.txt}
workers=4
[ -z "$quick" ] || workers=2
before=$( (wc -l < "$record") 2>/dev/null || echo 0)
status=0
# --durations: the slowest tests, printed at the end, so a slower suite shows where its time went
python3 -m pytest -q -rfEsxXR --durations=30 --rerun-show-tracebacks --rerun-record="$record" \
  -n "$workers" --dist loadfile --no-loadscope-reorder ${quick:+--quick} "$@" || status=$?
echo "test.sh: pytest exit $status; rerun record $record:" >&2
tail -n +"$((before + 1))" "$record" >&2 2>/dev/null || echo "(nothing written: pytest ended before its summary)" >&2
exit "$status"
