"""launcher.max_failures=N: a task that failed for a reason that is not its own runs again, from its newest
checkpoint, away from the node it failed on, up to N times (docs/ARCHITECTURE.md, "What survives what").

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
chose to go on), as it does launcher.max_requeues. Packed tasks (resources.tasks_per_gpu>1) and srun_workers
are not retried: a requeue would restart the pack's other tasks, and srun ends a step itself; resume= continues
them.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, cast

# attempts.json is requeue.py's file: its reader and writer (load_attempts, save_attempts) keep one format
from slurm_router.allocation.requeue import Decision, requeue_self, slurm_job_ref
from slurm_router.allocation.supervisor import TaskFailed
from slurm_router.config.schema import launcher_setting
from slurm_router.rundir.attempts import load_attempts, save_attempts
from slurm_router.rundir.lifecycle import EXIT_REQUEUE, EXIT_STOPPED

# How supervisor.Workers._describe names a worker that died of a signal (the other causes say "raised" or
# "exit code"): "worker rank 0 (pid 123) killed by SIGKILL"
SIGNAL_DEATH = re.compile(r"worker rank (\d+) \(pid \d+\) killed by (SIG[A-Z0-9]+)")
NODE_FAIL = "NODE_FAIL"
# sinfo's node states that can take a job (a trailing * means not responding: not usable)
USABLE_STATES = frozenset(
    {"idle", "mix", "mixed", "alloc", "allocated", "comp", "completing", "resv", "reserved", "plnd", "planned"}
)

Runner = Callable[[list[str]], str]  # runs a command, returns stdout ("" when it fails)


class TaskRetried(TaskFailed):
    """A worker died of a signal and the task requeued itself (launcher.max_failures): this attempt ends with
    exit_code (lifecycle: EXIT_STOPPED, or EXIT_REQUEUE where the batch script outside a container requeues)."""

    def __init__(self, message: str, exit_code: int = EXIT_STOPPED):
        super().__init__(message)
        self.exit_code = exit_code


def _ignore_stop_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_command(argv: list[str]) -> str:
    """stdout of a Slurm command, "" if it failed. The command ignores SIGTERM: a requeue makes Slurm signal
    every process of this job, and the commands that follow the requeue must still end their work."""
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, check=False, preexec_fn=_ignore_stop_signals
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


# ---------------------------------------------------------------- pure decisions


def signal_death(error: str) -> str | None:
    """'SIGKILL of worker rank 0' if the supervisor's line says a worker was killed by a signal, else None (the
    task's own error: an exception, an exit code, a hang)."""
    m = SIGNAL_DEATH.search(error)
    return f"{m.group(2)} of worker rank {m.group(1)}" if m else None


def usable(state: str) -> bool:
    """sinfo's short state (idle, mix, alloc*, drain, down*, ...) can run a job."""
    return not state.endswith("*") and state.rstrip("~#!%$@^-+").lower() in USABLE_STATES


def parse_sinfo(text: str) -> dict[str, str]:
    """`sinfo -h -N -o %N|%t` -> {node: state} (a node listed once per partition is one node)."""
    nodes = {}
    for line in text.splitlines():
        node, _, state = line.strip().partition("|")
        if node and state:
            nodes[node] = state.strip()
    return nodes


def nodes_to_exclude(failed: list[str], nodes: dict[str, str]) -> tuple[list[str], list[str]]:
    """(the nodes to exclude, those kept although the task failed there). Newest failure first, a failed node is
    excluded while some other usable node of the partition is left to run the task: excluding every node would
    leave it pending forever (a single-node cluster keeps its node). A node sinfo does not list is not one
    Slurm would accept in ExcNodeList."""
    usable_nodes = {n for n, s in nodes.items() if usable(s)}
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


def parse_node_failures(text: str) -> list[tuple[str, str]]:
    """`sacct -X -D -n --parsable2 --format=JobIDRaw,State,NodeList,Start` of one task -> (key, node) of each of
    its attempts that ended NODE_FAIL; the key (job id and start time) names the attempt once."""
    out = []
    for line in text.splitlines():
        cols = line.split("|")
        if len(cols) >= 4 and cols[1].strip().split(" ")[0] == NODE_FAIL:
            out.append((f"{cols[0].strip()}@{cols[3].strip()}", cols[2].strip()))
    return out


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


def _record(spec, cause: str, node: str | None, limit: int, **extra) -> dict:
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
        "job_id": slurm_job_ref(),
        "attempt": spec.attempt,
        "time": time.time(),
        "retried": retried,
        "detail": detail,
        **extra,
    }
    data.setdefault("failures", []).append(record)
    save_attempts(spec.task_dir, data)
    return record


def _node() -> str | None:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname() or None


def _retriable_here() -> bool:
    """Under Slurm, as one task's own job process (not a pack's task, not an srun worker)."""
    from slurm_router.allocation.pack import PACKED_ENV
    from slurm_router.allocation.srun_worker import srun_rank

    return bool(os.environ.get("SLURM_JOB_ID")) and not os.environ.get(PACKED_ENV) and srun_rank() is None


