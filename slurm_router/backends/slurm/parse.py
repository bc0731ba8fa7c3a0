"""Pure parsing of what Slurm says (squeue, sacct) and what the manifest says, into one TaskView per task.
No I/O here: unit-tested on outputs captured from Slurm 22.05 (tests/golden/slurm_outputs).
slurm_router.backends.slurm.queries does the querying, waiting, cancelling and printing.

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
import time
from dataclasses import replace
from typing import Callable

from slurm_router.backends.slurm.states import HELD_STATES, NEVER_SATISFIED, REQUEUE_STATES
from slurm_router.rundir.progress import TaskProgress
from slurm_router.scheduler.task_view import (
    FAILED_STATES,
    TERMINAL_STATES,
    SchedulerRow,
    TaskView,
    local_status,
    never_runs,
    normalize_state,
)

# exit_code is last: squeue's raw wait status (512 = exit 2, 9 = signal 9), which an ended job has before slurmdbd
# records it for sacct (seconds later on a busy controller; a status --wait or a report job may ask in between)
# name and submit time last: a row is the run's own job only if they match what the manifest recorded (not_ours)
SQUEUE_FIELDS = (
    "JobArrayID",
    "State",
    "TimeUsed",
    "RestartCnt",
    "NodeList",
    "Reason",
    "exit_code",
    "Name",
    "SubmitTime",
)
# 22.05's sacct has no Restarts field: requeues are counted from the REQUEUED rows that -D shows.
SACCT_FIELDS = ("JobID", "JobIDRaw", "State", "ExitCode", "Elapsed", "NodeList", "Start", "End", "JobName", "Submit")
SACCT_MIN_FIELDS = 8  # a row without JobName and Submit (as an older query wrote it) is matched by id alone
# Clocks of the submitting host and the controller may differ this much: a job submitted earlier than the run's
# own submission by more is another job that had the same id (the ids wrapped, or the accounting was reset)
SUBMIT_SLACK_S = 300.0
Expect = dict  # base job id -> (job name, submitted at: epoch s), from the manifest (expected_jobs)

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


def expected_jobs(manifest: dict) -> Expect:
    """What the run recorded of each of its jobs at submission: base id -> (name, submitted at)."""
    return {
        str(job["job_id"]): (job.get("name"), job.get("submitted_at"))
        for job in manifest.get("jobs", [])
        if job.get("job_id") and job.get("name")
    }


def _epoch(text: str) -> float | None:
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))  # Slurm prints local time
    except ValueError:
        return None


def not_ours(key: str, name: str, submit: str, expect: Expect | None) -> str | None:
    """Why the row of job `key` is not the run's own job of that id (another name, or submitted before the run
    submitted its own), or None: matched by id AND name and submit time, never by id alone."""
    recorded = (expect or {}).get(key.split("_")[0])
    if recorded is None or not name.strip():
        return None
    want, since = recorded
    at = _epoch(submit)
    if name.strip() != want:
        return f"named {name.strip()}, not {want}"
    if at is not None and since is not None and at < float(since) - SUBMIT_SLACK_S:
        return f"submitted {submit.strip()}, before this run submitted its own"
    return None


def parse_squeue(text: str, expect: Expect | None = None) -> dict[str, SchedulerRow]:
    """Rows of `squeue -h -t all -O JobArrayID:|,...` over SQUEUE_FIELDS (a row without the last columns, as an
    older query wrote it, has no exit code and is matched by id alone)."""
    rows: dict[str, SchedulerRow] = {}
    for line in text.splitlines():
        cols = line.split("|")
        if len(cols) < 6:  # JobArrayID..Reason; exit_code, Name and SubmitTime came later
            continue
        job, state, used, restarts, node, reason = cols[:6]
        state = normalize_state(state)
        name, submit = (cols[7], cols[8]) if len(cols) > 8 else ("", "")
        other = not_ours(job.strip(), name, submit, expect)
        for key in _task_keys(job.strip()):
            rows[key] = SchedulerRow(
                foreign=other,
                state=state,
                exit_code=squeue_exit_code(cols[6] if len(cols) > 6 else "", state),
                elapsed_s=parse_duration(used),
                requeues=int(restarts) if restarts.strip().isdigit() else 0,
                node=node.strip() or None,
                reason=None if reason.strip() in ("", "None") else reason.strip(),
            )
    return rows


def parse_sacct(text: str, expect: Expect | None = None) -> dict[str, SchedulerRow]:
    """Rows of `sacct -X -D -n --parsable2 --format=JobID,JobIDRaw,State,ExitCode,Elapsed,NodeList,Start,End,
    JobName,Submit`; a row of another job that had the same id (not_ours) is kept only where the run's own is none.

    With -D every attempt of a requeued task is a row (older ones REQUEUED, PREEMPTED or NODE_FAIL: each row
    before the last was requeued); the last row is current.
    """
    rows: dict[str, SchedulerRow] = {}
    requeues: dict[str, int] = {}
    for line in text.splitlines():
        cols = line.split("|")
        if len(cols) < SACCT_MIN_FIELDS:
            continue
        job, _raw, state, exit_code, elapsed, node = cols[:6]
        state = normalize_state(state)
        name, submit = (cols[8], cols[9]) if len(cols) > 9 else ("", "")
        other = not_ours(job.strip(), name, submit, expect)
        for key in _task_keys(job.strip()):
            if other and key in rows and not rows[key].foreign:
                continue  # the accounting also holds another job of this id: the run's own row stays
            if not other and key in rows and rows[key].foreign:
                del rows[key]  # the run's own row after another job's of the same id
                requeues.pop(key, None)
            # a row before another of the same task was requeued, whatever it says (PREEMPTED, NODE_FAIL)
            if state == "REQUEUED" or (key in rows and rows[key].state != "REQUEUED"):
                requeues[key] = requeues.get(key, 0) + 1
            rows[key] = SchedulerRow(
                foreign=other,
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
    co-located tasks share their array task's id)."""
    if task.get("job_id"):
        return str(task["job_id"])
    if job.get("array") and task.get("array_index") is not None:
        return f"{job['job_id']}_{task['array_index']}"
    return str(job["job_id"])


