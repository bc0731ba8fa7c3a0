"""python -m slurm_router.status [RUN_DIR] [--wait] [--follow] [--cancel] [--json] [--run-root DIR]: each task's
state, progress and log tail, as a table or JSON; wait for, follow or cancel a run's tasks. The states come
from the run's launcher backend (slurm_router.backends.slurm.queries: squeue, sacct, or a local run's manifest);
without RUN_DIR the recent runs (slurm_router.cli.run_list)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

from slurm_router.errors import SchedulerUnavailable, UserError
from slurm_router.launch.base import Launcher
from slurm_router.rundir.manifest import Manifest
from slurm_router.rundir.progress import decided_state
from slurm_router.scheduler.registry import launcher_class
from slurm_router.scheduler.task_view import (
    FAILED_STATES,
    SUCCESS_STATES,
    TAIL_LINES,
    TaskView,
    describe,
    format_duration,
    never_runs,
    poll,
)


class LogFollower:
    """--follow: the new complete lines of the tasks' logs (stdout, stderr), each prefixed with its task's name.
    A log met for the first time starts at its end if the task had already ended, with its last `backlog` lines
    if the task runs, from its start if it began since."""

    def __init__(self, out=sys.stdout, backlog: int = 10):
        self.out, self.backlog = out, backlog
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, bytes] = {}

    def poll(self, tasks: list[TaskView], first: bool = False) -> None:
        seen: set[str] = set()
        for t in tasks:
            for path, tag in ((t.log_path, t.variant), (t.err_path, f"{t.variant}:err")):
                if path and path not in seen:  # co-located tasks share their array task's logs
                    seen.add(path)
                    start = "end" if first and t.terminal else "backlog" if first else "start"
                    self._read(path, tag, start)
        self.out.flush()

    def _read(self, path: str, tag: str, start: str) -> None:
        try:
            size = os.path.getsize(path)
        except OSError:
            return  # not written yet (a pending task)
        if path not in self.offsets:
            self.offsets[path] = size if start == "end" else 0 if start == "start" else self._backlog_offset(path, size)
        offset = self.offsets[path] if size >= self.offsets[path] else 0  # truncated: from its start
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
        keep = complete[1 if start else 0 :][-self.backlog :]  # a read from mid-file starts mid-line
        return size - len(rest) - sum(len(line) + 1 for line in keep)


def run_launcher(manifest: dict) -> type[Launcher]:
    """The launcher that ran this run: the one its task states and --cancel go through (a manifest from before
    the launcher was recorded: Slurm's, whose queries also read the run dir)."""
    return launcher_class(str(manifest.get("launcher") or "slurm"))


def collect(manifest: dict) -> list[TaskView]:
    """Each task's state from the run's launcher, with its logs and progress."""
    return describe(manifest, run_launcher(manifest).task_states(manifest))


def follow_run(manifest: dict, poll_s: float = 2.0, out=sys.stdout, timeout_s: float | None = None) -> list[TaskView]:
    """--follow: print the tasks' new log lines until every task has ended (or timeout_s); the last statuses."""
    follower = LogFollower(out)
    first = True

    def show(tasks: list[TaskView]) -> None:
        nonlocal first
        follower.poll(tasks, first)
        first = False

    tasks = poll(lambda: collect(manifest), poll_s=poll_s, timeout_s=timeout_s, on_poll=show, min_s=floor_s(manifest))
    follower.poll(tasks)  # what was written between the last poll and the end
    return tasks


# ---------------------------------------------------------------- presentation


def shown_state(t: TaskView) -> str:
    """The task's state as a user reads it: PRUNED, STOPPED or NOT_NEEDED for one the run's decision ended (the
    scheduler says COMPLETED: it exited 0), else the scheduler's word."""
    return (t.state == "COMPLETED" and decided_state(t.progress.ended_as)) or t.state


def _summary(tasks: list[TaskView]) -> str:
    counts: dict[str, int] = {}
    for t in tasks:
        counts[shown_state(t)] = counts.get(shown_state(t), 0) + 1
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no tasks"


def _steps(t: TaskView) -> str:
    """'7/12' (steps done of the task's total), '-/12' before its first step."""
    done, total = t.progress.step, t.progress.steps
    return "-" if done is None and total is None else f"{'-' if done is None else done}/{total or '?'}"


def render_table(manifest: dict, tasks: list[TaskView]) -> None:
    header = f"run {manifest.get('run_id', '?')} ({manifest.get('experiment', '?')}, launcher={manifest.get('launcher', '?')}): {_summary(tasks)}"
    columns = ("stage", "variant", "job", "state", "step", "ETA", "elapsed", "requeues", "exit", "node", "log")
    rows = [
        (
            t.stage,
            t.variant,
            t.job_id,
            shown_state(t) + "".join(f" ({note})" for note in (t.progress.ended_as, t.reason) if note),
            _steps(t),
            format_duration(t.progress.eta_s),
            format_duration(t.elapsed_s),
            str(t.requeues),
            t.exit_code or "-",
            t.node or "-",
            t.log_path or "-",
        )
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
        colors = {
            "COMPLETED": "green",
            "CACHED": "green",
            "PRUNED": "green",
            "STOPPED": "green",
            "NOT_NEEDED": "green",
            "RUNNING": "cyan",
            "PENDING": "yellow",
            "INTERRUPTED": "yellow",
        }
        for t, r in zip(tasks, rows):
            table.add_row(*r, style=colors.get(shown_state(t), "red" if t.state in FAILED_STATES else None))
        Console(width=max(Console().width, 160) if not sys.stdout.isatty() else None).print(table)
    for reason in dict.fromkeys(t.reason for t in tasks if t.blocked):
        assert reason is not None
        names = [t.variant for t in tasks if t.reason == reason]
        pending = any(never_runs(t) for t in tasks if t.reason == reason)
        print(
            f"\n{len(names)} task(s) never ran ({', '.join(names)}): {reason.split(': ', 1)[-1]}; fix the cause, "
            f"then python -m slurm_router resume={manifest.get('run_dir', 'RUN_DIR')} submits the failed stage "
            "and these again" + (" (it cancels these first: Slurm keeps them PENDING)" if pending else "")
        )
    for t in tasks:
        if t.out_tail or t.err_tail:
            print(f"\n--- {t.variant} ({t.job_id}) {t.state}: last {TAIL_LINES} lines of its logs")
            for label, lines in (("stdout", t.out_tail), ("stderr", t.err_tail)):
                if lines:
                    print(f"[{label}]")
                    print("\n".join(lines))


JSON_ORDER = (
    "task",
    "stage",
    "variant",
    "job_id",
    "state",
    "ended_as",
    "reason",
    "terminal",
    "step",
    "steps",
    "train_loss",
    "val_loss",
    "val_step",
    "tokens_per_s",
    "pace_tokens_per_s",
    "eta_s",
    "elapsed_s",
    "requeues",
    "attempts",
    "retry",
    "retries",
    "exit_code",
    "exit_signal",
    "node",
    "log_path",
    "err_path",
    "out_tail",
    "err_tail",
)


def task_json(t: TaskView) -> dict:
    """One task as status --json prints it: Slurm's view (state, job_id, elapsed_s, requeues, exit_code, node,
    reason, log_path, err_path) and its progress (step, steps, train_loss, val_loss, val_step, tokens_per_s: the
    report's figure, rundir/throughput.py; pace_tokens_per_s: the newest steps' wall time, which eta_s uses; eta_s,
    attempts, retries), flat."""
    code, signal = exit_status(t.exit_code)
    fields = {
        **asdict(t),
        **asdict(t.progress),
        "task": t.variant,
        "retry": t.progress.retry_note,
        "terminal": t.terminal,
        "exit_code": code,
        "exit_signal": signal,
    }
    # JSON's own types: null where there is nothing (never "-" or ""), numbers as numbers
    return {k: None if fields[k] in ("-", "") else fields[k] for k in JSON_ORDER}


def exit_status(raw: str | int | None) -> tuple[int | None, int | None]:
    """(exit code, signal) as numbers: sacct's '1:0' and '0:15', the local launcher's '75'; None where unknown."""
    if raw is None or str(raw).strip() in ("", "-"):
        return None, None
    head, _, signal = str(raw).strip().partition(":")
    try:
        return int(head), int(signal) if signal else None
    except ValueError:
        return None, None


def to_json(manifest: dict, tasks: list[TaskView]) -> str:
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


def _previewed(manifest: dict, as_json: bool) -> int:
    """A dry_run=true run dir: its plan, never submitted (exit 0: nothing failed, nothing to wait for)."""
    run_dir, tasks = manifest.get("run_dir"), list(manifest.get("tasks") or {})
    if as_json:
        print(
            json.dumps(
                {
                    "run_id": manifest.get("run_id"),
                    "run_dir": run_dir,
                    "state": "previewed",
                    "submitted": False,
                    "preview": manifest.get("preview"),
                    "tasks": tasks,
                },
                indent=1,
            )
        )
        return 0
    print(
        f"{run_dir}: a dry_run=true preview, never submitted: none of its {len(tasks)} task(s) "
        f"({', '.join(tasks)}) ran or was queued; the plan is in {manifest.get('preview')}; to run it, the same "
        "command without dry_run=true"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """python -m slurm_router.status [RUN_DIR] [--wait] [--follow] [--cancel] [--json] [--run-root DIR]"""
    try:
        return _main(argv)
    except SchedulerUnavailable as e:  # a one-shot status, a --cancel: the controller never answered
        print(f"error: {e}", file=sys.stderr)
        return 75


def floor_s(manifest: dict) -> float:
    """The shortest interval between polls: the run's scheduler's floor (scheduler/registry.py); none locally."""
    from slurm_router.scheduler.registry import run_backend

    return run_backend(manifest).poll_floor_s()


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm_router.status", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "run_dir", nargs="?", help="a run directory (holds manifest.json); without it, the recent runs under --run-root"
    )
    parser.add_argument("--run-root", default="runs", help="where runs are (the config's run_root; default runs)")
    parser.add_argument("--limit", type=int, default=20, help="without RUN_DIR: the newest this many runs")
    parser.add_argument(
        "--previews", action="store_true", help="without RUN_DIR: list dry_run=true previews too (left out by default)"
    )
    parser.add_argument(
        "--clean-previews",
        action="store_true",
        help="without RUN_DIR: delete the dry_run=true previews under --run-root",
    )
    parser.add_argument("--wait", action="store_true", help="poll until every task ended; exit 0 only if all COMPLETED")
    parser.add_argument(
        "--follow",
        action="store_true",
        help="print the tasks' log lines as they come, each prefixed with its task's name, until "
        "every task ended; exit 0 only if all COMPLETED",
    )
    parser.add_argument(
        "--cancel",
        action="store_true",
        help="cancel this run's jobs, only its own job ids (Slurm: scancel); a local run: stop it as Ctrl-C does",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    parser.add_argument("--poll-s", type=float, default=5.0, help="seconds between polls with --wait (default 5)")
    parser.add_argument("--timeout-s", type=float, default=None, help="give up waiting after this long (exit 1)")
    args = parser.parse_args(argv)
    try:
        if args.run_dir is None:
            from slurm_router.cli.run_list import clean_previews, print_runs

            if args.clean_previews:
                clean_previews(args.run_root)
                return 0
            print_runs(args.run_root, args.limit, as_json=args.json, previews=args.previews)
            return 0
        manifest = Manifest.load(args.run_dir).data
    except UserError as exc:  # NotARunDir: one line, exit 2, as every bad input
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if manifest.get("state") == "previewed":  # dry_run=true (launch/preview.py): no task ever ran or was queued
        return _previewed(manifest, args.json)
    if args.cancel:
        print(run_launcher(manifest).cancel(manifest) or "nothing to cancel", file=sys.stderr)
    if args.follow:
        tasks = follow_run(manifest, poll_s=args.poll_s, timeout_s=args.timeout_s)
        print(f"run {manifest.get('run_id', '?')}: {_summary(tasks)}", file=sys.stderr)
        return 0 if tasks and all(t.state in SUCCESS_STATES for t in tasks) else 1
    if args.wait:

        def progress(tasks: list[TaskView]) -> None:
            print(f"[{time.strftime('%H:%M:%S')}] {_summary(tasks)}", file=sys.stderr, flush=True)

        tasks = poll(
            lambda: collect(manifest),
            poll_s=args.poll_s,
            timeout_s=args.timeout_s,
            on_poll=progress,
            min_s=floor_s(manifest),
        )
    else:
        tasks = collect(manifest)
    if args.json:
        print(to_json(manifest, tasks))
    else:
        render_table(manifest, tasks)
    if args.wait:
        return 0 if tasks and all(t.state in SUCCESS_STATES for t in tasks) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
