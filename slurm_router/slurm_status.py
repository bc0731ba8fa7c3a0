"""State of every task of a run, from squeue (live) and sacct (history); wait for, follow or cancel its jobs.

    python -m slurm_router.status runs/lora_ab/2024-01-01_12-00-00 [--wait] [--follow] [--cancel] [--json]
    python -m slurm_router.status [--run-root runs]          # the recent runs (slurm_router.run_list)

A task's state comes from squeue, else sacct, else its own files in the run dir (status_parse says why); its
progress (step/total, losses, tokens/s, ETA, retries) from its own files (slurm_router.task_progress).
Parsing is pure, in slurm_router.status_parse; this module queries, waits, follows, cancels and prints.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from slurm_router.config import UserError
from slurm_router.events import EVENT, EndRow
from slurm_router.launch.setup_lines import setup_failure
from slurm_router.layout import TaskPaths
from slurm_router.rundir import Manifest
from slurm_router.status_parse import (FAILED_STATES, LOCAL_STATES, SACCT_FIELDS, SQUEUE_FIELDS, SUCCESS_STATES,
                                       TERMINAL_STATES, Runner, SlurmRow, TaskStatus, expand_array_indices,
                                       format_duration, local_status, local_word, merge_status, never_runs,
                                       normalize_state, parse_duration, parse_sacct, parse_squeue, task_job_id)
from slurm_router.task_progress import read_progress

__all__ = ["FAILED_STATES", "LOCAL_STATES", "SACCT_FIELDS", "SQUEUE_FIELDS", "SUCCESS_STATES", "TERMINAL_STATES",
           "SlurmRow", "TaskStatus", "expand_array_indices", "format_duration", "local_status", "local_word",
           "merge_status", "never_runs", "normalize_state", "parse_duration", "parse_sacct", "parse_squeue",
           "task_job_id", "collect_status", "attach_progress", "live_tasks", "cancel_run", "cancel_never_runnable",
           "wait_for_run", "wait_for_job", "LogFollower", "follow_run", "task_json", "main"]

TAIL_LINES = 20
UNKNOWN_GRACE_S = 600.0     # a wait gives up on a task Slurm has had no record of for this long


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
    from slurm_router.launch.registry import LAUNCHERS
    launcher = LAUNCHERS.get(str(manifest.get("launcher")))
    return launcher is None or not launcher.synchronous


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
        if setup:               # the job ended in launcher.setup: the task itself never started
            t.reason = f"setup failed: {setup}"
    attach_progress(manifest, tasks)
    return tasks


def attach_progress(manifest: dict, tasks: list[TaskStatus]) -> None:
    """Each task's progress from its folder (task_progress: the newest rows, read from the end of its events);
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
    running launcher moves them: if it is gone (its pid and start time: runlock.owner_alive), or the run has
    ended (interrupted, failed), an unfinished task cannot progress and is shown so (terminal: --wait
    returns); resume= continues it."""
    from slurm_router.runlock import owner_alive
    try:
        manifest = Manifest.load(manifest["run_dir"]).data if manifest.get("run_dir") else manifest
    except UserError:                           # moved, or gone since: what the caller read is all there is
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


def cancel_never_runnable(manifest: dict, runner: Runner = run_command,
                          report_too: bool = False) -> tuple[list[TaskStatus], str | None]:
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


def wait_for_job(job_id: str, runner: Runner = run_command, poll_s: float = 5.0,
                 unknown_grace_s: float = UNKNOWN_GRACE_S) -> str:
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


class LogFollower:
    """--follow: the new complete lines of the tasks' logs (stdout, stderr), each prefixed with its task's name.
    A log met for the first time starts at its end if the task had already ended, with its last `backlog` lines
    if the task runs, from its start if it began since."""

    def __init__(self, out=sys.stdout, backlog: int = 10):
        self.out, self.backlog = out, backlog
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, bytes] = {}

    def poll(self, tasks: list[TaskStatus], first: bool = False) -> None:
        seen: set[str] = set()
        for t in tasks:
            for path, tag in ((t.log_path, t.variant), (t.err_path, f"{t.variant}:err")):
                if path and path not in seen:           # packed tasks share their array task's logs
                    seen.add(path)
                    start = "end" if first and t.terminal else "backlog" if first else "start"
                    self._read(path, tag, start)
        self.out.flush()

    def _read(self, path: str, tag: str, start: str) -> None:
        try:
            size = os.path.getsize(path)
        except OSError:
            return                                      # not written yet (a pending task)
        if path not in self.offsets:
            self.offsets[path] = (size if start == "end" else 0 if start == "start"
                                  else self._backlog_offset(path, size))
        offset = self.offsets[path] if size >= self.offsets[path] else 0        # truncated: from its start
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(size - offset)
        self.offsets[path] = offset + len(data)
        *lines, rest = (self.partial.pop(path, b"") + data).split(b"\n")
        if rest:
            self.partial[path] = rest
        for line in lines:
            print(f"[{tag}] {line.decode(errors='replace')}", file=self.out)

    def _backlog_offset(self, path: str, size: int) -> int:
        """Where the last `backlog` complete lines of the file start (looked for in its last 64 KiB)."""
        start = max(0, size - (64 << 10))
        with open(path, "rb") as f:
            f.seek(start)
            *complete, rest = f.read(size - start).split(b"\n")
        keep = complete[1 if start else 0:][-self.backlog:]     # a read from mid-file starts mid-line
        return size - len(rest) - sum(len(line) + 1 for line in keep)


def follow_run(manifest: dict, poll_s: float = 2.0, out=sys.stdout, runner: Runner = run_command,
               timeout_s: float | None = None) -> list[TaskStatus]:
    """--follow: print the tasks' new log lines until every task has ended (or timeout_s); the last statuses."""
    follower = LogFollower(out)
    first = True

    def show(tasks: list[TaskStatus]) -> None:
        nonlocal first
        follower.poll(tasks, first)
        first = False
    tasks = wait_for_run(manifest, runner, poll_s=poll_s, timeout_s=timeout_s, on_poll=show)
    follower.poll(tasks)                                # what was written between the last poll and the end
    return tasks


