"""Variant packing inside one Slurm allocation (resources.tasks_per_gpu=K with launcher=slurm|sbatch).

Small LoRA tasks leave most of a big GPU idle, so one array task runs K task specs at once on the GPU(s)
Slurm gave it: each is an ordinary `python -m slurm_router.job TASK_FILE` child sharing CUDA_VISIBLE_DEVICES.
Stop signals reach every child (forwarded here, and Slurm signals the whole step too); each child checkpoints
on its own. A child that wants a requeue after a checkpoint exits EXIT_REQUEUE instead of asking Slurm
itself, so the allocation is requeued once: by this runner with `scontrol requeue` (launcher=sbatch) or by
submitit through PackRunner.checkpoint() (launcher=slurm). A requeued pack restarts every child; finished
ones return at once (their result is on disk), the others resume from their newest checkpoint.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from submitit.helpers import Checkpointable

from slurm_router.train.state import EXIT_STOPPED, STOP_SIGNALS

EXIT_REQUEUE = 76           # a packed task stopped after a checkpoint and asks its pack to be requeued
PACKED_ENV = "SLURM_ROUTER_PACKED"


def pack_task_files(run_dir: str, stage: str, index: int, per_pack: int) -> list[str]:
    """The task files array task `index` runs: the stage's tasks index*K .. index*K + K - 1 (K=1: one task)."""
    from slurm_router.rundir import Manifest
    names = Manifest.load(run_dir).stage_tasks(stage)
    return [str(Path(run_dir) / "tasks" / n / "task.json") for n in names[index * per_pack:(index + 1) * per_pack]]


class Pack:
    """The K job processes of one array task."""

    def __init__(self, task_files: list[str]):
        env = {**os.environ, PACKED_ENV: "1", "PYTHONUNBUFFERED": "1"}
        cpus = int(os.environ.get("SLURM_CPUS_PER_TASK", os.cpu_count() or 1))
        env["SLURM_ROUTER_THREADS"] = str(max(1, cpus // len(task_files)))     # K tasks share the cores
        self.procs = [subprocess.Popen([sys.executable, "-m", "slurm_router.job", f], env=env) for f in task_files]

        self.codes: dict[int, int] = {}

    def _reap(self) -> None:
        # os.waitpid, not Popen.wait/poll: a signal handler (submitit's checkpoint) may wait while the main
        # thread is inside a wait, and Popen's wait lock is not reentrant.
        for p in self.procs:
            if p.pid in self.codes:
                continue
            try:
                pid, status = os.waitpid(p.pid, os.WNOHANG)
            except ChildProcessError:       # reaped by the other waiter; its code is recorded there
                continue
            if pid:
                self.codes[p.pid] = os.waitstatus_to_exitcode(status)

    def forward(self, signum: int) -> None:
        self._reap()
        for p in self.procs:
            if p.pid not in self.codes:
                os.kill(p.pid, signum)

    def wait(self) -> list[int]:
        while True:
            self._reap()
            if len(self.codes) == len(self.procs):
                return [self.codes[p.pid] for p in self.procs]
            time.sleep(0.2)


def _outcome(codes: list[int]) -> str:
    if any(c not in (0, EXIT_STOPPED, EXIT_REQUEUE) for c in codes):
        return "failed"
    if EXIT_REQUEUE in codes:
        return "requeue"
    return "stopped" if EXIT_STOPPED in codes else "completed"


def run_pack(task_files: list[str]) -> int:
    """launcher=sbatch: run the pack; requeue the allocation once if a task asked for it. Exit code as job.py."""
    pack = Pack(task_files)
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: pack.forward(signum))
    codes = pack.wait()
    outcome = _outcome(codes)
    print(f"pack of {len(task_files)} task(s): exit codes {codes}: {outcome}", flush=True)
    if outcome == "requeue":
        from slurm_router.requeue import slurm_job_ref      # JOB_TASK: never the whole array
        subprocess.run(["scontrol", "requeue", slurm_job_ref()], check=True, timeout=60)
        return EXIT_STOPPED
    return {"completed": 0, "stopped": EXIT_STOPPED, "failed": 1}[outcome]


class PackRunner(Checkpointable):
    """launcher=slurm: what submitit runs for a pack; checkpoint() (submitit's USR2 hook) stops the children at
    their step end, then asks submitit to requeue this pack if one of them wants it."""

    _pack: Pack | None = None

    def __call__(self, task_files: list[str]) -> list[int]:
        PackRunner._pack = Pack(task_files)
        codes = PackRunner._pack.wait()
        if _outcome(codes) == "failed":
            raise RuntimeError(f"pack of {len(task_files)} task(s) failed: exit codes {codes} (see each task's log)")
        return codes

    def checkpoint(self, task_files: list[str]):
        pack = PackRunner._pack
        if pack is None:
            return super().checkpoint(task_files)
        pack.forward(signal.SIGUSR2)
        codes = pack.wait()
        return super().checkpoint(task_files) if _outcome(codes) == "requeue" else None
