"""What every scheduler backend offers (one package per scheduler: backends/<name>/, found by scheduler/registry.py).

Submit side (`Backend`): its launchers by `launcher=` kind, the jobs it holds now (the runs list), the report's
job facts, the dry run's scripts. Job side (`JobEnvironment`): what a task's job process asks the scheduler it
runs under: its job, the time left, a requeue of itself, the node and allocation, the rendezvous of workers that
the scheduler started. The defaults here are a job no scheduler runs (the local launcher's job processes).
"""

from __future__ import annotations

import importlib
import socket
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from omegaconf import DictConfig

Runner = Callable[[list[str]], str]  # runs a scheduler's command, returns its stdout


class JobEnvironment:
    """The job side of a scheduler, read from the process's environment. The base class: no scheduler."""

    name = "local"
    restart_detail = "requeued by its scheduler"  # the requeue row of a restart the scheduler made by itself
    scheduler = "its scheduler"  # how a line names the scheduler ("Slurm requeued it")
    node_failure = "node failure"  # the cause attempts.json records for a run that ended with its node (node_failures)

    def job_id(self) -> str | None:
        """The scheduler's id of this job (logged in events and attempts), None outside a scheduler's job."""
        return None

    def job_ref(self) -> str | None:
        """This job as the scheduler's commands must name it (an array task's own id, not its array's)."""
        return self.job_id()

    def restart_count(self) -> int:
        """How often the scheduler has restarted (requeued) this job."""
        return 0

    def array_index(self) -> int:
        """This job's index in its array job (0 outside one)."""
        return 0

    def node(self) -> str | None:
        return socket.gethostname() or None

    def partition(self) -> str | None:
        return None

    def cpus(self) -> int | None:
        """CPUs the scheduler gave each task of this job, None when it does not say."""
        return None

    def time_left_s(self) -> float | None:
        """Seconds before the job's time limit, None when unknown or unlimited."""
        return None

    def preempted(self) -> str | None:
        """When the scheduler has chosen this job for preemption (it stops it now and, as the launchers submit
        it requeueable, runs it again later): the time it chose, else None."""
        return None

    def requeue(self) -> None:
        """Put this job back in the queue (it resumes from its checkpoint). Raises OSError when it cannot."""
        raise OSError(f"{self.name}: no scheduler to requeue this job")

    def usable_nodes(self) -> dict[str, bool]:
        """{node: whether it can run a job now} of this job's partition, {} when unknown."""
        return {}

    def exclude_nodes(self, nodes: list[str]) -> str | None:
        """Keep this (requeued) job off `nodes`: None when done, else why not (a few words)."""
        return "no scheduler to ask"

    def node_failures(self) -> list[tuple[str, str]]:
        """(key, node) of each earlier run of this job that ended because its node failed."""
        return []

    # ---- workers the scheduler started (one per task of the job: launcher.srun_workers)

    def worker_rank(self) -> int | None:
        """This process's rank when the scheduler started one process per worker of the task, else None."""
        return None

    def worker_count(self) -> int:
        return 1

    def rendezvous(self) -> str:
        """host:port where the workers of this job meet (rank 0's node)."""
        raise OSError(f"{self.name}: no rendezvous outside a scheduler's job")

    def ranks_on(self, node: str) -> list[int]:
        """The worker ranks the scheduler placed on `node`."""
        return []


class Backend:
    """The submit side of a scheduler. `launchers`: launcher kind -> "module:Class" (a `launch.base.Launcher`),
    imported when asked for."""

    name = "local"
    launchers: dict[str, str] = {}
    queued = False  # its launchers return before the tasks end (a queue's arrays, each job with a time limit)
    # Its own words for a task that ended without a result, beyond FAILED, TIMEOUT and CANCELLED (task_view.py)
    failed_states: frozenset[str] = frozenset()
    # squeue-like reasons it gives a PENDING job it will never start (a dependency that can never be satisfied)
    never_runs_reasons: tuple[str, ...] = ()
    dependency_word = ""  # its word for a stage waiting on the one before to succeed (the dry run says it)
    packages: tuple[str, ...] = ()  # its own packages, whose versions a run's manifest records (beside the core's)

    def launcher_class(self, kind: str) -> Any:
        module, _, cls = self.launchers[kind].partition(":")
        return getattr(importlib.import_module(module), cls)

    def job_environment(self) -> JobEnvironment | None:
        """This process's job environment if it runs inside one of this scheduler's jobs, else None."""
        return None

    def live_jobs(self) -> dict[str, str]:
        """Every job the scheduler holds now, by job id: its state (the runs list). {} for none."""
        return {}

    def job_facts(self, manifest: dict, facts: dict[str, dict], runner: Runner | None = None) -> None:
        """Add what the scheduler knows of each task's job (elapsed, state, exit code, resources) to `facts`
        (task name -> the facts the run dir gave)."""

    def poll_floor_s(self) -> float:
        """The shortest interval between two polls of this scheduler (`status --wait`, `--follow`)."""
        return 0.0

    def colocated_tasks(self, cfg: DictConfig) -> int:
        """Tasks per job (resources.tasks_per_gpu on a queue); 1 where each task is its own job."""
        return 1

    def time_limit_h(self, cfg: DictConfig) -> float | None:
        """Each job's time limit in hours, None without one."""
        return None

    def devices(self, cfg: DictConfig) -> tuple[str, int | None, str] | None:
        """(device kind, memory in bytes or None, where that comes from) of the devices its jobs get; None: this
        machine's (the plan probes them here)."""
        return None

    def preview(self, cfg: DictConfig, manifest: Any, stages: list) -> list[str]:
        """dry_run=true: render what would be submitted into the run dir; the lines that say so."""
        return []
