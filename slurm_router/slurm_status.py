"""State of every task of a run, from squeue (live) and sacct (history); wait for or cancel its jobs.

    python -m slurm_router.status runs/lora_ab/2024-01-01_12-00-00 [--wait] [--cancel] [--json]

Sources, and why both: squeue -t all is the controller's truth for pending, running and recently ended
tasks (kept for MinJobAge) but forgets older ones; sacct keeps history, exit codes and requeued attempts,
but lags the controller by a few seconds and, right after submission, may hold only a bare record under
the array's base id (e.g. `15`, or `15` named "allocation") that belongs to no particular task yet.
So a task's state comes from squeue when it has a row, else from sacct rows naming exactly that task
(`15_3`, or `15` for a job that is not an array), else UNKNOWN (never guessed COMPLETED).
Parsing below is pure and unit-tested on outputs captured from Slurm 22.05 (tests/golden/slurm_outputs).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

# CACHED is ours, not Slurm's: a task whose result an earlier run already produced (nothing submitted).
SUCCESS_STATES = frozenset({"COMPLETED", "CACHED"})
FAILED_STATES = frozenset(
    {"FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "CANCELLED", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
     "REVOKED"}
)
TERMINAL_STATES = SUCCESS_STATES | FAILED_STATES
# States the local launcher writes into manifest["tasks"], in Slurm's words.
LOCAL_STATES = {"pending": "PENDING", "running": "RUNNING", "completed": "COMPLETED", "done": "COMPLETED",
                "cached": "CACHED", "failed": "FAILED", "interrupted": "CANCELLED", "cancelled": "CANCELLED",
                "oom": "OUT_OF_MEMORY", "timeout": "TIMEOUT"}
TAIL_LINES = 20
UNKNOWN_GRACE_S = 600.0     # a wait gives up on a task Slurm has had no record of for this long

SQUEUE_FIELDS = ("JobArrayID", "State", "TimeUsed", "RestartCnt", "NodeList", "Reason")
# 22.05's sacct has no Restarts field: requeues are counted from the REQUEUED rows that -D shows.
SACCT_FIELDS = ("JobID", "JobIDRaw", "State", "ExitCode", "Elapsed", "NodeList", "Start", "End")

Runner = Callable[[list[str]], str]  # runs a command, returns stdout ("" when it fails)


class RunDirError(Exception):
    """RUN_DIR is missing or holds no readable manifest.json."""


@dataclass
class SlurmRow:
    state: str
    elapsed_s: int | None = None
    requeues: int = 0
    exit_code: str | None = None
    node: str | None = None
    reason: str | None = None


@dataclass(kw_only=True)
class TaskStatus(SlurmRow):
    """One task of a run: what Slurm (or the local launcher) says of it, plus where it sits in the run."""

    stage: str
    variant: str
    job_id: str  # the task's Slurm id: 123_4 for array task 4, 123 for a plain job
    log_path: str | None = None
    err_path: str | None = None
    out_tail: list[str] = field(default_factory=list)
    err_tail: list[str] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES


# ---------------------------------------------------------------- pure parsing


def normalize_state(raw: str) -> str:
    """'CANCELLED by 0' -> 'CANCELLED'; 'COMPLETED+' -> 'COMPLETED'; '' -> 'UNKNOWN'."""
    word = raw.strip().split(" ")[0].rstrip("+") if raw.strip() else ""
    return word.upper() or "UNKNOWN"


def parse_duration(text: str) -> int | None:
    """Slurm durations ([D-]H:MM:SS, MM:SS, M:SS) -> seconds; INVALID/empty -> None."""
    text = text.strip()
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def format_duration(seconds: int | None) -> str:
    if seconds is None:
        return "-"
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"


def expand_array_indices(spec: str) -> list[int]:
    """'0-5%2' / '1,3-4' / '0-8:4' -> task indices (the %P throttle is dropped)."""
    out: list[int] = []
    for part in spec.split("%")[0].split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part.strip())
        if not m:
            continue
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        out.extend(range(lo, hi + 1, int(m.group(3) or 1)))
    return out


def _task_keys(job_id_field: str) -> list[str]:
    """'15_3' -> ['15_3']; '15_[0-5%2]' -> ['15_0', ..., '15_5']; '15' -> ['15']."""
    m = re.fullmatch(r"(\d+)_\[(.+)\]", job_id_field)
    if m:
        return [f"{m.group(1)}_{i}" for i in expand_array_indices(m.group(2))]
    return [job_id_field]


def parse_squeue(text: str) -> dict[str, SlurmRow]:
    """Rows of `squeue -h -t all -O JobArrayID:|,State:|,TimeUsed:|,RestartCnt:|,NodeList:|,Reason:|`."""
    rows: dict[str, SlurmRow] = {}
    for line in text.splitlines():
        cols = line.split("|")
        if len(cols) < len(SQUEUE_FIELDS):
            continue
        job, state, used, restarts, node, reason = cols[: len(SQUEUE_FIELDS)]
        for key in _task_keys(job.strip()):
            rows[key] = SlurmRow(
                state=normalize_state(state),
                elapsed_s=parse_duration(used),
                requeues=int(restarts) if restarts.strip().isdigit() else 0,
                node=node.strip() or None,
                reason=None if reason.strip() in ("", "None") else reason.strip(),
            )
    return rows


def parse_sacct(text: str) -> dict[str, SlurmRow]:
    """Rows of `sacct -X -D -n --parsable2 --format=JobID,JobIDRaw,State,ExitCode,Elapsed,NodeList,Start,End`.

    With -D every attempt of a requeued task is a row (older ones REQUEUED); the last row is current.
    """
    rows: dict[str, SlurmRow] = {}
    requeues: dict[str, int] = {}
    for line in text.splitlines():
        cols = line.split("|")
        if len(cols) < len(SACCT_FIELDS):
            continue
        job, _raw, state, exit_code, elapsed, node = cols[:6]
        state = normalize_state(state)
        for key in _task_keys(job.strip()):
            if state == "REQUEUED":
                requeues[key] = requeues.get(key, 0) + 1
            rows[key] = SlurmRow(
                state=state,
                elapsed_s=parse_duration(elapsed),
                exit_code=exit_code.strip() or None,
                node=None if node.strip() in ("", "None assigned") else node.strip(),
            )
    for key, n in requeues.items():
        rows[key].requeues = n
    return rows


def task_job_id(job: dict, task: dict) -> str:
    """The Slurm id of one manifest task: JOB_INDEX for an array job, JOB otherwise (as recorded at submission:
    packed tasks share their array task's id)."""
    if task.get("job_id"):
        return str(task["job_id"])
    if job.get("array") and task.get("array_index") is not None:
        return f"{job['job_id']}_{task['array_index']}"
    return str(job["job_id"])


def merge_status(manifest: dict, squeue: dict[str, SlurmRow], sacct: dict[str, SlurmRow]) -> list[TaskStatus]:
    """One TaskStatus per submitted task (squeue decides the state when it has the task; sacct adds history),
    plus the manifest's cached tasks, which were never submitted. A task submitted again (resume=) is the
    job that submitted it last."""
    out = [t for t in local_status(manifest) if t.state == "CACHED"]
    jobs = manifest.get("jobs", [])
    latest = {str(task.get("variant")): id(task) for job in jobs for task in job.get("tasks", [])}
    for job in jobs:
        tasks = job.get("tasks", [])
        for task in tasks:
            if latest[str(task.get("variant"))] != id(task):
                continue
            key = task_job_id(job, task)
            live, hist = squeue.get(key), sacct.get(key)
            if len(tasks) == 1 and not (live or hist):
                # submitit's map_array over ONE item submits a plain job (id 18, not 18_0); and a base-id
                # row of a one-task job can only be that task's.
                key = str(job["job_id"])
                live, hist = squeue.get(key), sacct.get(key)
            state = live.state if live else hist.state if hist else "UNKNOWN"
            # sacct lags: while squeue says running, its elapsed is fresher; once ended sacct is exact.
            best = hist if hist and (not live or hist.state == live.state) else live
            out.append(
                TaskStatus(
                    stage=str(job.get("stage", "")),
                    variant=str(task.get("variant", task.get("array_index", ""))),
                    job_id=key,
                    state=state,
                    elapsed_s=best.elapsed_s if best else None,
                    requeues=max(live.requeues if live else 0, hist.requeues if hist else 0),
                    exit_code=hist.exit_code if hist and hist.state == state else None,
                    node=(live.node if live else None) or (hist.node if hist else None),
                    reason=live.reason if live else None,
                    log_path=task.get("log_path"),
                    err_path=task.get("err_path"),
                )
            )
    return out


def local_status(manifest: dict) -> list[TaskStatus]:
    """Tasks of a local run: the states the local launcher recorded in manifest['tasks']."""
    tasks = manifest.get("tasks") or {}
    items = tasks.items() if isinstance(tasks, dict) else ((t.get("variant", str(i)), t) for i, t in enumerate(tasks))
    out = []
    for name, info in items:
        info = info if isinstance(info, dict) else {"state": info}
        out.append(
            TaskStatus(
                stage=str(info.get("stage", "")),
                variant=str(info.get("variant", name)),
                job_id=str(info.get("job_id") or info.get("pid") or "-"),
                state=LOCAL_STATES.get(str(info.get("state")).lower(), normalize_state(str(info.get("state", "")))),
                elapsed_s=info.get("elapsed_s"),
                requeues=int(info.get("requeues", info.get("attempt", 0)) or 0),
                exit_code=None if info.get("exit_code") is None else str(info.get("exit_code")),
                log_path=info.get("log_path"),
                err_path=info.get("err_path"),
            )
        )
    return out


# ---------------------------------------------------------------- I/O


def run_command(argv: list[str]) -> str:
    """stdout of argv, or "" when it fails or is not installed (a purged job makes squeue exit 1)."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def load_manifest(run_dir: str | Path) -> dict:
    path = Path(run_dir)
    if not path.is_dir():
        raise RunDirError(f"run dir not found: {path}")
    manifest = path / "manifest.json"
    if not manifest.is_file():
        raise RunDirError(f"no manifest.json in {path} (is it a slurm_router run dir?)")
    try:
        data = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RunDirError(f"cannot read {manifest}: {exc}") from None
    if not isinstance(data, dict):
        raise RunDirError(f"{manifest} is not a JSON object")
    return data


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


def collect_status(manifest: dict, runner: Runner = run_command) -> list[TaskStatus]:
    """Query Slurm for the manifest's jobs and return one TaskStatus per task (log tails for failures)."""
    if manifest.get("launcher") == "local":
        tasks = local_status(manifest)
    else:
        ids = ",".join(job_ids(manifest))
        squeue_text = sacct_text = ""
        if ids:
            squeue_text = runner(["squeue", "-h", "-t", "all", "-j", ids, "-O", ",".join(f"{f}:|" for f in SQUEUE_FIELDS)])
            sacct_text = runner(
                ["sacct", "-X", "-D", "-n", "--parsable2", "-j", ids, "--format=" + ",".join(SACCT_FIELDS)]
            )
        tasks = merge_status(manifest, parse_squeue(squeue_text), parse_sacct(sacct_text))
        for t in tasks:
            if t.state == "UNKNOWN":
                _state_from_run_dir(manifest, t)
    for t in tasks:
        if t.state in FAILED_STATES:
            t.out_tail, t.err_tail = tail(t.log_path), tail(t.err_path)
    return tasks


def _state_from_run_dir(manifest: dict, t: TaskStatus) -> None:
    """Slurm knows nothing of the task (purged from squeue after MinJobAge, and no accounting): its own files
    still tell how it ended, if it did: result.json, or the `end` row of its events."""
    task_dir = ((manifest.get("tasks") or {}).get(t.variant) or {}).get("task_dir")
    if not task_dir:
        return
    if (Path(task_dir) / "result.json").is_file():
        t.state, t.reason = "COMPLETED", "from the run dir: Slurm has no record of the job"
        return
    for line in reversed(tail(str(Path(task_dir) / "events-rank0.jsonl"), 5)):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("event") == "end" and row.get("exit_state") == "failed":
            t.state, t.reason = "FAILED", "from the run dir: Slurm has no record of the job"
        return


def live_tasks(manifest: dict, runner: Runner = run_command) -> list[TaskStatus]:
    """Tasks of a Slurm run that Slurm still holds (pending, running, requeued, suspended...)."""
    if manifest.get("launcher") == "local" or not job_ids(manifest):
        return []
    return [t for t in collect_status(manifest, runner) if not t.terminal and t.state != "UNKNOWN"]


def cancel_run(manifest: dict, runner: Runner = run_command) -> list[str]:
    """scancel this run's jobs (only its own ids); returns the ids cancelled."""
    ids = job_ids(manifest)
    if ids and manifest.get("launcher") != "local":
        runner(["scancel", *ids])
    return ids if manifest.get("launcher") != "local" else []


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


# ---------------------------------------------------------------- presentation


def _summary(tasks: list[TaskStatus]) -> str:
    counts: dict[str, int] = {}
    for t in tasks:
        counts[t.state] = counts.get(t.state, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no tasks"


def render_table(manifest: dict, tasks: list[TaskStatus]) -> None:
    header = f"run {manifest.get('run_id', '?')} ({manifest.get('experiment', '?')}, launcher={manifest.get('launcher', '?')}): {_summary(tasks)}"
    columns = ("stage", "variant", "job", "state", "elapsed", "requeues", "exit", "node", "log")
    rows = [
        (t.stage, t.variant, t.job_id, t.state + (f" ({t.reason})" if t.reason else ""),
         format_duration(t.elapsed_s), str(t.requeues), t.exit_code or "-", t.node or "-", t.log_path or "-")
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
    for t in tasks:
        if t.out_tail or t.err_tail:
            print(f"\n--- {t.variant} ({t.job_id}) {t.state}: last {TAIL_LINES} lines of its logs")
            for label, lines in (("stdout", t.out_tail), ("stderr", t.err_tail)):
                if lines:
                    print(f"[{label}]")
                    print("\n".join(lines))


def to_json(manifest: dict, tasks: list[TaskStatus]) -> str:
    return json.dumps(
        {
            "run_id": manifest.get("run_id"),
            "experiment": manifest.get("experiment"),
            "launcher": manifest.get("launcher"),
            "all_terminal": all(t.terminal for t in tasks),
            "all_completed": bool(tasks) and all(t.state in SUCCESS_STATES for t in tasks),
            "tasks": [asdict(t) | {"terminal": t.terminal} for t in tasks],
        },
        indent=2,
    )


def main(argv: list[str] | None = None) -> int:
    """python -m slurm_router.status RUN_DIR [--wait] [--cancel] [--json]"""
    parser = argparse.ArgumentParser(prog="python -m slurm_router.status", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="a run directory (holds manifest.json)")
    parser.add_argument("--wait", action="store_true", help="poll until every task ended; exit 0 only if all COMPLETED")
    parser.add_argument("--cancel", action="store_true", help="scancel this run's jobs (only its own job ids)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    parser.add_argument("--poll-s", type=float, default=5.0, help="seconds between polls with --wait (default 5)")
    parser.add_argument("--timeout-s", type=float, default=None, help="give up waiting after this long (exit 1)")
    args = parser.parse_args(argv)
    try:
        manifest = load_manifest(args.run_dir)
    except RunDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.cancel:
        ids = cancel_run(manifest)
        print(f"scancel {' '.join(ids)}" if ids else "nothing to cancel", file=sys.stderr)
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
