"""launcher.srun_workers: each of the D srun tasks of a job is one worker of the task (rank = SLURM_PROCID),
and the D processes meet at MASTER_ADDR:MASTER_PORT (default: the job's first node, a port derived from the
job id), so a task can span nodes. No job process above them: each is its own supervisor of one worker, and
rank 0 speaks for the task after a stop (job.main asks requeue.after_stop for rank 0 only).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time

from slurm_router.rundir.layout import TaskPaths
from slurm_router.scheduler.registry import job_environment
from slurm_router.supervise.supervisor import TaskFailed, TaskStopped, worker_entry

# gloo, when a peer dies: "Connection closed by peer [ADDR]:PORT" or "Read error [ADDR]:PORT: Connection reset by peer"
PEER_LOST = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+(?=.*by peer)|by peer \[([0-9a-fA-F.:]+)\]:\d+")
# How long a rank other than 0 tries to reach rank 0's meeting point before it says so (torch's own
# rendezvous would wait the whole collective time-out, worker.COLLECTIVE_TIMEOUT_S).
RENDEZVOUS_TIMEOUT_S = float(os.environ.get("SLURM_ROUTER_RENDEZVOUS_TIMEOUT_S", "120"))


def srun_rank() -> int | None:
    """This process's rank when it is one of several workers the scheduler started for one task, else None."""
    return job_environment().worker_rank()


def srun_master() -> str:
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return job_environment().rendezvous()


def wait_for_master(master: str, who: str, timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> None:
    """Wait until MASTER_ADDR:MASTER_PORT takes connections (rank 0 listens there); TaskFailed, one line naming
    the address and port, if it does not within timeout_s: the nodes cannot reach each other."""
    host, port = master.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TaskFailed(
                    f"{who}: cannot reach rank 0 at {host}:{port} within {timeout_s:.0f} s ({e}): the "
                    f"job's nodes cannot reach each other there; check that {host} resolves on every node "
                    f"and that port {port} is open between them, or set MASTER_ADDR/MASTER_PORT"
                ) from None
            time.sleep(0.5)


def _ranks_on(node: str) -> list[int]:
    """The ranks the scheduler placed on `node`."""
    return job_environment().ranks_on(node)


def _speaks_for_the_task(rank: int, lost: list[int]) -> bool:
    """Who records the task's end when a peer is lost: rank 0; or, when rank 0 is among the ranks of the node
    that was lost, the lowest rank on another node (rank 0 is gone, and with it the usual writer)."""
    if rank == 0:
        return True
    ntasks = job_environment().worker_count()
    survivors = [r for r in range(ntasks) if r not in lost]
    return 0 in lost and bool(survivors) and rank == survivors[0]


def _peer_lost(spec, rank: int, address: str | None, error: str) -> str:
    """One line for a peer rank that died mid-collective: which rank and node, and what resume= does. Rank 0
    records it as the task's end, or, if rank 0 is the one lost, the lowest rank on another node. srun does not kill the
    others (--kill-on-bad-exit=0: sbatch_render._srun), so the writer lives to write; each rank exits after it."""
    from slurm_router.rundir.attempts import current_attempt
    from slurm_router.rundir.layout import checkpoint_step
    from slurm_router.supervise.requeue import task_event

    try:
        node = socket.gethostbyaddr(address)[0].split(".")[0] if address else None
    except OSError:
        node = address
    on_node = _ranks_on(node) if node else []
    ranks = [r for r in on_node if r != rank]
    who = (
        f"worker rank {','.join(map(str, ranks))} on {node} ({address})"
        if ranks
        else f"the worker at {address}"
        if address
        else f"another worker ({' '.join(error.split())[:200]})"
    )
    ckpt = sorted(TaskPaths(spec.task_dir).checkpoints.glob("step-*.pt"))
    then = (
        f"resume continues from step {checkpoint_step(ckpt[-1])}" if ckpt else "no checkpoint yet: resume restarts it"
    )
    msg = f"{spec.name}: {who} was lost mid-step (its process or node died); rank {rank} stopped; {then}"
    if _speaks_for_the_task(rank, on_node if rank not in on_node else []):
        spec.attempt = current_attempt(spec.task_dir)
        task_event(spec, "end", exit_state="failed", error=msg)
    return msg


def run_srun_worker(spec, resume: str | None, supervisor) -> dict | None:
    """Be worker SLURM_PROCID of the task. A stop signal the job process took before this point (its
    supervisor's) is handed to the worker's own flag, so the worker stops after its first step."""
    from slurm_router.worker.state import Stopped, install_stop_handlers, request_stop

    env = job_environment()
    ntasks, rank = env.worker_count(), env.worker_rank()
    if rank is None:
        raise RuntimeError("not one of several workers the scheduler started for this task")
    if ntasks != spec.devices:
        raise RuntimeError(f"{ntasks} srun tasks for a task of {spec.devices} devices")
    install_stop_handlers()  # from here on the worker's flag takes every stop signal
    if supervisor.signum:
        request_stop(supervisor.signum)
    spec.attempt = -1  # rank 0 counts the attempt once the workers have met
    master = srun_master()
    if rank != 0:
        wait_for_master(master, f"{spec.name}: rank {rank}")
    try:
        result = worker_entry(rank, spec.to_json(), ntasks, master, resume)
    except RuntimeError as e:  # gloo: "Connection closed by peer [ADDR]:PORT": another rank died
        peer = PEER_LOST.search(str(e))
        if peer is None and "gloo/transport" not in str(e):
            raise
        raise TaskFailed(_peer_lost(spec, rank, peer and (peer.group(1) or peer.group(2)), str(e))) from None
    if isinstance(result, Stopped):
        raise TaskStopped(result.step, result.signum)
    return json.loads(TaskPaths(spec.task_dir).result.read_text()) if rank == 0 else None
