"""State of every task of a run, from squeue (live) and sacct (history); wait for, follow or cancel its jobs.

The command that prints them: slurm_router.cli.status (python -m slurm_router.status RUN_DIR).

A task's state comes from squeue, else sacct, else its own files in the run dir (launch/slurm/parse.py says why); its
progress (step/total, losses, tokens/s, ETA, retries) from its own files (slurm_router.rundir.progress).
Parsing is pure, in slurm_router.launch.slurm.parse; this module queries, waits and cancels.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Callable

from slurm_router.config.schema import LAUNCHER_SCHEMAS, SlurmLauncherConfig
from slurm_router.errors import UserError
from slurm_router.launch.slurm.parse import (
    FAILED_STATES,
    LOCAL_STATES,
    SACCT_FIELDS,
    SQUEUE_FIELDS,
    SUCCESS_STATES,
    TERMINAL_STATES,
    Runner,
    SlurmRow,
    TaskStatus,
    expand_array_indices,
    format_duration,
    local_status,
    local_word,
    merge_status,
    never_runs,
    normalize_state,
    parse_duration,
    parse_sacct,
    parse_squeue,
    task_job_id,
)
from slurm_router.rundir.events import EVENT, EndRow
from slurm_router.rundir.layout import TaskPaths
from slurm_router.rundir.manifest import Manifest
from slurm_router.rundir.progress import read_progress, setup_failure

__all__ = [
    "FAILED_STATES",
    "LOCAL_STATES",
    "SACCT_FIELDS",
    "SQUEUE_FIELDS",
    "SUCCESS_STATES",
    "TERMINAL_STATES",
    "SlurmRow",
    "TaskStatus",
    "expand_array_indices",
    "format_duration",
    "local_status",
    "local_word",
    "merge_status",
    "never_runs",
    "normalize_state",
    "parse_duration",
    "parse_sacct",
    "parse_squeue",
    "task_job_id",
    "collect_status",
    "attach_progress",
    "live_tasks",
    "cancel_run",
    "cancel_never_runnable",
    "wait_for_run",
    "wait_for_job",
]

TAIL_LINES = 20
UNKNOWN_GRACE_S = 600.0  # a wait gives up on a task Slurm has had no record of for this long


# ---------------------------------------------------------------- I/O


def run_command(argv: list[str]) -> str:
    """stdout of argv, or "" when it fails or is not installed (a purged job makes squeue exit 1)."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def job_ids(manifest: dict) -> list[str]:
    return [str(job["job_id"]) for job in manifest.get("jobs", []) if job.get("job_id")]


def tail(path: str | None, n: int = TAIL_LINES) -> list[str]:
    if not path:
        return []
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in f.readlines()[-n:]]
    except OSError:
        return []


def in_slurm(manifest: dict) -> bool:
    """Slurm ran (or runs) this run's tasks: their states are Slurm's; else the manifest's own (local)."""
    kind = str(manifest.get("launcher"))
    schema = next((s for s in LAUNCHER_SCHEMAS if s.kind == kind), None)
    return schema is None or issubclass(schema, SlurmLauncherConfig)


def query_slurm(ids: str, runner: Runner = run_command) -> tuple[dict[str, SlurmRow], dict[str, SlurmRow]]:
    """squeue's and sacct's rows for these job ids (comma-separated), keyed by task id (123_4)."""
    squeue = runner(["squeue", "-h", "-t", "all", "-j", ids, "-O", ",".join(f"{f}:|" for f in SQUEUE_FIELDS)])
    sacct = runner(["sacct", "-X", "-D", "-n", "--parsable2", "-j", ids, "--format=" + ",".join(SACCT_FIELDS)])
    return parse_squeue(squeue), parse_sacct(sacct)


def collect_status(manifest: dict, runner: Runner = run_command) -> list[TaskStatus]:
    """Query Slurm for the manifest's jobs and return one TaskStatus per task (log tails for failures)."""
    if not in_slurm(manifest):
        tasks = local_tasks(manifest)
    else:
        ids = ",".join(job_ids(manifest))
        squeue, sacct = query_slurm(ids, runner) if ids else ({}, {})
        tasks = merge_status(manifest, squeue, sacct)
        for t in tasks:
            if t.state == "UNKNOWN":
                _state_from_run_dir(manifest, t)
    for t in tasks:
        if t.state in FAILED_STATES:
            t.out_tail, t.err_tail = tail(t.log_path), tail(t.err_path)
        setup = setup_failure(manifest.get("run_dir"), t.job_id) if t.state == "FAILED" else None
        if setup:  # the job ended in launcher.setup: the task itself never started
            t.reason = f"setup failed: {setup}"
    attach_progress(manifest, tasks)
    return tasks


def attach_progress(manifest: dict, tasks: list[TaskStatus]) -> None:
    """Each task's progress from its folder (rundir.progress: the newest rows, read from the end of its events);
    requeues counted from its starts too (attempts.json: a requeue Slurm forgot, a resume); a retry
    (launcher.max_failures) said in its reason."""
    infos = manifest.get("tasks") or {}
    for t in tasks:
        task_dir = (infos.get(t.variant) or {}).get("task_dir") if isinstance(infos, dict) else None
        if not task_dir:
            continue
        t.progress = read_progress(task_dir, running=t.state == "RUNNING")
        t.requeues = max(t.requeues, t.progress.attempts - 1)
        note = t.progress.retry_note
        if note and note not in (t.reason or ""):
            t.reason = f"{t.reason}; {note}" if t.reason else note


