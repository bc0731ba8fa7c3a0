"""Co-located tasks: K side by side in one Slurm allocation (resources.tasks_per_gpu=K with launcher=slurm|sbatch).

Small LoRA tasks leave most of a big GPU idle, so one array task runs K task specs at once on the GPU(s)
Slurm gave it: each is an ordinary `python -m slurm_router.supervise.job TASK_FILE` child sharing CUDA_VISIBLE_DEVICES
and an equal share of the allocation's cores (slurm_router.worker.cpu). A TaskSupervisor forwards every stop signal
to every child (Slurm signals the whole step too); each child checkpoints and asks requeue.after_stop on its
own. A child whose verdict is a requeue exits EXIT_REQUEUE instead of asking Slurm itself, so the allocation
is requeued once: by this runner with `scontrol requeue` (launcher=sbatch) or by submitit through
ColocatedRunner.checkpoint() (launcher=slurm). A requeued group restarts every child; finished ones return at once
(their result is on disk), the others resume from their newest checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from submitit.helpers import Checkpointable

from slurm_router.rundir.layout import RunLayout
from slurm_router.rundir.lifecycle import EXIT_STOPPED, TaskOutcome
from slurm_router.supervise.supervisor import Supervised, TaskSupervisor
from slurm_router.worker.cpu import THREADS_ENV, threads_per_worker

COLOCATED_ENV = "SLURM_ROUTER_COLOCATED"  # tells a child job process that this runner requeues, once


def colocated_task_files(run_dir: str, stage: str, index: int, per_array_task: int) -> list[str]:
    """The task files array task `index` runs: the stage's tasks index*K .. index*K + K - 1 (K=1: one task)."""
    from slurm_router.rundir.manifest import Manifest

    layout = RunLayout(run_dir)
    names = Manifest.load(run_dir).stage_tasks(stage)
    return [str(layout.task(n).task_file) for n in names[index * per_array_task : (index + 1) * per_array_task]]


def _workers_side_by_side(task_files: list[str]) -> int:
    from slurm_router.rundir.spec import TaskSpec

    return sum(TaskSpec.load(f).devices for f in task_files)


class Colocated:
    """The K job processes of one array task (spawn it through TaskSupervisor.start: signals stay blocked)."""

    def __init__(self, task_files: list[str], python: list[str] | None = None):
        env = {
            **os.environ,
            COLOCATED_ENV: "1",
            "PYTHONUNBUFFERED": "1",
            THREADS_ENV: str(threads_per_worker(_workers_side_by_side(task_files))),
        }
        python = python or [sys.executable]  # or the words that run it in a container (launch/container.py)
        self.procs = [subprocess.Popen([*python, "-m", "slurm_router.supervise.job", f], env=env) for f in task_files]
        self.codes: dict[int, int] = {}

    def _reap(self) -> None:
        # os.waitpid, not Popen.wait/poll: a signal handler (submitit's checkpoint) may wait while the main
        # thread is inside a wait, and Popen's wait lock is not reentrant.
        for p in self.procs:
            if p.pid in self.codes:
                continue
            try:
                pid, status = os.waitpid(p.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by the other waiter; its code is recorded there
                continue
            if pid:
                self.codes[p.pid] = os.waitstatus_to_exitcode(status)

    def forward(self, signum: int) -> None:
        self._reap()
        for p in self.procs:
            if p.pid not in self.codes:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    def wait(self) -> list[int]:
        while True:
            self._reap()
            if len(self.codes) == len(self.procs):
                return [self.codes[p.pid] for p in self.procs]
            time.sleep(0.2)


def colocated_outcome(codes: list[int]) -> TaskOutcome:
    return TaskOutcome.combine([TaskOutcome.from_exit_code(c) for c in codes])


def _start(supervisor: TaskSupervisor, task_files: list[str], python: list[str] | None = None) -> Colocated:
    # A signal before the start goes to the children too: each asks requeue.after_stop, none decides here.
    return supervisor.start(lambda: Colocated(task_files, python), stop_early=False)


def run_colocated(task_files: list[str], supervisor: TaskSupervisor | None = None) -> int:
    """launcher=sbatch: run the co-located tasks; requeue the allocation once if a task asked for it. Exit code as
    job.py."""
    supervisor = supervisor or TaskSupervisor().install()
    codes = _start(supervisor, task_files).wait()
    outcome = colocated_outcome(codes)
    print(f"co-located {len(task_files)} task(s): exit codes {codes}: {outcome.value}", flush=True)
    if outcome is TaskOutcome.REQUEUE:
        from slurm_router.scheduler.registry import job_environment
        from slurm_router.supervise.requeue import request_requeue_outside

        if request_requeue_outside(f"co-located {len(task_files)} task(s)"):  # in a container: the script does
            return outcome.exit_code
        job_environment().requeue()  # this array task (JOB_TASK), never the whole array
        return EXIT_STOPPED
    return outcome.exit_code


class ColocatedRunner(Supervised, Checkpointable):
    """launcher=slurm: what submitit runs for K co-located tasks; checkpoint() (submitit's USR2 hook) stops the
    children at their step end, then asks submitit to requeue this allocation if one of them wants it. The supervisor lives on
    the instance (never pickled). python: the words that start a task's interpreter, e.g. in a container
    (launch/container.py: launcher=slurm runs a containerised task as a group of one); None: this one."""

    def __init__(self, python: list[str] | None = None):
        self.python = python

    def __call__(self, task_files: list[str]) -> list[int]:
        codes = _start(self.supervisor, task_files, getattr(self, "python", None)).wait()
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
