"""CPU threads per worker, decided once, by whoever starts workers side by side (docs/ARCHITECTURE.md).

The local queue knows how many CPU workers of a stage can run at once, the co-location runner how many tasks share
its allocation; each passes the answer to its children in SLURM_ROUTER_THREADS, and a worker only reads it.
Without it (an sbatch or srun task started by Slurm) a worker divides the cores it may use by the workers
beside it. A single variant on an idle machine gets every core.
"""

from __future__ import annotations

import os

THREADS_ENV = "SLURM_ROUTER_THREADS"


def available_cores() -> int:
    """The cores this process may use: its scheduler's allocation, else the affinity mask, else the machine's."""
    from slurm_router.scheduler.registry import job_environment

    given = job_environment().cpus()
    if given:
        return given
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_worker(workers_side_by_side: int, cores: int | None = None) -> int:
    return max(1, (cores or available_cores()) // max(1, workers_side_by_side))


def worker_threads(workers_in_this_allocation: int) -> int:
    """What a CPU worker uses: the launcher's decision if it made one, else its share of the allocation."""
    told = os.environ.get(THREADS_ENV, "")
    return int(told) if told.isdigit() and int(told) > 0 else threads_per_worker(workers_in_this_allocation)
