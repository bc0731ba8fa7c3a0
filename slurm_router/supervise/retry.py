"""launcher.max_failures=N: a task that failed for a reason that is not its own runs again, from its newest
checkpoint, away from the node it failed on, up to N times (docs/troubleshooting.md, "What survives what").

Not its own: a worker killed by a signal (the kernel's OOM killer sends SIGKILL; a driver fault SIGSEGV or
SIGBUS), or its node failing (Slurm's NODE_FAIL). Its own: a worker that raised (an exception in the training
code, bad data), unusable checkpoints, a diverged loss (which ends cleanly anyway). Those are never retried:
they would fail again.

Who retries: the task, inside the cluster, so nothing on a login node has to watch the run (launcher.wait=false
works the same as true):
- a worker killed by a signal: the job process is alive and knows the signal and the node. It records the
  failure and requeues its own array task (requeue.requeue_self: the same job id, so the stages that wait on it
  with afterok keep waiting, and `status` shows one task), then, while Slurm holds the task again, excludes the
  node (`scontrol update ExcNodeList=`, sbatch's --exclude) unless no other node of its partition could run it
  (sinfo: a single-node cluster keeps its node).
- NODE_FAIL: the job died with its node. Slurm requeues a requeueable batch job by itself (sbatch's template
  asks --requeue; submitit's jobs follow the cluster's JobRequeue, 1 by default) and the failed node is down,
  so it runs elsewhere. The next attempt finds the NODE_FAIL in sacct and counts it; beyond N it fails at once,
  in one line. With max_failures=0 (the default) nothing is counted: Slurm's own requeue runs as it always did.
The failures are kept in tasks/<name>/attempts.json ("failures", one record each: cause, node, what was
excluded, whether it was retried): they survive requeues; resume= gives the task N retries afresh (the user
chose to go on), as it does launcher.max_requeues. Co-located tasks (resources.tasks_per_gpu>1) and srun_workers
are not retried: a requeue would restart the other co-located tasks, and srun ends a step itself; resume= continues
them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

# attempts.json is requeue.py's file: its reader and writer (load_attempts, save_attempts) keep one format
from slurm_router.rundir.attempts import load_attempts, save_attempts
from slurm_router.rundir.lifecycle import EXIT_REQUEUE, EXIT_STOPPED
from slurm_router.scheduler.base import JobEnvironment
from slurm_router.scheduler.registry import job_environment, launcher_setting
from slurm_router.supervise.requeue import RequeueDecision, requeue_self
from slurm_router.supervise.supervisor import TaskFailed

# How supervisor.Workers._describe names a worker that died of a signal (the other causes say "raised" or
# "exit code"): "worker rank 0 (pid 123) killed by SIGKILL"
SIGNAL_DEATH = re.compile(r"worker rank (\d+) \(pid \d+\) killed by (SIG[A-Z0-9]+)")


class TaskRetried(TaskFailed):
    """A worker died of a signal and the task requeued itself (launcher.max_failures): this attempt ends with
    exit_code (lifecycle: EXIT_STOPPED, or EXIT_REQUEUE where the batch script outside a container requeues)."""

    def __init__(self, message: str, exit_code: int = EXIT_STOPPED):
        super().__init__(message)
        self.exit_code = exit_code


# ---------------------------------------------------------------- pure decisions


def signal_death(error: str) -> str | None:
    """'SIGKILL of worker rank 0' if the supervisor's line says a worker was killed by a signal, else None (the
    task's own error: an exception, an exit code, a hang)."""
    m = SIGNAL_DEATH.search(error)
    return f"{m.group(2)} of worker rank {m.group(1)}" if m else None


def nodes_to_exclude(failed: list[str], nodes: dict[str, bool]) -> tuple[list[str], list[str]]:
    """(the nodes to exclude, those kept although the task failed there). Newest failure first, a failed node is
    excluded while some other usable node of the partition is left to run the task: excluding every node would
    leave it pending forever (a single-node cluster keeps its node). `nodes`: the partition's, each usable or
    not; a node it does not list is not one the scheduler would accept to exclude."""
    usable_nodes = {n for n, ok in nodes.items() if ok}
    exclude: list[str] = []
    kept: list[str] = []
    for node in dict.fromkeys(reversed(failed)):
        if node not in nodes:
            continue
        if usable_nodes - set(exclude) - {node}:
            exclude.append(node)
        else:
            kept.append(node)
    return sorted(exclude), kept


# ---------------------------------------------------------------- the task's record (attempts.json)


def _counted(data: dict) -> list[dict]:
    """The failures that count against launcher.max_failures now (those since the last resume=)."""
    return (data.get("failures") or [])[int(data.get("failures_counted_from", 0)) :]


def renew(task_dir: Path) -> None:
    """resume=: the task gets launcher.max_failures retries afresh (its failure records stay)."""
    data = load_attempts(task_dir)
    if data.get("failures"):
        data["failures_counted_from"] = len(data["failures"])
        save_attempts(task_dir, data)


