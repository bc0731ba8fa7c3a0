"""The run directory's manifest: created once every check has passed, loaded (and validated) by status,
resume, analysis and the job alike. File names come from slurm_router.layout; the manifest is rewritten
atomically on every change, so a reader never sees half of it.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime
from importlib import metadata
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from slurm_router.checkpoint import atomic_write_text
from slurm_router.config import UserError
from slurm_router.layout import RunLayout
from slurm_router.lifecycle import TaskState
from slurm_router.plan import Stage


class NotARunDir(UserError):
    """A path that is not a run directory made by python -m slurm_router (or whose manifest is damaged)."""


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("slurm_router", "torch", "transformers", "peft", "submitit", "hydra-core", "pandas"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def new_run_dir(cfg: DictConfig) -> tuple[str, Path]:
    """A fresh, unique run directory path (not created yet: nothing is written before the config checks pass)."""
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    root = (Path(cfg.run_root).expanduser() / cfg.experiment).resolve()
    path, n = root / stamp, 1
    while path.exists():
        n += 1
        path = root / f"{stamp}_{n}"
    return f"{cfg.experiment}-{path.name}", path


class Manifest:
    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> "Manifest":
        """The run's manifest, checked for the fields every reader relies on. Raises NotARunDir (one line)."""
        root = Path(os.path.expanduser(str(run_dir)))
        path = RunLayout(root).manifest
        if not root.is_dir():
            raise NotARunDir(f"{run_dir}: no such directory: give a run directory printed as run_dir: by a run")
        if not path.is_file():
            raise NotARunDir(f"{run_dir}: no manifest.json there: not a run directory made by python -m slurm_router")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise NotARunDir(f"{path}: cannot be read ({type(e).__name__}): the manifest is damaged") from None
        ok = (isinstance(data, dict) and isinstance(data.get("stages"), list) and isinstance(data.get("tasks"), dict)
              and all(isinstance(s, dict) and isinstance(s.get("tasks"), list) for s in data["stages"]))
        if not ok:
            raise NotARunDir(f"{path}: not a slurm_router manifest (no stages or tasks): the manifest is damaged")
        return cls(path, data)

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.path.parent)

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.data, indent=1))

    def stage_tasks(self, stage: str) -> list[str]:
        """The task names of a stage, in array-index order (index i of the stage's array is task i)."""
        return next(s["tasks"] for s in self.data["stages"] if s["name"] == stage)

    def set_task(self, name: str, **fields) -> None:
        self.data["tasks"][name].update(fields)
        self.save()

    def set(self, **fields) -> None:
        self.data.update(fields)
        self.save()


def create_run_dir(cfg: DictConfig, run_id: str, run_dir: Path, stages: list[Stage], launcher: str) -> Manifest:
    """Write config.yaml, every task.json and the manifest. Called only after every check has passed."""
    layout = RunLayout(run_dir)
    run_dir.mkdir(parents=True)
    layout.logs.mkdir()
    atomic_write_text(layout.config, OmegaConf.to_yaml(cfg, resolve=True))
    tasks = {}
    for stage in stages:
        for t in stage.tasks:
            paths = layout.task(t.name)
            paths.dir.mkdir(parents=True)
            atomic_write_text(paths.task_file, t.to_json())
            state = TaskState.CACHED if stage.cached else TaskState.PENDING
            tasks[t.name] = {"stage": t.stage, "variant": t.variant, "index": t.index, "devices": t.devices,
                             "state": state.value, "task_dir": str(paths.dir)}
    data = {"run_id": run_id, "experiment": cfg.experiment, "run_dir": str(run_dir), "launcher": launcher,
            "created": time.time(), "host": platform.node(), "command": sys.argv, "git_commit": _git_commit(),
            "versions": _versions(), "state": "running",
            "stages": [{"name": s.name, "tasks": [t.name for t in s.tasks], "cached": s.cached,
                        "depends_on": s.depends_on} for s in stages],
            "tasks": tasks, "jobs": []}
    manifest = Manifest(layout.manifest, data)
    manifest.save()
    return manifest
