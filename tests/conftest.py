import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_router.config.testing_aids import CPU_MEMORY_CAP_ENV, DEVICE_SLOWDOWN_ENV
from slurm_router.rundir.events import EVENT, EndRow, StepRow
from slurm_router.scheduler.registry import backends

REPO = Path(__file__).resolve().parents[1]
# scripts/test.sh runs 4 test files side by side on a machine with few cores, so every worker process of every
# run shares them: idle OpenMP threads sleep instead of spinning (measured: 3 runs at once, 56 -> 40 CPU s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The files that take longest start first, so that none of them starts last and runs alone: scripts/test.sh
# passes --no-loadscope-reorder, so pytest-xdist hands out files in this order (by default it would sort them by
# their number of tests); the rest keep theirs. Order: each file's time with 4 files at once (measured at 0001cb2;
# the real time-limit test waits on Slurm's clock, slower the more loaded the machine: 8 min).
SLOW_FILES = (
    "test_requeue_time_limit",
    "test_requeue_slurm",
    "test_invariant",
    "test_slurm_launch",
    "test_analysis",
    "test_signal_windows",
    "test_finetune_checkpoints",
    "test_sweeps_and_seeds",
    "test_multinode",
    "test_requeue_local",
    "test_adapters_export",
    "test_slurm_failed_stage",
    "test_slurm_busy_cluster",
    "test_slurm_controller_restart",
    "test_slurm_node_lost",
    "test_containers",
    "test_prune",
    "test_run_ownership",
    "test_end_to_end",
    "test_bad_input",
    "test_status_cli",
    "test_verdict_stats",
    "test_trackers",
    "test_bad_input_table",
)


# Tests that may run a second time (pytest-rerunfailures' flaky marker, one rerun), each for a known, explained
# timing hazard: test id -> why. At most MAX_FLAKY. Every rerun is printed in the summary (scripts/test.sh: -rR
# with the first attempt's traceback) and appended to the rerun record (--rerun-record). Fix the race instead of
# adding a line here; a test not named here runs once, and its first result is the verdict.
FLAKY: dict[str, str] = {}
MAX_FLAKY = 5

# Per-test time limits (pytest-timeout) longer than pyproject.toml's default (300 s, which fits a real run with 4
# test files side by side on 2 cores): test id -> seconds, kept here beside FLAKY so the slow tests are named in one
# place. Measured in the whole suite (scripts/test.sh, 2 cores, load average 8-12 with other work beside it): the
# time-limit test 452 s, prune's real run 223 s, the end-to-end run 192 s; every other test at most 148 s.
TIMEOUTS: dict[str, int] = {
    # a real one-minute Slurm time limit, twice, plus the base stage and a resume
    "tests/test_requeue_time_limit.py::test_real_time_limit_requeues_then_stops_at_the_budget": 2400,
    # two variants x three seeds trained side by side until the loser is pruned, the report checked
    "tests/test_prune.py::test_a_real_run_prunes_the_loser_and_the_survivor_trains_as_alone": 600,
    # the r8 (lr 1e-6) against r32, three seeds each, with the default cpu slots
    "tests/test_prune.py::test_a_planted_loser_is_pruned_with_the_default_cpu_slots": 600,
    # the 2-node cluster's controller stopped for 40 s under two 100 s tasks, then the report job
    "tests/test_slurm_controller_restart.py::test_a_controller_stopped_mid_run_costs_nothing": 900,
    # a 2-node task on the 2-node cluster, a node set down under it, the requeue, then the same task on one device
    "tests/test_slurm_node_lost.py::test_a_node_set_down_mid_run_requeues_and_resumes_with_the_same_losses": 600,
    # a 2-node task of 60 slowed steps, mn2's slurmd killed, DOWN after SlurmdTimeout, the requeue, the local copy
    "tests/test_slurm_slurmd_killed.py::test_a_killed_slurmd_fails_the_node_and_the_task_resumes_with_the_same_losses": 900,
    # a 2-node task preempted by an urgent partition's job, the requeue, then the same task on one device
    "tests/test_slurm_preempt.py::test_a_preempted_task_waits_then_resumes_with_the_same_losses": 600,
    # base stage, two variants and the report, then the same run again from the cached base
    "tests/test_end_to_end.py::test_lora_ab_learns_reports_and_reuses_the_base": 600,
}


