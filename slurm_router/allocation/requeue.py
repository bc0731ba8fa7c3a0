"""A task's attempts and requeues, kept in RUN_DIR/tasks/<name>/attempts.json (stable across requeues).

Every start of a task is a new attempt (0, 1, ...): its events carry `attempt`, so the report keeps the last
attempt's row of a step that ran twice. A stop signal becomes a requeue by this rule, the same for both
Slurm launchers: USR2 shortly before the time limit is a timeout, requeued at most launcher.max_requeues
times; USR2 at any other time is a preemption (someone wants the GPUs back), requeued without limit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from slurm_router.config.schema import launcher_setting
from slurm_router.fileio import atomic_write_text
from slurm_router.rundir.attempts import current_attempt, load_attempts, save_attempts
from slurm_router.rundir.events import EventWriter
from slurm_router.rundir.layout import TaskPaths
from slurm_router.rundir.lifecycle import TaskOutcome

# USR2 within signal_delay_s + this margin of the time limit counts as the time limit's warning.
TIMEOUT_MARGIN_S = 60


def repair_torn_tail(path: Path) -> None:
    """Drop a torn last line (a worker killed mid-write). Readers skip it only while it is the last line: a new
    attempt appending after it would leave garbage mid-file."""
    try:
        with open(path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size == 0:
                return
            f.seek(max(0, size - (1 << 20)))
            tail = f.read()
            if tail.endswith(b"\n"):
                return
            cut = tail.rfind(b"\n")
            f.truncate(size - len(tail) + cut + 1 if cut >= 0 else (0 if size <= 1 << 20 else size))
    except FileNotFoundError:
        pass


def task_event(spec, event: str, **fields) -> None:
    """A task-level row from the job process (requeue, a failure's end) in rank 0's events file, after the
    workers have exited (one writer at a time)."""
    events = TaskPaths(spec.task_dir).events(0)
    repair_torn_tail(events)
    policy = (spec.config.get("router") or {}).get("policy")
    writer = EventWriter(
        events,
        run_id=spec.run_id,
        task=spec.name,
        variant=spec.variant,
        stage=spec.stage,
        attempt=spec.attempt,
        device=0,
        policy=policy,
    )
    writer.write(event, **fields)
    writer.close()


def note_slurm_restart(spec) -> None:
    """Slurm requeued this job by itself (preemption, node failure, an operator's scontrol requeue): the
    previous attempt could not know. Log one `requeue` row per restart nobody has logged yet."""
    job, restarts = os.environ.get("SLURM_JOB_ID"), int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if not job or restarts <= 0:
        return
    data = load_attempts(spec.task_dir)
    logged = data.setdefault("restarts_logged", {})
    for n in range(int(logged.get(job, 0)), restarts):
        task_event(
            spec,
            "requeue",
            reason="slurm",
            job_id=job,
            restart=n + 1,
            detail="requeued by Slurm (preemption, node failure or scontrol requeue)",
        )
    logged[job] = max(restarts, int(logged.get(job, 0)))
    save_attempts(spec.task_dir, data)


@dataclass
class Decision:
    requeue: bool
    reason: str  # timeout | preempted | interrupted
    detail: str


def slurm_job_ref() -> str | None:
    """This job as scontrol and squeue must name it: JOB_TASK inside an array. The bare SLURM_JOB_ID of one
    array task can equal the array's own id, and `scontrol requeue <array id>` requeues every task of it."""
    array, index = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{index}" if array and index else os.environ.get("SLURM_JOB_ID")


# The job's end time (epoch seconds), exported by the batch script outside a container (launch/container.py):
# inside one there is seldom a squeue to ask.
JOB_END_ENV = "SLURM_ROUTER_JOB_END_TIME"


def _time_left_from_env() -> float | None:
    end = os.environ.get(JOB_END_ENV, "")
    return float(end) - time.time() if end.isdigit() else None


def time_left_s(job_id: str) -> float | None:
    """Seconds left before the job's time limit (squeue %L; in a container, JOB_END_ENV), None when unknown or
    unlimited."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%L"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return _time_left_from_env()
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", out.splitlines()[0] if out else "")
    if not m:
        return _time_left_from_env()
    d, h, mi, s = (int(x or 0) for x in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


def decide(spec, signum: int) -> Decision:
    """Requeue after this stop signal? USR2 under Slurm: yes, within the timeout budget. TERM and INT: no
    (a local stop, or Slurm itself is preempting or cancelling the job and decides what comes next)."""
    name = signal.Signals(signum).name if signum else "none"
    job = os.environ.get("SLURM_JOB_ID")
    if signum != signal.SIGUSR2 or not job:
        return Decision(False, "interrupted", f"stopped by {name}")
    launcher = spec.config.get("launcher") or {}
    left = time_left_s(cast(str, slurm_job_ref()))
    near_limit = left is not None and left <= int(launcher_setting(launcher, "signal_delay_s")) + TIMEOUT_MARGIN_S
    data = load_attempts(spec.task_dir)
    if not near_limit:
        data["preemptions"] = int(data.get("preemptions", 0)) + 1
        save_attempts(spec.task_dir, data)
        return Decision(True, "preempted", f"{name} with {left if left is not None else '?'} s left: a preemption")
    limit = int(launcher_setting(launcher, "max_requeues"))
    timeouts = int(data.get("timeouts", 0)) + 1
    data["timeouts"] = timeouts
    save_attempts(spec.task_dir, data)
    if timeouts > limit:
        return Decision(
            False,
            "timeout",
            f"hit its time limit {timeouts} times, more than launcher.max_requeues="
            f"{limit}: raise launcher.timeout_min, or resume it with python -m slurm_router "
            f"resume={spec.run_dir}",
        )
    return Decision(True, "timeout", f"time limit {timeouts} of {limit + 1} (launcher.max_requeues={limit})")


def requeue_self(spec, decision: Decision, step: int, scontrol: bool = True) -> None:
    """Log the requeue, then ask Slurm to put this job back in the queue (it resumes from the checkpoint).
    scontrol=False: submitit runs `scontrol requeue` itself."""
    job = os.environ["SLURM_JOB_ID"]
    data = load_attempts(spec.task_dir)
    # The next attempt sees SLURM_RESTART_COUNT one higher: this row already accounts for that restart.
    logged = data.setdefault("restarts_logged", {})
    logged[job] = int(os.environ.get("SLURM_RESTART_COUNT") or 0) + 1
    save_attempts(spec.task_dir, data)
    task_event(
        spec,
        "requeue",
        reason=decision.reason,
        detail=decision.detail,
        step=step,
        job_id=job,
        time_requested=time.time(),
    )
    if scontrol:
        subprocess.run(
            ["scontrol", "requeue", cast(str, slurm_job_ref())], check=True, capture_output=True, text=True, timeout=60
        )


REQUEUERS = ("scontrol", "submitit", "pack", "outside")
# Set by a batch script that runs the task inside a container (launch/container.py): the file the task writes
# when it wants its array task requeued; the script, outside the container, then runs `scontrol requeue`.
REQUEUE_REQUEST_ENV = "SLURM_ROUTER_REQUEUE_REQUEST"


def request_requeue_outside(why: str) -> bool:
    """Inside a container (REQUEUE_REQUEST_ENV set): write the request file the batch script acts on; True.
    Otherwise False: whoever asked requeues itself."""
    path = os.environ.get(REQUEUE_REQUEST_ENV)
    if not path:
        return False
    atomic_write_text(Path(path), json.dumps({"why": why, "job": slurm_job_ref(), "time": time.time()}))
    return True


def after_stop(spec, signum: int, step: int | None, requeue_by: str) -> TaskOutcome:
    """The one after-stop policy, for every stop path (a job process, submitit's checkpoint hook, a packed
    task, srun workers): decide, log the verdict in the task's events, requeue or end the attempt, say so.

    requeue_by: who puts the allocation back in the queue when the verdict is a requeue: "scontrol" (this
    process, now: STOPPED), "submitit" (its checkpoint() after this returns: REQUEUE) or "pack" (the pack
    runner, once for all its tasks: REQUEUE) or "outside" (the batch script outside the task's container, told
    by a request file: REQUEUE; chosen here for "scontrol" when REQUEUE_REQUEST_ENV is set). Otherwise STOPPED
    (interrupted: resume= continues) or FAILED (the time limit hit more often than launcher.max_requeues
    allows)."""
    if requeue_by not in REQUEUERS:
        raise ValueError(f"requeue_by={requeue_by!r}, expected one of {REQUEUERS}")
    if requeue_by == "scontrol" and os.environ.get(REQUEUE_REQUEST_ENV):
        requeue_by = "outside"
    spec.attempt = current_attempt(spec.task_dir)
    decision = decide(spec, signum)
    where = f"checkpoint at step {step}" if step is not None else "no checkpoint yet"
    if decision.requeue:
        requeue_self(spec, decision, step or 0, scontrol=requeue_by == "scontrol")
        if requeue_by == "outside":
            request_requeue_outside(f"{spec.name}: {decision.detail}")
        print(f"{spec.name}: {decision.detail}; {where}; requeued", flush=True)
        return TaskOutcome.STOPPED if requeue_by == "scontrol" else TaskOutcome.REQUEUE
    if decision.reason == "timeout":
        task_event(spec, "end", exit_state="failed", error=decision.detail, step=step)
        print(f"error: {spec.name}: {decision.detail}", file=sys.stderr, flush=True)
        return TaskOutcome.FAILED
    task_event(spec, "end", exit_state="interrupted", detail=decision.detail, step=step)
    print(
        f"{spec.name}: {decision.detail}; {where}; continue with: python -m slurm_router resume={spec.run_dir}",
        flush=True,
    )
    return TaskOutcome.STOPPED
