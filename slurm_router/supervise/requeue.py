"""A task's attempts and requeues, kept in RUN_DIR/tasks/<name>/attempts.json (stable across requeues).

Every start of a task is a new attempt (0, 1, ...): its events carry `attempt`, so the report keeps the last
attempt's row of a step that ran twice. A stop signal becomes a requeue by this rule, the same for every
queue's launcher: USR2 shortly before the time limit is a timeout, requeued at most launcher.max_requeues
times; USR2 at any other time is a preemption (someone wants the GPUs back), requeued without limit.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from slurm_router.fileio import atomic_write_text
from slurm_router.rundir.attempts import current_attempt, load_attempts, save_attempts
from slurm_router.rundir.events import EventWriter
from slurm_router.rundir.layout import TaskPaths
from slurm_router.rundir.lifecycle import TaskOutcome
from slurm_router.scheduler.registry import job_environment, launcher_setting

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


def note_scheduler_restart(spec) -> None:
    """The scheduler requeued this job by itself (preemption, node failure, an operator's requeue): the
    previous attempt could not know. Log one `requeue` row per restart nobody has logged yet."""
    env = job_environment()
    job, restarts = env.job_id(), env.restart_count()
    if not job or restarts <= 0:
        return
    data = load_attempts(spec.task_dir)
    logged = data.setdefault("restarts_logged", {})
    for n in range(int(logged.get(job, 0)), restarts):
        task_event(
            spec,
            "requeue",
            reason=env.name,
            job_id=job,
            restart=n + 1,
            detail=env.restart_detail,
        )
    logged[job] = max(restarts, int(logged.get(job, 0)))
    save_attempts(spec.task_dir, data)


@dataclass
class RequeueDecision:
    """What follows a stop signal (or a retried failure): requeue or not, why, and the detail."""

    requeue: bool
    reason: str  # timeout | preempted | interrupted | failure
    detail: str


def time_left_s() -> float | None:
    """Seconds left before this job's time limit (its scheduler's answer), None when unknown or unlimited."""
    return job_environment().time_left_s()


def _count(spec, key: str) -> int:
    """One more of `key` (preemptions, timeouts) in the task's attempts.json; the new count."""
    data = load_attempts(spec.task_dir)
    data[key] = int(data.get(key, 0)) + 1
    save_attempts(spec.task_dir, data)
    return data[key]


def decide(spec, signum: int) -> RequeueDecision:
    """Requeue after this stop signal? USR2 in a scheduler's job: yes, within the timeout budget. TERM in a job
    the scheduler chose for preemption: yes (ended on its own before the grace time, the job would count as
    failed and never come back). Otherwise TERM and INT: no (a local stop, or an operator cancelling the job)."""
    name = signal.Signals(signum).name if signum else "none"
    env = job_environment()
    job = env.job_id()
    chosen = env.preempted() if signum == signal.SIGTERM and job else None
    if chosen:
        _count(spec, "preemptions")
        return RequeueDecision(True, "preempted", f"{name}: its scheduler preempted the job at {chosen}")
    if signum != signal.SIGUSR2 or not job:
        return RequeueDecision(False, "interrupted", f"stopped by {name}")
    launcher = spec.config.get("launcher") or {}
    left = time_left_s()
    near_limit = left is not None and left <= int(launcher_setting(launcher, "signal_delay_s")) + TIMEOUT_MARGIN_S
    if not near_limit:
        _count(spec, "preemptions")
        return RequeueDecision(
            True, "preempted", f"{name} with {left if left is not None else '?'} s left: a preemption"
        )
    limit = int(launcher_setting(launcher, "max_requeues"))
    timeouts = _count(spec, "timeouts")
    if timeouts > limit:
        return RequeueDecision(
            False,
            "timeout",
            f"hit its time limit {timeouts} times, more than launcher.max_requeues="
            f"{limit}: raise launcher.timeout_min, or resume it with python -m slurm_router "
            f"resume={spec.run_dir}",
        )
    return RequeueDecision(True, "timeout", f"time limit {timeouts} of {limit + 1} (launcher.max_requeues={limit})")


def requeue_self(spec, decision: RequeueDecision, step: int, now: bool = True) -> None:
    """Log the requeue, then ask the scheduler to put this job back in the queue (it resumes from the checkpoint).
    now=False: someone else requeues it (the backend's runner, the co-location runner, the batch script outside
    a container)."""
    env = job_environment()
    job = str(env.job_id())
    data = load_attempts(spec.task_dir)
    # The next attempt sees a restart count one higher: this row already accounts for that restart.
    logged = data.setdefault("restarts_logged", {})
    logged[job] = env.restart_count() + 1
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
    if now:
        env.requeue()


REQUEUERS = ("self", "runner", "colocated", "outside")
# Set by a batch script that runs the task inside a container (backends/slurm/container.py): the file the task writes
# when it wants its array task requeued; the script, outside the container, then requeues it.
REQUEUE_REQUEST_ENV = "SLURM_ROUTER_REQUEUE_REQUEST"


def request_requeue_outside(why: str) -> bool:
    """Inside a container (REQUEUE_REQUEST_ENV set): write the request file the batch script acts on; True.
    Otherwise False: whoever asked requeues itself."""
    path = os.environ.get(REQUEUE_REQUEST_ENV)
    if not path:
        return False
    atomic_write_text(Path(path), json.dumps({"why": why, "job": job_environment().job_ref(), "time": time.time()}))
    return True


def after_stop(spec, signum: int, step: int | None, requeue_by: str) -> TaskOutcome:
    """The one after-stop policy, for every stop path (a job process, a backend runner's checkpoint hook, a
    co-located task, srun workers): decide, log the verdict in the task's events, requeue or end the attempt, say so.

    requeue_by: who puts the allocation back in the queue when the verdict is a requeue: "self" (this
    process, now: STOPPED), "runner" (the backend's runner that called this, once it returns: REQUEUE; launcher=slurm's
    checkpoint hook) or "colocated" (the
    co-location runner, once for all its tasks: REQUEUE) or "outside" (the batch script outside the task's
    container, told by a request file: REQUEUE; chosen here for "self" when REQUEUE_REQUEST_ENV is set). Otherwise STOPPED
    (interrupted: resume= continues) or FAILED (the time limit hit more often than launcher.max_requeues
    allows)."""
    if requeue_by not in REQUEUERS:
        raise ValueError(f"requeue_by={requeue_by!r}, expected one of {REQUEUERS}")
    if requeue_by == "self" and os.environ.get(REQUEUE_REQUEST_ENV):
        requeue_by = "outside"
    spec.attempt = current_attempt(spec.task_dir)
    decision = decide(spec, signum)
    where = f"checkpoint at step {step}" if step is not None else "no checkpoint yet"
    if decision.requeue:
        requeue_self(spec, decision, step or 0, now=requeue_by == "self")
        if requeue_by == "outside":
            request_requeue_outside(f"{spec.name}: {decision.detail}")
        print(f"{spec.name}: {decision.detail}; {where}; requeued", flush=True)
        return TaskOutcome.STOPPED if requeue_by == "self" else TaskOutcome.REQUEUE
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