# `scripts/test.sh --quick` (pytest --quick), the edit-test loop (under 3 minutes on a 2-core machine): the tests of
# these files that start no real run (those not marked integration), plus QUICK_RUN, one real end-to-end run
# (base stage, two LoRA variants, report; run again from the cached base).
QUICK_FILES = (
    "test_analysis_units",
    "test_architecture_map",
    "test_bad_input_table",
    "test_benchmarks_index",
    "test_checkpoint",
    "test_code_shape",
    "test_data",
    "test_data_formats",
    "test_docs_build",
    "test_events",
    "test_every_setting",
    "test_fused_lora",
    "test_hf_models",
    "test_loss",
    "test_router_models",
    "test_router_policies",
    "test_router_row_cost",
    "test_sbatch_render",
    "test_slurm_status",
    "test_speed_model",
    "test_submit_stages",
    "test_telemetry",
    "test_verdict_stats",
    "test_worker_units",
)
QUICK_RUN = "tests/test_end_to_end.py::test_lora_ab_learns_reports_and_reuses_the_base"


def pytest_addoption(parser):
    parser.addoption(
        "--quick",
        action="store_true",
        help="the quick tier: QUICK_FILES' unit tests and one real end-to-end run (tests/conftest.py)",
    )
    parser.addoption(
        "--rerun-record", metavar="PATH", help="append every rerun (test, why it may rerun, its first failure) to PATH"
    )


def pytest_ignore_collect(collection_path, config):
    if config.getoption("quick") and collection_path.suffix == ".py" and collection_path.stem.startswith("test_"):
        quick = {*QUICK_FILES, Path(QUICK_RUN.split("::")[0]).stem}
        return collection_path.stem not in quick or None
    return None


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(SLOW_FILES)))  # stable: each file keeps its order
    if config.getoption("quick"):
        keep = [
            i
            for i in items
            if i.nodeid == QUICK_RUN or (i.path.stem in QUICK_FILES and i.get_closest_marker("integration") is None)
        ]
        named = config.args_source == pytest.Config.ArgsSource.ARGS  # `--quick tests/x.py`: that file's quick tests
        if not named and not any(i.nodeid == QUICK_RUN for i in keep):
            raise pytest.UsageError(f"conftest.QUICK_RUN: no test {QUICK_RUN}")
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    if len(FLAKY) > MAX_FLAKY:
        raise pytest.UsageError(f"conftest.FLAKY names {len(FLAKY)} tests; at most {MAX_FLAKY} may rerun")
    whole_files = not (
        config.getoption("quick")
        or config.option.keyword
        or config.option.markexpr
        or any("::" in a for a in config.args)
    )
    if whole_files:  # a name that no longer matches its test fails loudly instead of protecting nothing
        ids, files = {i.nodeid for i in items}, {i.nodeid.split("::")[0] for i in items}
        for name, named in (("FLAKY", FLAKY), ("TIMEOUTS", TIMEOUTS)):
            stale = [t for t in named if t.split("::")[0] in files and t not in ids]
            if stale:
                raise pytest.UsageError(f"conftest.{name} names tests that do not exist: {stale}")
    for item in items:
        if item.nodeid in FLAKY:
            item.add_marker(pytest.mark.flaky(reruns=1))
        if item.nodeid in TIMEOUTS:  # closest (prepended), keeping a func_only the test's own marker sets
            own = item.get_closest_marker("timeout")
            func_only = {k: v for k, v in (own.kwargs if own else {}).items() if k == "func_only"}
            item.add_marker(pytest.mark.timeout(TIMEOUTS[item.nodeid], **func_only), append=False)


# In CI (CI=true) every skip fails its test but two kinds: a GPU's (CI has none) and one whose reason starts with
# "this machine cannot" (a capability no install gives: root reading a chmod 000 file, a tmpfs mount in a
# container). scripts/test.sh installs everything else (the Slurm clusters, Chromium, every extra the tests import),
# so any other skip would mean a test, or a whole tier, passed untested.
CI_ALLOWED_SKIP = ("gpu", "cuda", "this machine cannot")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if os.environ.get("CI", "").lower() not in ("true", "1") or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(word in reason.lower() for word in CI_ALLOWED_SKIP):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (CI=true), where every test but a GPU's must run: {reason}"


_RERUNS: list[str] = []