# ---------------------------------------------------------------- what the job process calls


def after_failure(spec, error: str, step: int | None, runner: Runner = run_command) -> TaskRetried | None:
    """A worker died (the supervisor's line `error`): requeue this task if it was killed by a signal and
    launcher.max_failures allows. Returns the TaskRetried to raise if it was requeued (this attempt then ends:
    exit 75, or 76 in a container, whose batch script requeues it), else None (it fails as before)."""
    from slurm_router.allocation.requeue import REQUEUE_REQUEST_ENV, request_requeue_outside

    cause = signal_death(error)
    if cause is None or not _retriable_here():
        return None
    limit = int(launcher_setting(spec.config.get("launcher"), "max_failures"))
    record = _record(spec, cause, _node(), limit)
    if not record["retried"]:
        if limit:
            print(f"{spec.name}: {record['detail']}", file=sys.stderr, flush=True)
        return None
    outside = bool(os.environ.get(REQUEUE_REQUEST_ENV))  # in a container: the batch script requeues it
    exclude, kept = ([], []) if outside else plan_exclusion(spec, runner)  # before the requeue signals this job
    try:
        requeue_self(spec, Decision(True, "failure", record["detail"]), step or 0, scontrol=not outside)
    except (OSError, subprocess.SubprocessError) as e:  # scontrol refused, or is missing
        _update_newest(spec, retried=False, detail=f"failed after {cause}: could not requeue itself ({e})")
        print(f"{spec.name}: could not requeue itself ({e}): resume= continues it", file=sys.stderr, flush=True)
        return None
    if outside:
        request_requeue_outside(f"{spec.name}: {record['detail']}")
        said = "no node excluded: the batch script outside the container requeues it"
    else:
        said = exclude_nodes(exclude, kept, runner)
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


def plan_exclusion(spec, runner: Runner = run_command) -> tuple[list[str], list[str]]:
    """(the nodes to exclude, the failed nodes kept): every node this task failed on, where another node of its
    partition (sinfo) can run it."""
    failed = [f["node"] for f in load_attempts(spec.task_dir).get("failures") or [] if f.get("node")]
    partition = os.environ.get("SLURM_JOB_PARTITION", "")
    nodes = parse_sinfo(runner(["sinfo", "-h", "-N", "-o", "%N|%t", *(["-p", partition] if partition else [])]))
    return nodes_to_exclude(failed, nodes)


def exclude_nodes(exclude: list[str], kept: list[str], runner: Runner = run_command) -> str:
    """Keep the requeued task (held by Slurm again) off `exclude`; what was done, in words."""
    words = []
    if exclude:
        job, nodes = cast(str, slurm_job_ref()), ",".join(exclude)
        runner(["scontrol", "update", f"jobid={job}", f"ExcNodeList={nodes}"])
        # scontrol update prints nothing, done or refused (the task already started again): ask Slurm
        done = f"ExcNodeList={nodes}" in runner(["scontrol", "show", "job", job])
        words.append(f"excluding {nodes}" if done else f"could not exclude {nodes} (scontrol update refused)")
    if kept:
        partition = os.environ.get("SLURM_JOB_PARTITION") or "(default)"
        words.append(f"{','.join(kept)} not excluded: no other node of partition {partition} can run it")
    return "; ".join(words) or "no node to exclude"


def count_node_failures(spec, runner: Runner = run_command) -> str | None:
    """At the start of an attempt Slurm restarted: count the attempts of this task that ended NODE_FAIL
    (sacct) and not yet counted. Returns the one-line error if that makes more than launcher.max_failures (the
    task must not run again), else None. With max_failures=0 (the default) nothing is counted: a requeue Slurm
    made by itself (JobRequeue) runs as before."""
    if not _retriable_here() or int(os.environ.get("SLURM_RESTART_COUNT") or 0) <= 0:
        return None
    rows = parse_node_failures(
        runner(
            [
                "sacct",
                "-X",
                "-D",
                "-n",
                "--parsable2",
                "-j",
                cast(str, slurm_job_ref()),
                "--format=JobIDRaw,State,NodeList,Start",
            ]
        )
    )
    limit = int(launcher_setting(spec.config.get("launcher"), "max_failures"))
    if limit <= 0:  # not asked for: Slurm's own requeue after a node failure goes on as it always did
        return None
    seen = {f.get("key") for f in load_attempts(spec.task_dir).get("failures") or []}
    for key, node in rows:
        if key in seen:
            continue
        record = _record(spec, NODE_FAIL, node or None, limit, key=key)
        if not record["retried"]:
            return f"{spec.name}: {record['detail']}; continue it with python -m slurm_router resume={spec.run_dir}"
        print(f"{spec.name}: {record['detail']} (Slurm requeued it)", flush=True)
    return None
