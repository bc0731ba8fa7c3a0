"""The run directory's file names, and nothing else: the one place that knows them (docs/ARCHITECTURE.md).

    runs/<experiment>/<timestamp>/        RunLayout(run_dir)
      config.yaml  manifest.json          the resolved config; tasks, states, job ids, versions
      run.lock  manifest.lock             who writes this run now (runlock.py); the manifest's own short lock
      submit*.sbatch                      launcher=sbatch's rendered scripts
      tasks/<name>/                       TaskPaths: task.json, events-rank<N>.jsonl, result.json,
                                          attempts.json, checkpoints/step-<N>.pt (+ .json sha256 sidecar)
      logs/<name>.log                     each task's output (local launcher; Slurm's own logs under Slurm)
      report/                             summary.json, report.md, report.html, *.csv, *.png

Stable across requeues and resumes: a requeued task finds its own files by name. Pure paths, no I/O.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CONFIG = "config.yaml"
MANIFEST = "manifest.json"
RUN_LOCK = "run.lock"               # held (flock) by the process that runs or resumes the run, and its local jobs
MANIFEST_LOCK = "manifest.lock"     # held for each read-modify-write of manifest.json (rundir.Manifest)
TASK_FILE = "task.json"
RESULT_FILE = "result.json"
ATTEMPTS_FILE = "attempts.json"
BASE_WEIGHTS = "model.pt"           # the base stage's cache: <cache>/<hash>/model.pt + model.json sidecar + meta.json
BASE_META = "meta.json"
EVENTS_GLOB = "events-rank*.jsonl"
CHECKPOINT_GLOB = "step-*.pt"
SIDECAR_GLOB = "step-*.json"


def events_name(rank: int) -> str:
    return f"events-rank{rank}.jsonl"


def checkpoint_file(checkpoints: str | os.PathLike, step: int) -> Path:
    """checkpoints/step-NNNNNNNN.pt: zero-padded, so names sort by step."""
    return Path(checkpoints) / f"step-{step:08d}.pt"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step a checkpoint file (or its sidecar) holds: step-00000012.pt -> 12."""
    return int(Path(path).stem.split("-", 1)[1])


@dataclass(frozen=True)
class TaskPaths:
    """One task's folder, RUN_DIR/tasks/<name>/."""
    dir: Path

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def task_file(self) -> Path:
        return self.dir / TASK_FILE

    @property
    def result(self) -> Path:
        return self.dir / RESULT_FILE

    @property
    def attempts(self) -> Path:
        return self.dir / ATTEMPTS_FILE

    @property
    def checkpoints(self) -> Path:
        return self.dir / "checkpoints"

    def events(self, rank: int = 0) -> Path:
        return self.dir / events_name(rank)

    def events_files(self) -> list[Path]:
        return sorted(self.dir.glob(EVENTS_GLOB))

    def checkpoint(self, step: int) -> Path:
        return checkpoint_file(self.checkpoints, step)


@dataclass(frozen=True)
class RunLayout:
    """A run directory's paths (the directory need not exist yet)."""
    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST

    @property
    def run_lock(self) -> Path:
        """run.lock: the one writer of this run (slurm_router.runlock), and who it is (host, pid, since, command)."""
        return self.root / RUN_LOCK

    @property
    def manifest_lock(self) -> Path:
        return self.root / MANIFEST_LOCK

    @property
    def tasks(self) -> Path:
        return self.root / "tasks"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def summary(self) -> Path:
        """report/summary.json: the report's machine-readable result."""
        return self.report / "summary.json"

    def task(self, name: str) -> TaskPaths:
        return TaskPaths(self.tasks / str(name))

    def log(self, name: str) -> Path:
        """A task's output under the local launcher (Slurm jobs log where Slurm puts them)."""
        return self.logs / f"{name}.log"

    def sbatch_script(self, stage: str, last: bool, resume: int = 0) -> Path:
        """launcher=sbatch: submit.sbatch for the last stage, submit-<stage>.sbatch before it; -resume<N> for
        the N-th resume's partial arrays."""
        suffix = f"-resume{resume}" if resume else ""
        return self.root / (f"submit{suffix}.sbatch" if last else f"submit-{stage}{suffix}.sbatch")
