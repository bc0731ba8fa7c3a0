"""launcher.srun_workers: each of the D srun tasks of a job is one worker of the task (rank = SLURM_PROCID),
and the D processes meet at MASTER_ADDR:MASTER_PORT (default: the job's first node, a port derived from the
job id), so a task can span nodes. No job process above them: each is its own supervisor of one worker, and
rank 0 speaks for the task after a stop (job.main asks requeue.after_stop for rank 0 only).
"""
from __future__ import annotations

import json
import os
import subprocess

from slurm_router.layout import TaskPaths
from slurm_router.supervisor import TaskStopped, worker_entry


def srun_rank() -> int | None:
    """This process's rank when it is one of several srun workers of one task, else None."""
    ntasks = int(os.environ.get("SLURM_NTASKS", "1"))
    return int(os.environ["SLURM_PROCID"]) if ntasks > 1 and "SLURM_PROCID" in os.environ else None


def srun_master() -> str:
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    return f"{nodes[0]}:{20000 + int(os.environ['SLURM_JOB_ID']) % 20000}"


def run_srun_worker(spec, resume: str | None, supervisor) -> dict | None:
    """Be worker SLURM_PROCID of the task. A stop signal the job process took before this point (its
    supervisor's) is handed to the worker's own flag, so the worker stops after its first step."""
    from slurm_router.train.state import Stopped, install_stop_handlers, request_stop
    ntasks, rank = int(os.environ["SLURM_NTASKS"]), int(os.environ["SLURM_PROCID"])
    if ntasks != spec.devices:
        raise RuntimeError(f"{ntasks} srun tasks for a task of {spec.devices} devices")
    install_stop_handlers()             # from here on the worker's flag takes every stop signal
    if supervisor.signum:
        request_stop(supervisor.signum)
    spec.attempt = -1                   # rank 0 counts the attempt once the workers have met
    result = worker_entry(rank, spec.to_json(), ntasks, srun_master(), resume)
    if isinstance(result, Stopped):
        raise TaskStopped(result.step, result.signum)
    return json.loads(TaskPaths(spec.task_dir).result.read_text()) if rank == 0 else None