def local_tasks(manifest: dict) -> list[TaskStatus]:
    """A local run's tasks as its manifest records them now (read again: a --wait sees them move). Only a
    running launcher moves them: if it is gone (its pid and start time: rundir.lock.owner_alive), or the run has
    ended (interrupted, failed), an unfinished task cannot progress and is shown so (terminal: --wait
    returns); resume= continues it."""
    from slurm_router.rundir.lock import owner_alive

    try:
        manifest = Manifest.load(manifest["run_dir"]).data if manifest.get("run_dir") else manifest
    except UserError:  # moved, or gone since: what the caller read is all there is
        pass
    tasks = local_status(manifest)
    infos = manifest.get("tasks") or {}
    infos = list(infos.values()) if isinstance(infos, dict) else list(infos)
    run_state, owner = manifest.get("state", "running"), manifest.get("owner") or {}
    if run_state != "running":
        stuck = f"not run: the run is {run_state}"
    elif owner_alive(owner) is False:
        stuck = f"interrupted: launcher pid {owner.get('pid')} gone"
    else:
        stuck = None
    for t, info in zip(tasks, infos):
        note = info.get("note") if isinstance(info, dict) else None
        if stuck and not t.terminal:
            t.state, note = "CANCELLED", stuck
        t.reason = t.reason or note
    return tasks


def _state_from_run_dir(manifest: dict, t: TaskStatus) -> None:
    """Slurm knows nothing of the task (purged from squeue after MinJobAge, and no accounting): its own files
    still tell how it ended, if it did: result.json, or the `end` row of its events."""
    task_dir = ((manifest.get("tasks") or {}).get(t.variant) or {}).get("task_dir")
    if not task_dir:
        return
    paths = TaskPaths(Path(task_dir))
    if paths.result.is_file():
        t.state, t.reason = "COMPLETED", "from the run dir: Slurm has no record of the job"
        return
    for line in reversed(tail(str(paths.events(0)), 5)):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get(EVENT) == EndRow.KIND and row.get("exit_state") == "failed":
            t.state, t.reason = "FAILED", "from the run dir: Slurm has no record of the job"
        return


def live_tasks(manifest: dict, runner: Runner = run_command) -> list[TaskStatus]:
    """Tasks of a Slurm run that Slurm still holds (pending, running, requeued, suspended...)."""
    if not in_slurm(manifest) or not job_ids(manifest):
        return []
    return [t for t in collect_status(manifest, runner) if not t.terminal and t.state != "UNKNOWN"]


def cancel_run(manifest: dict, runner: Runner = run_command) -> list[str]:
    """scancel this run's jobs (only its own ids); returns the ids cancelled."""
    ids = job_ids(manifest) if in_slurm(manifest) else []
    if ids:
        runner(["scancel", *ids])
    return ids


def cancel_never_runnable(
    manifest: dict, runner: Runner = run_command, report_too: bool = False
) -> tuple[list[TaskStatus], str | None]:
    """scancel the tasks Slurm keeps PENDING on a dependency that can never be satisfied (a stage they wait on
    failed; submitted before --kill-on-invalid-dep, or a cluster that ignores it). report_too (resume=): the
    run's report job as well if it still waits, since it would start once they are cancelled and write a report
    of a run that goes on. Returns (the tasks cancelled, the report job cancelled or None)."""
    if not in_slurm(manifest) or not job_ids(manifest):
        return [], None
    stuck = [t for t in collect_status(manifest, runner) if never_runs(t)]
    if not stuck:
        return [], None
    report = str(manifest.get("report_job_id") or "") if report_too else ""
    if report:
        squeue, sacct = query_slurm(report, runner)
        row = squeue.get(report) or sacct.get(report)
        report = report if row is not None and row.state not in TERMINAL_STATES else ""
    runner(["scancel", *([report] if report else []), *(t.job_id for t in stuck)])
    return stuck, report or None


def wait_for_run(
    manifest: dict,
    runner: Runner = run_command,
    poll_s: float = 5.0,
    timeout_s: float | None = None,
    on_poll: Callable[[list[TaskStatus]], None] | None = None,
    unknown_grace_s: float = UNKNOWN_GRACE_S,
) -> list[TaskStatus]:
    """Poll until every task is terminal (or timeout_s passes); returns the last statuses. A task Slurm has
    had no record of for unknown_grace_s (and whose run dir says nothing) counts as ended, as UNKNOWN: a
    wait must not outlive a job that squeue has forgotten on a cluster without accounting."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    unknown_since: dict[str, float] = {}
    while True:
        tasks = collect_status(manifest, runner)
        now = time.monotonic()
        for t in tasks:
            if t.state == "UNKNOWN":
                unknown_since.setdefault(t.job_id, now)
            else:
                unknown_since.pop(t.job_id, None)
        if on_poll:
            on_poll(tasks)
        lost = {j for j, since in unknown_since.items() if now - since >= unknown_grace_s}
        if all(t.terminal or t.job_id in lost for t in tasks) or (deadline is not None and now >= deadline):
            for t in tasks:
                if t.job_id in lost:
                    t.reason = f"no record in squeue, sacct or the run dir for {unknown_grace_s:.0f} s"
            return tasks
        time.sleep(poll_s)


def wait_for_job(
    job_id: str, runner: Runner = run_command, poll_s: float = 5.0, unknown_grace_s: float = UNKNOWN_GRACE_S
) -> str:
    """Poll one plain job (the run's report job) until it has ended; its final state (UNKNOWN if Slurm kept
    no record of it for unknown_grace_s)."""
    since = time.monotonic()
    while True:
        squeue, sacct = query_slurm(job_id, runner)
        row = squeue.get(job_id) or sacct.get(job_id)
        if row is not None and row.state in TERMINAL_STATES:
            return row.state
        if row is not None and never_runs(row):
            return f"{row.state} ({row.reason})"
        if row is None and time.monotonic() - since >= unknown_grace_s:
            return "UNKNOWN"
        time.sleep(poll_s)