# ---------------------------------------------------------------- presentation


def _summary(tasks: list[TaskStatus]) -> str:
    counts: dict[str, int] = {}
    for t in tasks:
        counts[t.state] = counts.get(t.state, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no tasks"


def _steps(t: TaskStatus) -> str:
    """'7/12' (steps done of the task's total), '-/12' before its first step."""
    done, total = t.progress.step, t.progress.steps
    return "-" if done is None and total is None else f"{'-' if done is None else done}/{total or '?'}"


def render_table(manifest: dict, tasks: list[TaskStatus]) -> None:
    header = f"run {manifest.get('run_id', '?')} ({manifest.get('experiment', '?')}, launcher={manifest.get('launcher', '?')}): {_summary(tasks)}"
    columns = ("stage", "variant", "job", "state", "step", "ETA", "elapsed", "requeues", "exit", "node", "log")
    rows = [
        (t.stage, t.variant, t.job_id, t.state + (f" ({t.reason})" if t.reason else ""), _steps(t),
         format_duration(t.progress.eta_s), format_duration(t.elapsed_s), str(t.requeues), t.exit_code or "-",
         t.node or "-", t.log_path or "-")
        for t in tasks
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text fallback
        print(header)
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
        for r in (columns, *rows):
            print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    else:
        table = Table(title=header, title_justify="left")
        for c in columns:
            table.add_column(c, overflow="fold")
        colors = {"COMPLETED": "green", "CACHED": "green", "RUNNING": "cyan", "PENDING": "yellow"}
        for t, r in zip(tasks, rows):
            table.add_row(*r, style=colors.get(t.state, "red" if t.state in FAILED_STATES else None))
        Console(width=max(Console().width, 160) if not sys.stdout.isatty() else None).print(table)
    for reason in dict.fromkeys(t.reason for t in tasks if t.blocked):
        names = [t.variant for t in tasks if t.reason == reason]
        pending = any(never_runs(t) for t in tasks if t.reason == reason)
        print(f"\n{len(names)} task(s) never ran ({', '.join(names)}): {reason.split(': ', 1)[-1]}; fix the cause, "
              f"then python -m slurm_router resume={manifest.get('run_dir', 'RUN_DIR')} submits the failed stage "
              "and these again" + (" (it cancels these first: Slurm keeps them PENDING)" if pending else ""))
    for t in tasks:
        if t.out_tail or t.err_tail:
            print(f"\n--- {t.variant} ({t.job_id}) {t.state}: last {TAIL_LINES} lines of its logs")
            for label, lines in (("stdout", t.out_tail), ("stderr", t.err_tail)):
                if lines:
                    print(f"[{label}]")
                    print("\n".join(lines))


JSON_ORDER = ("task", "stage", "variant", "job_id", "state", "reason", "terminal", "step", "steps", "train_loss",
              "val_loss", "val_step", "tokens_per_s", "eta_s", "elapsed_s", "requeues", "attempts", "retry", "retries",
              "exit_code", "node", "log_path", "err_path", "out_tail", "err_tail")


def task_json(t: TaskStatus) -> dict:
    """One task as status --json prints it: Slurm's view (state, job_id, elapsed_s, requeues, exit_code, node,
    reason, log_path, err_path) and its progress (step, steps, train_loss, val_loss, val_step, tokens_per_s,
    eta_s, attempts, retries), flat."""
    fields = {**asdict(t), **asdict(t.progress), "task": t.variant, "retry": t.progress.retry_note,
              "terminal": t.terminal}
    return {k: fields[k] for k in JSON_ORDER}


def to_json(manifest: dict, tasks: list[TaskStatus]) -> str:
    return json.dumps(
        {
            "run_id": manifest.get("run_id"),
            "experiment": manifest.get("experiment"),
            "launcher": manifest.get("launcher"),
            "all_terminal": all(t.terminal for t in tasks),
            "all_completed": bool(tasks) and all(t.state in SUCCESS_STATES for t in tasks),
            "tasks": [task_json(t) for t in tasks],
        },
        indent=2,
    )


def stop_local_run(manifest: dict) -> str | None:
    """--cancel of a local run that is still going: SIGTERM to its launcher (its owner, checked by pid and start
    time), which stops it as Ctrl-C does (checkpoints at the step end, run interrupted). What was done, or None."""
    import signal

    from slurm_router.runlock import describe, owner_alive
    owner = manifest.get("owner")
    if manifest.get("state") not in ("running", None) or owner_alive(owner) is not True:
        return None
    try:
        os.kill(int(owner["pid"]), signal.SIGTERM)
    except ProcessLookupError:
        return None
    return (f"stopping the local run of {describe(owner)}: its tasks checkpoint at the step end; "
            f"resume={manifest.get('run_dir')} continues them")


def main(argv: list[str] | None = None) -> int:
    """python -m slurm_router.status [RUN_DIR] [--wait] [--follow] [--cancel] [--json] [--run-root DIR]"""
    parser = argparse.ArgumentParser(prog="python -m slurm_router.status", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", nargs="?", help="a run directory (holds manifest.json); without it, the recent "
                        "runs under --run-root")
    parser.add_argument("--run-root", default="runs", help="where runs are (the config's run_root; default runs)")
    parser.add_argument("--limit", type=int, default=20, help="without RUN_DIR: the newest this many runs")
    parser.add_argument("--wait", action="store_true", help="poll until every task ended; exit 0 only if all COMPLETED")
    parser.add_argument("--follow", action="store_true",
                        help="print the tasks' log lines as they come, each prefixed with its task's name, until "
                             "every task ended; exit 0 only if all COMPLETED")
    parser.add_argument("--cancel", action="store_true",
                        help="scancel this run's jobs (only its own job ids); a local run: stop it as Ctrl-C does")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    parser.add_argument("--poll-s", type=float, default=5.0, help="seconds between polls with --wait (default 5)")
    parser.add_argument("--timeout-s", type=float, default=None, help="give up waiting after this long (exit 1)")
    args = parser.parse_args(argv)
    try:
        if args.run_dir is None:
            from slurm_router.run_list import print_runs
            print_runs(args.run_root, args.limit, as_json=args.json)
            return 0
        manifest = Manifest.load(args.run_dir).data
    except UserError as exc:                    # NotARunDir: one line, exit 2, as every bad input
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.cancel:
        ids = cancel_run(manifest)
        stopped = None if ids else stop_local_run(manifest)
        print(f"scancel {' '.join(ids)}" if ids else stopped or "nothing to cancel", file=sys.stderr)
    if args.follow:
        tasks = follow_run(manifest, poll_s=args.poll_s, timeout_s=args.timeout_s)
        print(f"run {manifest.get('run_id', '?')}: {_summary(tasks)}", file=sys.stderr)
        return 0 if tasks and all(t.state in SUCCESS_STATES for t in tasks) else 1
    if args.wait:
        def progress(tasks: list[TaskStatus]) -> None:
            print(f"[{time.strftime('%H:%M:%S')}] {_summary(tasks)}", file=sys.stderr, flush=True)

        tasks = wait_for_run(manifest, poll_s=args.poll_s, timeout_s=args.timeout_s, on_poll=progress)
    else:
        tasks = collect_status(manifest)
    if args.json:
        print(to_json(manifest, tasks))
    else:
        render_table(manifest, tasks)
    if args.wait:
        return 0 if tasks and all(t.state in SUCCESS_STATES for t in tasks) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