def _record(spec, cause: str, node: str | None, limit: int, env: JobEnvironment, **extra) -> dict:
    """Count one failure in attempts.json: retried when fewer than `limit` were retried since the last resume."""
    data = load_attempts(spec.task_dir)
    used = sum(1 for f in _counted(data) if f.get("retried"))
    retried = used < limit
    n = used + 1 if retried else used
    where = f" on node {node}" if node else ""
    detail = (
        f"retried after {cause}{where} ({n}/{limit})"
        if retried
        else f"failed after {cause}{where}: not retried, launcher.max_failures={limit} "
        f"{'used up' if limit else '(set it to retry such failures)'}"
    )
    record = {
        "cause": cause,
        "node": node,
        "job_id": env.job_ref(),
        "attempt": spec.attempt,
        "time": time.time(),
        "retried": retried,
        "detail": detail,
        **extra,
    }
    data.setdefault("failures", []).append(record)
    save_attempts(spec.task_dir, data)
    return record


def _retriable_here(env: JobEnvironment) -> bool:
    """In a scheduler's job, as one task's own job process (not a co-located task, not an srun worker)."""
    from slurm_router.supervise.colocate import COLOCATED_ENV

    return bool(env.job_id()) and not os.environ.get(COLOCATED_ENV) and env.worker_rank() is None


# ---------------------------------------------------------------- what the job process calls


def after_failure(spec, error: str, step: int | None, env: JobEnvironment | None = None) -> TaskRetried | None:
    """A worker died (the supervisor's line `error`): requeue this task if it was killed by a signal and
    launcher.max_failures allows. Returns the TaskRetried to raise if it was requeued (this attempt then ends:
    exit 75, or 76 in a container, whose batch script requeues it), else None (it fails as before)."""
    from slurm_router.supervise.requeue import REQUEUE_REQUEST_ENV, request_requeue_outside

    env = env or job_environment()
    cause = signal_death(error)
    if cause is None or not _retriable_here(env):
        return None
    limit = int(launcher_setting(spec.config.get("launcher"), "max_failures"))
    record = _record(spec, cause, env.node(), limit, env)
    if not record["retried"]:
        if limit:
            print(f"{spec.name}: {record['detail']}", file=sys.stderr, flush=True)
        return None
    outside = bool(os.environ.get(REQUEUE_REQUEST_ENV))  # in a container: the batch script requeues it
    exclude, kept = ([], []) if outside else plan_exclusion(spec, env)  # before the requeue signals this job
    try:
        requeue_self(spec, RequeueDecision(True, "failure", record["detail"]), step or 0, now=not outside)
    except (OSError, subprocess.SubprocessError) as e:  # the scheduler refused, or its command is missing
        _update_newest(spec, retried=False, detail=f"failed after {cause}: could not requeue itself ({e})")
        print(f"{spec.name}: could not requeue itself ({e}): resume= continues it", file=sys.stderr, flush=True)
        return None
    if outside:
        request_requeue_outside(f"{spec.name}: {record['detail']}")
        said = "no node excluded: the batch script outside the container requeues it"
    else:
        said = exclude_nodes(exclude, kept, env)
    _update_newest(spec, excluded=exclude if said.startswith("excluding") else [], exclude_note=said)
    start = f"step {step}" if step is not None else "the start (no checkpoint yet)"
    return TaskRetried(
        f"{spec.name}: {error}; {record['detail']}; {said}; it continues from {start}",
        EXIT_REQUEUE if outside else EXIT_STOPPED,
    )


def _update_newest(spec, **fields) -> None:
    data = load_attempts(spec.task_dir)
    data["failures"][-1].update(fields)
    save_attempts(spec.task_dir, data)


def plan_exclusion(spec, env: JobEnvironment) -> tuple[list[str], list[str]]:
    """(the nodes to exclude, the failed nodes kept): every node this task failed on, where another node of its
    partition can run it."""
    failed = [f["node"] for f in load_attempts(spec.task_dir).get("failures") or [] if f.get("node")]
    return nodes_to_exclude(failed, env.usable_nodes())


def exclude_nodes(exclude: list[str], kept: list[str], env: JobEnvironment) -> str:
    """Keep the requeued task (held by the scheduler again) off `exclude`; what was done, in words."""
    words = []
    if exclude:
        nodes = ",".join(exclude)
        refused = env.exclude_nodes(exclude)
        words.append(f"excluding {nodes}" if refused is None else f"could not exclude {nodes} ({refused})")
    if kept:
        partition = env.partition() or "(default)"
        words.append(f"{','.join(kept)} not excluded: no other node of partition {partition} can run it")
    return "; ".join(words) or "no node to exclude"


def count_node_failures(spec, env: JobEnvironment | None = None) -> str | None:
    """At the start of an attempt the scheduler restarted: count the attempts of this task that ended with their
    node (JobEnvironment.node_failures) and not yet counted. Returns the one-line error if that makes more than launcher.max_failures (the
    task must not run again), else None. With max_failures=0 (the default) nothing is counted: a requeue Slurm
    made by itself (JobRequeue) runs as before."""
    env = env or job_environment()
    if not _retriable_here(env) or env.restart_count() <= 0:
        return None
    rows = env.node_failures()
    limit = int(launcher_setting(spec.config.get("launcher"), "max_failures"))
    if limit <= 0:  # not asked for: Slurm's own requeue after a node failure goes on as it always did
        return None
    seen = {f.get("key") for f in load_attempts(spec.task_dir).get("failures") or []}
    for key, node in rows:
        if key in seen:
            continue
        record = _record(spec, env.node_failure, node or None, limit, env, key=key)
        if not record["retried"]:
            return f"{spec.name}: {record['detail']}; continue it with python -m slurm_router resume={spec.run_dir}"
        print(f"{spec.name}: {record['detail']} ({env.scheduler} requeued it)", flush=True)
    return None