def merge_status(manifest: dict, squeue: dict[str, SchedulerRow], sacct: dict[str, SchedulerRow]) -> list[TaskView]:
    """One TaskView per submitted task (squeue decides the state when it has the task; sacct adds history),
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
            foreign = (live.foreign if live else None) or (hist.foreign if hist else None)
            live = None if live and live.foreign else live  # another job of the same id says nothing of ours
            hist = None if hist and hist.foreign else hist
            state = live.state if live else hist.state if hist else "UNKNOWN"
            # sacct lags: while squeue says running, its elapsed is fresher; once ended sacct is exact.
            best = hist if hist and (not live or hist.state == live.state) else live
            out.append(
                TaskView(
                    stage=str(job.get("stage", "")),
                    variant=str(task.get("variant", task.get("array_index", ""))),
                    job_id=key,
                    state=state,
                    elapsed_s=best.elapsed_s if best else None,
                    requeues=max(live.requeues if live else 0, hist.requeues if hist else 0),
                    # sacct's once it has recorded the end; before that, squeue's (an ended job's, squeue_exit_code)
                    exit_code=hist.exit_code if hist and hist.state == state else live.exit_code if live else None,
                    node=(live.node if live else None) or (hist.node if hist else None),
                    reason=_waiting_reason(key, state, live.reason if live else None)
                    or (f"Slurm's job {key} is another job ({foreign}): its id was used again" if foreign else None),
                    log_path=task.get("log_path"),
                    err_path=task.get("err_path"),
                )
            )
    out += unsubmitted(manifest, set(latest))
    blame_failed_stages(manifest, out)
    return out


# squeue's reasons for a job held (scontrol requeuehold, hold): it runs again only once released
HELD_REASONS = ("job requeued in held state", "JobHeldUser", "JobHeldAdmin")


def _waiting_reason(key: str, state: str, reason: str | None) -> str | None:
    """What a task put back in the queue waits for: a held one for `scontrol release`, a preempted or requeued
    one to run again from its checkpoint."""
    if state in HELD_STATES or (state == "PENDING" and (reason or "").startswith(HELD_REASONS)):
        return f"{reason or state}: held; `scontrol release {key}` lets it run again"
    if state in REQUEUE_STATES:
        return reason or "requeued by Slurm: waits to run again from its checkpoint"
    return reason


def unsubmitted(manifest: dict, submitted: set[str]) -> list[TaskView]:
    """The tasks no job holds (Slurm never answered their sbatch, or the command was stopped before it): not yet
    submitted while the command submits, else INTERRUPTED, which resume= submits."""
    infos = manifest.get("tasks") or {}
    if not isinstance(infos, dict):
        return []
    running = manifest.get("state") == "running"
    out = []
    for name, info in infos.items():
        if name in submitted or not isinstance(info, dict) or info.get("fused_into"):
            continue
        if info.get("state", "pending") not in ("pending", "submitted"):
            continue  # cached (listed above), skipped: not a task left to submit
        out.append(
            TaskView(
                stage=str(info.get("stage", "")),
                variant=str(name),
                job_id="-",
                state="PENDING" if running else "INTERRUPTED",
                reason="not submitted yet" if running else "never submitted: resume=RUN_DIR submits it",
            )
        )
    return out


def mirror_fused(manifest: dict, tasks: list[TaskView]) -> list[TaskView]:
    """resources.fuse_variants: each task fused into another (never submitted itself) right after its leader,
    with the leader's job and state (it trains inside it); its progress is read from its own folder later."""
    members: dict[str, list[str]] = {}
    for name, info in (manifest.get("tasks") or {}).items():
        if isinstance(info, dict) and info.get("fused_into"):
            members.setdefault(str(info["fused_into"]), []).append(str(name))
    if not members:
        return tasks
    return [
        u
        for t in tasks
        for u in [t, *(replace(t, variant=m, progress=TaskProgress()) for m in members.get(t.variant, []))]
    ]


def blame_failed_stages(manifest: dict, tasks: list[TaskView]) -> None:
    """A task that never ran because a stage it waits on failed gets the reason 'DependencyNeverSatisfied:
    stage base failed (base FAILED)'. Slurm says DependencyNeverSatisfied only while squeue still holds the job
    (MinJobAge); a task CANCELLED before it ever had a node, in a stage after a failed one, is such a task too."""
    by_stage: dict[str, list[TaskView]] = {}
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
