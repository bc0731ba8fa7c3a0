"""Co-located tasks: K side by side in one allocation of a queue's backend (resources.tasks_per_gpu=K).

Small LoRA tasks leave most of a big GPU idle, so one array task runs K task specs at once on the GPU(s)
its scheduler gave it: each is an ordinary `python -m slurm_router.supervise.job TASK_FILE` child sharing CUDA_VISIBLE_DEVICES
and an equal share of the allocation's cores (slurm_router.worker.cpu). A TaskSupervisor forwards every stop signal
to every child (the scheduler may signal the whole step too); each child checkpoints and asks requeue.after_stop on
its own. A child whose verdict is a requeue exits EXIT_REQUEUE instead of asking its scheduler itself, so the
allocation is requeued once: by run_colocated through the job environment's `requeue`, or by a backend's own runner
that calls start_colocated (the Slurm backend's callable runner). A requeued group restarts every child; finished ones return at once
(their result is on disk), the others resume from their newest checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from slurm_router.rundir.layout import RunLayout
from slurm_router.rundir.lifecycle import EXIT_STOPPED, TaskOutcome
from slurm_router.supervise.supervisor import TaskSupervisor
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
        python = python or [sys.executable]  # or the words that run it in a container (its backend's)
        self.procs = [subprocess.Popen([*python, "-m", "slurm_router.supervise.job", f], env=env) for f in task_files]
        self.codes: dict[int, int] = {}

    def _reap(self) -> None:
        # os.waitpid, not Popen.wait/poll: a signal handler (a runner's checkpoint hook) may wait while the main
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


def start_colocated(supervisor: TaskSupervisor, task_files: list[str], python: list[str] | None = None) -> Colocated:
    # A signal before the start goes to the children too: each asks requeue.after_stop, none decides here.
    return supervisor.start(lambda: Colocated(task_files, python), stop_early=False)


def run_colocated(task_files: list[str], supervisor: TaskSupervisor | None = None) -> int:
    """The job process's co-located tasks: run them; requeue the allocation once if a task asked for it. Exit code as
    job.py."""
    supervisor = supervisor or TaskSupervisor().install()
    codes = start_colocated(supervisor, task_files).wait()
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
