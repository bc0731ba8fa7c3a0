"""The run directory's file names, and nothing else: the one place that knows them (docs/run-directory.md).

    runs/<experiment>/<timestamp>/        RunLayout(run_dir)
      config.yaml  manifest.json          the resolved config; tasks, states, job ids, versions
      run.lock  manifest.lock             who writes this run now (rundir/lock.py); the manifest's own short lock
      secrets.json                        mode 0600: the credentials config.yaml shows as *** (config/secrets.py)
      submit*.sbatch                      launcher=sbatch's rendered scripts
      preview.txt  submit-all.sh          dry_run=true: the plan as printed; the Slurm submit commands in order
      code/  code.diff  pip-freeze.txt    launcher.snapshot: the submitted source, its uncommitted diff, pip freeze
      code-resume<N>/ ...                 the same, taken by resume=RUN_DIR new_snapshot=true (the N-th resume)
      tasks/<name>/                       TaskPaths: task.json, events-rank<N>.jsonl, result.json,
                                          attempts.json, evals.jsonl (prune=true: prune.py),
                                          checkpoints/step-<N>.pt (+ .json sha256 sidecar),
                                          adapter/ (+ adapter-best/ with train.eval_every): peft's format;
                                          model/ instead for a variant without LoRA (full fine-tuning)
      base-init/<key>/                    the seed-built base an adapter sits on when there is no base stage
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
RUN_LOCK = "run.lock"  # held (flock) by the process that runs or resumes the run, and its local jobs
MANIFEST_LOCK = "manifest.lock"  # held for each read-modify-write of manifest.json (rundir.Manifest)
TASK_FILE = "task.json"
RESULT_FILE = "result.json"
ATTEMPTS_FILE = "attempts.json"
CODE_DIR = "code"  # launcher.snapshot: the tracked source as submitted; jobs import it (snapshot.py)
CODE_DIFF = "code.diff"  # ... `git diff HEAD` of a dirty checkout at submission
PIP_FREEZE = "pip-freeze.txt"  # ... the submitting interpreter's `pip freeze`
REQUEUE_REQUEST = "requeue-request"  # logs/requeue-request.<job id>: a containerised task asks its batch script
SETUP_FAILED = "setup-failed"  # logs/setup-failed.<job id>: which launcher.setup line stopped that job (one line)
TRACKERS_DIR = "trackers"  # RUN_DIR/trackers/: tensorboard/, mlruns/, wandb/ (tracker.dir's default)
TRACKER_FILE = "tracker.json"  # RUN_DIR/tasks/<task>/tracker.json: each tracker's run, for later attempts
SECRETS = "secrets.json"  # mode 0600, owner only: the real values of the settings shown as *** (config/secrets.py)
PREVIEW_FILE = "preview.txt"  # dry_run=true: the plan, as printed (launch/preview.py)
EVALS_FILE = "evals.jsonl"  # prune=true: rank 0's in-training evaluations, read by the other tasks (prune.py)
DECISIONS_FILE = "decisions.jsonl"  # prune=true: RUN_DIR/decisions.jsonl, the run's looks (verdict/contest.py)
DECISIONS_LOCK = "decisions.lock"  # held (flock) while a task reads the evaluations and takes a look
# The base stage's cache entry <cache>/base/<hash>/ is a transformers checkpoint folder (base_cache.py):
BASE_WEIGHTS = "model.safetensors"  # its weights, with a model.json sha256 sidecar
BASE_META = "meta.json"  # the base task's result, written last: the entry is complete
BASE_INIT = "base-init"  # RUN_DIR/base-init/<key>/: a seed-built base saved for its adapters
ADAPTER = "adapter"  # tasks/<name>/adapter/: the final LoRA adapter (peft save_pretrained)
ADAPTER_BEST = "adapter-best"  # tasks/<name>/adapter-best/: the one with the lowest held-out loss
FULL_MODEL = "model"  # tasks/<name>/model/: a variant trained without LoRA, the whole model
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
HELD_OUT = "held_out.json"  # in each of those folders: the step and held-out loss of its weights
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

    @property
    def adapter(self) -> Path:
        """adapter/: the final LoRA adapter in peft's own format (adapter_config.json, adapter_model.safetensors)."""
        return self.dir / ADAPTER

    @property
    def adapter_best(self) -> Path:
        """adapter-best/: the adapter with the lowest held-out loss (train.eval_every)."""
        return self.dir / ADAPTER_BEST

    @property
    def full_model(self) -> Path:
        """model/: a variant trained without LoRA saves its whole model here (save_pretrained)."""
        return self.dir / FULL_MODEL


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
    def secrets(self) -> Path:
        return self.root / SECRETS

    @property
    def run_lock(self) -> Path:
        """run.lock: the one writer of this run (slurm_router.rundir.lock), and who it is (host, pid, since, command)."""
        return self.root / RUN_LOCK

    @property
    def manifest_lock(self) -> Path:
        return self.root / MANIFEST_LOCK

    @property
    def tasks(self) -> Path:
        return self.root / "tasks"

    @property
    def decisions(self) -> Path:
        """decisions.jsonl: prune=true's looks, one line each, recorded once for the run (verdict/contest.py)."""
        return self.root / DECISIONS_FILE

    @property
    def decisions_lock(self) -> Path:
        return self.root / DECISIONS_LOCK

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

    @property
    def code(self) -> Path:
        """code/: launcher.snapshot's copy of the tracked source, first on every job's PYTHONPATH."""
        return self.root / CODE_DIR

    @property
    def code_diff(self) -> Path:
        return self.root / CODE_DIFF

    @property
    def pip_freeze(self) -> Path:
        return self.root / PIP_FREEZE

    def snapshot_files(self, resume: int = 0) -> tuple[Path, Path, Path]:
        """(code/, code.diff, pip-freeze.txt) of the submission's snapshot; with resume=N those of the snapshot
        `new_snapshot=true` took at the N-th resume (code-resume<N>/, code-resume<N>.diff,
        pip-freeze-resume<N>.txt): a new record beside the submission's, never over it."""
        if not resume:
            return self.code, self.code_diff, self.pip_freeze
        suffix = f"-resume{resume}"
        return (
            self.root / f"{CODE_DIR}{suffix}",
            self.root / CODE_DIFF.replace(".", f"{suffix}.", 1),
            self.root / PIP_FREEZE.replace(".", f"{suffix}.", 1),
        )

    def requeue_request(self, job_id: str) -> Path:
        """logs/requeue-request.<job id>: a task inside a container asks the batch script to requeue it."""
        return self.logs / f"{REQUEUE_REQUEST}.{job_id}"

    def setup_failed(self, job_id: str) -> Path:
        """logs/setup-failed.<job id>: a Slurm job's launcher.setup line that failed, and its exit code, in words
        (backends/slurm/setup_lines.py); removed when a later attempt's setup passes."""
        return self.logs / f"{SETUP_FAILED}.{job_id}"

    def init_base(self, key: str) -> Path:
        """base-init/<key>/: the seed-built base (no base stage) its variants' adapters name, saved once."""
        return self.root / BASE_INIT / key

    def log(self, name: str) -> Path:
        """A task's output under the local launcher (Slurm jobs log where Slurm puts them)."""
        return self.logs / f"{name}.log"
