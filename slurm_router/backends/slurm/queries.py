"""State of every task of a run, from squeue (live) and sacct (history); wait for, follow or cancel its jobs.

The command that prints them: slurm_router.cli.status (python -m slurm_router.status RUN_DIR).

A task's state comes from squeue, else sacct, else its own files in the run dir (backends/slurm/parse.py says why); its
progress (step/total, losses, tokens/s, ETA, retries) from its own files (slurm_router.rundir.progress).
Parsing is pure, in slurm_router.backends.slurm.parse; this module queries, waits and cancels.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

from slurm_router.backends.slurm.commands import poll_floor_s, run_command
from slurm_router.backends.slurm.config import SlurmLauncherConfig
from slurm_router.backends.slurm.parse import (
    SACCT_FIELDS,
    SQUEUE_FIELDS,
    Expect,
    Runner,
    expand_array_indices,
    expected_jobs,
    merge_status,
    mirror_fused,
    parse_duration,
    parse_sacct,
    parse_squeue,
    task_job_id,
)
from slurm_router.config.schema import LAUNCHER_SCHEMAS
from slurm_router.errors import SchedulerUnavailable
from slurm_router.rundir.events import EVENT, EndRow
from slurm_router.rundir.layout import TaskPaths
from slurm_router.scheduler.task_view import (
    FAILED_STATES,
    LOCAL_STATES,
    SUCCESS_STATES,
    TAIL_LINES,
    TERMINAL_STATES,
    UNKNOWN_GRACE_S,
    SchedulerRow,
    TaskView,
    attach_progress,
    describe,
    format_duration,
    local_status,
    local_tasks,
    local_word,
    never_runs,
    normalize_state,
    poll,
    poll_interval,
    tail,
)

__all__ = [
    "FAILED_STATES",
    "LOCAL_STATES",
    "SACCT_FIELDS",
    "SQUEUE_FIELDS",
    "SUCCESS_STATES",
    "TERMINAL_STATES",
    "TAIL_LINES",
    "SchedulerRow",
    "TaskView",
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
    "run_command",
]


# ---------------------------------------------------------------- I/O


def job_ids(manifest: dict) -> list[str]:
    return [str(job["job_id"]) for job in manifest.get("jobs", []) if job.get("job_id")]


def task_keys(manifest: dict) -> list[str]:
    """The Slurm id of every task the manifest's jobs hold (123_4), as squeue keys its rows."""
    return [task_job_id(job, task) for job in manifest.get("jobs", []) for task in job.get("tasks", [])]


def in_slurm(manifest: dict) -> bool:
    """Slurm ran (or runs) this run's tasks: their states are Slurm's; else the manifest's own (local)."""
    kind = str(manifest.get("launcher"))
    schema = next((s for s in LAUNCHER_SCHEMAS if s.kind == kind), None)
    return schema is None or issubclass(schema, SlurmLauncherConfig)


def query_slurm(
    ids: str, runner: Runner = run_command, wanted: list[str] | None = None, expect: Expect | None = None
) -> tuple[dict[str, SchedulerRow], dict[str, SchedulerRow]]:
    """squeue's and sacct's rows for these job ids (comma-separated), keyed by task id (123_4): one call of each
    for all of them, whatever their number. sacct is not asked when squeue holds every task of `wanted` and none
    of them has ended (its history adds nothing then, and it is the controller's costlier query)."""
    squeue = parse_squeue(
        runner(["squeue", "-h", "-t", "all", "-j", ids, "-O", ",".join(f"{f}:|" for f in SQUEUE_FIELDS)]), expect
    )
    if wanted and all(k in squeue and not squeue[k].foreign and squeue[k].state not in TERMINAL_STATES for k in wanted):
        return squeue, {}
    sacct = runner(["sacct", "-X", "-D", "-n", "--parsable2", "-j", ids, "--format=" + ",".join(SACCT_FIELDS)])
    return squeue, parse_sacct(sacct, expect)


def slurm_states(manifest: dict, runner: Runner = run_command) -> list[TaskView]:
    """The Slurm launchers' Launcher.task_states: squeue and sacct for the manifest's own jobs, and, for a task
    Slurm has no record of, what its run dir says."""
    ids = ",".join(job_ids(manifest))
    squeue, sacct = query_slurm(ids, runner, task_keys(manifest), expected_jobs(manifest)) if ids else ({}, {})
    tasks = merge_status(manifest, squeue, sacct)
    for t in tasks:
        if t.state == "UNKNOWN":
            _state_from_run_dir(manifest, t)
    return mirror_fused(manifest, tasks)


def collect_status(manifest: dict, runner: Runner = run_command) -> list[TaskView]:
    """One TaskView per task, described (task_view.describe): from Slurm for a Slurm run, else the
    manifest's (what python -m slurm_router.status asks through the run's launcher)."""
    return describe(manifest, slurm_states(manifest, runner) if in_slurm(manifest) else local_tasks(manifest))


def _state_from_run_dir(manifest: dict, t: TaskView) -> None:
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


def live_tasks(manifest: dict, runner: Runner = run_command) -> list[TaskView]:
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
) -> tuple[list[TaskView], str | None]:
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
    runner(["scancel", *([report] if report else []), *dict.fromkeys(t.job_id for t in stuck)])  # fused: one job
    return stuck, report or None


def wait_for_run(
    manifest: dict,
    runner: Runner = run_command,
    poll_s: float = 5.0,
    timeout_s: float | None = None,
    on_poll: Callable[[list[TaskView]], None] | None = None,
    unknown_grace_s: float = UNKNOWN_GRACE_S,
) -> list[TaskView]:
    """Poll until every task is terminal (task_view.poll, over collect_status), never faster than the floor."""
    return poll(lambda: collect_status(manifest, runner), poll_s, timeout_s, on_poll, unknown_grace_s, poll_floor_s())


def wait_for_job(
    job_id: str, runner: Runner = run_command, poll_s: float = 5.0, unknown_grace_s: float = UNKNOWN_GRACE_S
) -> str:
    """Poll one plain job (the run's report job) until it has ended; its final state (UNKNOWN if Slurm kept
    no record of it for unknown_grace_s)."""
    since = time.monotonic()
    while True:
        asked = time.monotonic()
        try:
            squeue, sacct = query_slurm(job_id, runner, [job_id])
        except SchedulerUnavailable as e:  # the job runs on without the controller: ask again later
            print(f"{e.what}: asking again", file=sys.stderr, flush=True)
            squeue, sacct = {}, {}
            since = time.monotonic()  # no answer is not "no record"
        row = squeue.get(job_id) or sacct.get(job_id)
        if row is not None and row.state in TERMINAL_STATES:
            return row.state
        if row is not None and never_runs(row):
            return f"{row.state} ({row.reason})"
        if row is None and time.monotonic() - since >= unknown_grace_s:
            return "UNKNOWN"
        time.sleep(poll_interval(poll_s, poll_floor_s(), time.monotonic() - asked))