def pytest_runtest_logreport(report):
    """The rerun record: written by the process that reports (pytest-xdist's controller, not its workers)."""
    if report.outcome == "rerun":
        first = report.longreprtext.strip().splitlines()
        _RERUNS.append(
            f"RERUN {report.nodeid} ({report.when}); may rerun because: {FLAKY.get(report.nodeid, '?')}\n"
            + "\n".join(f"    {line}" for line in first[-40:])
        )


def pytest_sessionfinish(session):
    path = session.config.getoption("rerun_record")
    if path and not hasattr(session.config, "workerinput"):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"{len(_RERUNS)} rerun(s): pytest {' '.join(session.config.invocation_params.args)}\n")
            f.writelines(line + "\n" for line in _RERUNS)


# No forecast probe per model shape in the suite's runs, in process or not (slurm_router/launch/forecast.py OFF_ENV):
# tests/test_forecast.py clears it for its own runs
os.environ["SLURM_ROUTER_TEST_NO_FORECAST"] = "1"

# Every scheduler backend loaded, as the command does first: each adds its launchers' schemas (launcher=slurm and
# launcher=sbatch are the Slurm backend's), so a test that composes a config in process finds them.
backends()

# The single-node test cluster's fake GPUs (scripts/slurm_test_cluster.sh, SLURM_TEST_GPUS): the indices a task sees.
CLUSTER_GPUS = {str(i) for i in range(int(os.environ.get("SLURM_TEST_GPUS", "8")))}
BENCHMARKS = REPO / "benchmarks"
# Test and benchmark workloads (sample-length distributions) live beside the benchmarks, not in the package.
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))


def run_cli(
    *args: str,
    cwd: Path | None = None,
    env: dict | None = None,
    timeout: int = 600,
    module: str = "slurm_router",
    cores: int | None = None,
) -> subprocess.CompletedProcess:
    """The real command, as a user types it. cores: on that many of this machine's cores only (its affinity), as
    on a smaller machine: a task's torch threads follow the cores it has (worker/cpu.py), and with AVX-512 kernels
    a matmul's sums differ with the thread count, so a loss compared bit for bit needs the same count."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    pin = None if cores is None else (lambda: os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores]))
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=pin,
    )


def slowdown(value: str) -> dict[str, str]:
    """The environment (run_cli's env=) that slows devices: "4" every rank 4x, "1,3" rank 1 3x, "r32=20" variant
    r32's tasks only; a sleep in proportion to each step's compute, which changes no number
    (slurm_router/config/testing_aids.py)."""
    return {DEVICE_SLOWDOWN_ENV: value}


def memory_cap(value: str) -> dict[str, str]:
    """The environment that gives CPU workers a simulated memory of `value` bytes ("bad=1000": variant bad's only)."""
    return {CPU_MEMORY_CAP_ENV: value}


def run_dir_of(proc: subprocess.CompletedProcess) -> Path:
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("run_dir: "), proc.stdout[-2000:] + proc.stderr[-2000:]
    return Path(last[len("run_dir: ") :])


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
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )


@pytest.fixture(autouse=True)
def _no_tracker_store_leaks():
    """MLflow's set_tracking_uri writes MLFLOW_TRACKING_URI into os.environ: a test that logs to MLflow in-process
    must not hand its store to the tests after it on the same worker (their commands inherit os.environ)."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


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
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, *options) -> a fresh tmpfs folder of that size; unmounted afterwards. Root only."""
    if os.geteuid() != 0:
        pytest.skip("this machine cannot mount a small file system: it needs root")
    mounted = []

    def mount(size: str, *options: str) -> Path:
        path = tmp_path / f"fs{len(mounted)}"
        path.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(path)], check=True
        )
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def failed_base_manifest(variants_job: str) -> dict:
    """A two-stage run whose base (job 220) failed; the variants (2 tasks) wait on it with afterok."""
    return {
        "launcher": "sbatch",
        "tasks": {},
        "report_job_id": "223",
        "stages": [
            {"name": "base", "tasks": ["base"], "depends_on": []},
            {"name": "variants", "tasks": ["r8", "r32"], "depends_on": ["base"]},
        ],
        "jobs": [
            {"stage": "base", "job_id": "220", "array": False, "tasks": [{"variant": "base"}]},
            {
                "stage": "variants",
                "job_id": variants_job,
                "array": True,
                "tasks": [{"variant": v, "array_index": i} for i, v in enumerate(("r8", "r32"))],
            },
        ],
    }
