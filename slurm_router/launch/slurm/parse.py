"""Pure parsing of what Slurm says (squeue, sacct) and what the manifest says, into one TaskStatus per task.
No I/O here: unit-tested on outputs captured from Slurm 22.05 (tests/golden/slurm_outputs).
slurm_router.launch.slurm.status does the querying, waiting, cancelling and printing.

Sources, and why both: squeue -t all is the controller's truth for pending, running and recently ended
tasks (kept for MinJobAge) but forgets older ones; sacct keeps history, exit codes and requeued attempts,
but lags the controller by a few seconds and, right after submission, may hold only a bare record under
the array's base id (e.g. `15`, or `15` named "allocation") that belongs to no particular task yet.
So a task's state comes from squeue when it has a row, else from sacct rows naming exactly that task
(`15_3`, or `15` for a job that is not an array), else UNKNOWN (never guessed COMPLETED).

A stage waits on the one before with afterok. When that one fails, a dependant can never run: Slurm cancels
it (the launchers submit with --kill-on-invalid-dep=yes; squeue's reason DependencyNeverSatisfied, which sacct
forgets) or, without the flag, keeps it PENDING with that reason forever. Either way it is terminal here, and
its reason names the stage and the task that failed (blame_failed_stages).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Callable

from slurm_router.launch.task_status import (
    FAILED_STATES,
    NEVER_SATISFIED,
    TERMINAL_STATES,
    SlurmRow,
    TaskStatus,
    local_status,
    never_runs,
    normalize_state,
)
from slurm_router.rundir.progress import Progress

# exit_code is last: squeue's raw wait status (512 = exit 2, 9 = signal 9), which an ended job has before slurmdbd
# records it for sacct (seconds later on a busy controller; a status --wait or a report job may ask in between)
SQUEUE_FIELDS = ("JobArrayID", "State", "TimeUsed", "RestartCnt", "NodeList", "Reason", "exit_code")
# 22.05's sacct has no Restarts field: requeues are counted from the REQUEUED rows that -D shows.
SACCT_FIELDS = ("JobID", "JobIDRaw", "State", "ExitCode", "Elapsed", "NodeList", "Start", "End")

Runner = Callable[[list[str]], str]  # runs a command, returns stdout ("" when it fails)


# ---------------------------------------------------------------- pure parsing


def parse_duration(text: str) -> int | None:
    """Slurm durations ([D-]H:MM:SS, MM:SS, M:SS) -> seconds; INVALID/empty -> None."""
    text = text.strip()
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


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


def squeue_exit_code(raw: str, state: str) -> str | None:
    """squeue's exit_code (a raw wait status) as sacct writes ExitCode ('2:0', '0:9'), for an ended job only."""
    raw = raw.strip()
    if state not in TERMINAL_STATES or not raw.isdigit():
        return None
    status = int(raw)
    return f"{(status >> 8) & 0xFF}:{status & 0x7F}"


def parse_squeue(text: str) -> dict[str, SlurmRow]:
    """Rows of `squeue -h -t all -O JobArrayID:|,State:|,TimeUsed:|,RestartCnt:|,NodeList:|,Reason:|,exit_code:|`
    (a row without the last column, as an older query wrote it, has no exit code)."""
    rows: dict[str, SlurmRow] = {}
    for line in text.splitlines():
        cols = line.split("|")
        if len(cols) < len(SQUEUE_FIELDS) - 1:
            continue
        job, state, used, restarts, node, reason = cols[:6]
        state = normalize_state(state)
        for key in _task_keys(job.strip()):
            rows[key] = SlurmRow(
                state=state,
                exit_code=squeue_exit_code(cols[6] if len(cols) > 6 else "", state),
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
                    # sacct's once it has recorded the end; before that, squeue's (an ended job's, squeue_exit_code)
                    exit_code=hist.exit_code if hist and hist.state == state else live.exit_code if live else None,
                    node=(live.node if live else None) or (hist.node if hist else None),
                    reason=live.reason if live else None,
                    log_path=task.get("log_path"),
                    err_path=task.get("err_path"),
                )
            )
    blame_failed_stages(manifest, out)
    return out


def mirror_fused(manifest: dict, tasks: list[TaskStatus]) -> list[TaskStatus]:
    """resources.fuse_variants: each task fused into another (never submitted itself) right after its leader,
    with the leader's job and state (it trains inside it); its progress is read from its own folder later."""
    members: dict[str, list[str]] = {}
    for name, info in (manifest.get("tasks") or {}).items():
        if isinstance(info, dict) and info.get("fused_into"):
            members.setdefault(str(info["fused_into"]), []).append(str(name))
    if not members:
        return tasks
    return [
        u for t in tasks for u in [t, *(replace(t, variant=m, progress=Progress()) for m in members.get(t.variant, []))]
    ]


def blame_failed_stages(manifest: dict, tasks: list[TaskStatus]) -> None:
    """A task that never ran because a stage it waits on failed gets the reason 'DependencyNeverSatisfied:
    stage base failed (base FAILED)'. Slurm says DependencyNeverSatisfied only while squeue still holds the job
    (MinJobAge); a task CANCELLED before it ever had a node, in a stage after a failed one, is such a task too."""
    by_stage: dict[str, list[TaskStatus]] = {}
    for t in tasks:
        by_stage.setdefault(t.stage, []).append(t)
    for stage in manifest.get("stages") or []:
        for dep in stage.get("depends_on") or []:
            failed = [t for t in by_stage.get(dep, []) if t.state in FAILED_STATES]
            if not failed:
                continue
            names = ", ".join(f"{t.variant} {t.state}" for t in failed[:3]) + (", ..." if len(failed) > 3 else "")
            for t in by_stage.get(stage.get("name"), []):
                never_started = t.state == "CANCELLED" and t.node is None and not t.elapsed_s
                if never_runs(t) or never_started or t.reason == NEVER_SATISFIED:
                    t.reason = f"{NEVER_SATISFIED}: stage {dep} failed ({names})"
