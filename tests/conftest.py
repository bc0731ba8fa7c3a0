import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_router.events import EVENT, EndRow, StepRow

REPO = Path(__file__).resolve().parents[1]
# scripts/test.sh runs 4 test files side by side on a machine with few cores, so every worker process of every
# run shares them: idle OpenMP threads sleep instead of spinning (measured: 3 runs at once, 56 -> 40 CPU s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The files that take longest start first, so that none of them starts last and runs alone: scripts/test.sh
# passes --no-loadscope-reorder, so pytest-xdist hands out files in this order (by default it would sort them by
# their number of tests); the rest keep theirs. Order: each file's time with 4 files at once (measured at 0001cb2;
# the real time-limit test waits on Slurm's clock, slower the more loaded the machine: 8 min).
SLOW_FILES = ("test_requeue_time_limit", "test_requeue_slurm", "test_invariant", "test_slurm_launch", "test_analysis",
              "test_signal_windows", "test_finetune_checkpoints", "test_sweeps_and_seeds", "test_multinode",
              "test_requeue_local", "test_adapters_export", "test_slurm_failed_stage", "test_containers",
              "test_prune", "test_run_ownership", "test_end_to_end", "test_bad_input", "test_status_cli",
              "test_verdict_stats", "test_trackers", "test_bad_input_table")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(SLOW_FILES)))      # stable: each file keeps its order


# The single-node test cluster's fake GPUs (scripts/slurm_test_cluster.sh, SLURM_TEST_GPUS): the indices a task sees.
CLUSTER_GPUS = {str(i) for i in range(int(os.environ.get("SLURM_TEST_GPUS", "8")))}
BENCHMARKS = REPO / "benchmarks"
# Test and benchmark workloads (sample-length distributions) live beside the benchmarks, not in the package.
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600,
            module: str = "slurm_router") -> subprocess.CompletedProcess:
    """The real command, as a user types it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def run_dir_of(proc: subprocess.CompletedProcess) -> Path:
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("run_dir: "), proc.stdout[-2000:] + proc.stderr[-2000:]
    return Path(last[len("run_dir: "):])


def step_losses(task_dir: Path) -> list[float]:
    rows = [json.loads(l) for l in (task_dir / "events-rank0.jsonl").read_text().splitlines()]
    return [r["loss"] for r in sorted((r for r in rows if r[EVENT] == StepRow.KIND), key=lambda r: r["step"])]


def task_spans(run_dir: Path) -> dict[str, tuple[float, float, str]]:
    """task -> (start time, end time, CUDA_VISIBLE_DEVICES it saw), from each task's rank-0 events."""
    spans = {}
    for f in run_dir.glob("tasks/*/events-rank0.jsonl"):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        start = next(r for r in rows if r["event"] == "start")
        end = next(r for r in rows if r[EVENT] == EndRow.KIND)
        spans[start["task"]] = (start["time"], end["time"], start["cuda_visible_devices"])
    return spans


@pytest.fixture(scope="session")
def base_cache(tmp_path_factory) -> Path:
    """One base-model cache for the whole session: the base stage trains once, later runs reuse it."""
    return tmp_path_factory.mktemp("base_cache")


def _default_sigint() -> None:
    # A process started from a non-interactive shell's background job inherits SIGINT ignored; a user's
    # terminal never does that to a foreground command (tests/test_requeue_local.py says more).
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)


def start_cli(*args: str, cwd: Path, env: dict | None = None, module: str = "slurm_router") -> subprocess.Popen:
    """The real command in the background, as a user starts it (a test sends it signals); text pipes."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)


def wait_until(predicate, what: str, timeout: float = 600, poll_s: float = 0.05):
    """predicate()'s first truthy value, polled; AssertionError naming `what` after `timeout` s."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"no {what} within {timeout} s")


def pid_alive(pid: int) -> bool:
    """Running (a zombie, ended but not yet reaped by whoever adopted it, is not)."""
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def read_json(path: Path, default=None):
    """A JSON file another process may be replacing right now (atomically): `default` while it is absent."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def event_rows(task_dir: Path, rank: int = 0) -> list[dict]:
    """A task's rank's event rows so far (a torn last line, being written, is left out)."""
    path = Path(task_dir) / f"events-rank{rank}.jsonl"
    rows = []
    for line in (path.read_text().splitlines() if path.is_file() else []):
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, *options) -> a fresh tmpfs folder of that size; unmounted afterwards. Root only."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    mounted = []

    def mount(size: str, *options: str) -> Path:
        path = tmp_path / f"fs{len(mounted)}"
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(path)],
                       check=True)
        mounted.append(path)
        return path
    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)
