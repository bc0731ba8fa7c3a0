"""launcher=slurm's callables: what submitit runs in an array task (submitit's classes stay in this backend).

TaskRunner runs one task (supervise/job.py run_task); ColocatedRunner runs K co-located tasks, or one in a container
(supervise/colocate.py start_colocated). Each is submitit's Checkpointable: on USR2 (the time limit's warning or a
preemption) submitit calls checkpoint(), the workers stop at their step end and save, requeue.after_stop decides
(requeue_by="runner"), and submitit requeues the callable if it says so. The supervisor lives on the instance,
made on first use and never pickled (submitit pickles the callable again to requeue it).
"""

from __future__ import annotations

import signal
import sys

from submitit.helpers import Checkpointable

from slurm_router.rundir.lifecycle import TaskOutcome
from slurm_router.supervise.colocate import colocated_outcome, start_colocated
from slurm_router.supervise.job import checkpoint_step, run_task
from slurm_router.supervise.supervisor import TaskFailed, TaskSupervisor


class Supervised:
    """Mixin for the callables submitit runs: a TaskSupervisor on the instance, made on first use, never pickled."""

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_supervisor"}

    @property
    def supervisor(self) -> TaskSupervisor:
        if "_supervisor" not in self.__dict__:
            self._supervisor = TaskSupervisor()
        return self._supervisor


class TaskRunner(Supervised, Checkpointable):
    """One task: run_task, plus checkpoint(), which submitit calls on USR2."""

    def __call__(self, task_file: str) -> dict | None:
        from slurm_router.supervise.retry import TaskRetried

        try:
            return run_task(task_file, self.supervisor)
        except TaskRetried as e:  # requeued itself (retry.py): end this attempt as submitit's requeue does
            print(f"warning: {e}", file=sys.stderr, flush=True)
            sys.exit(e.exit_code)

    def checkpoint(self, task_file: str):
        from slurm_router.rundir.spec import TaskSpec
        from slurm_router.scheduler.registry import launcher_setting
        from slurm_router.supervise.requeue import after_stop

        spec = TaskSpec.load(task_file)
        delay = int(launcher_setting(spec.config.get("launcher"), "signal_delay_s"))
        try:  # the step in flight finishes and rank 0 saves; Slurm kills everything at the limit
            self.supervisor.stop_children(signal.SIGUSR2, timeout=max(5.0, delay - 15.0))
        except TaskFailed as e:
            print(f"error: {spec.name}: {e}; requeueing from the last checkpoint", file=sys.stderr, flush=True)
        if after_stop(spec, signal.SIGUSR2, checkpoint_step(spec), requeue_by="runner") is TaskOutcome.REQUEUE:
            return super().checkpoint(task_file)
        return None  # submitit: not requeued, the job fails


class ColocatedRunner(Supervised, Checkpointable):
    """K co-located tasks; checkpoint() stops the children at their step end, then asks submitit to requeue this
    allocation if one of them wants it. python: the words that start a task's interpreter, e.g. in a container
    (container.py: launcher=slurm runs a containerised task as a group of one); None: this one."""

    def __init__(self, python: list[str] | None = None):
        self.python = python

    def __call__(self, task_files: list[str]) -> list[int]:
        codes = start_colocated(self.supervisor, task_files, getattr(self, "python", None)).wait()
        if colocated_outcome(codes) is TaskOutcome.FAILED:
            raise RuntimeError(f"co-located {len(task_files)} task(s) failed: exit codes {codes} (see each task's log)")
        return codes

    def checkpoint(self, task_files: list[str]):
        group = self.supervisor.children
        if group is None:  # USR2 before the group started (no child could ask): nothing ran, run it again
            return super().checkpoint(task_files)
        self.supervisor.on_signal(signal.SIGUSR2)
        codes = group.wait()
        return super().checkpoint(task_files) if colocated_outcome(codes) is TaskOutcome.REQUEUE else None
