"""resume=RUN_DIR: continue the unfinished tasks of a run, each from its newest valid checkpoint, with the
launcher the run used (a Slurm run's unfinished tasks are submitted again, into the same run dir), or here
with launcher=local. Completed tasks are skipped; a base stage finished by another run is taken from the cache.

    python -m slurm_router resume=runs/lora_ab/2024-01-01_12-00-00
    python -m slurm_router resume=runs/lora_ab/2024-01-01_12-00-00 launcher=local
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf

from slurm_router.config import UserError
from slurm_router.job import RESULT_FILE
from slurm_router.plan import Stage, TaskSpec


def _load_run(arg: str) -> tuple[Path, object, dict]:
    run_dir = Path(os.path.expanduser(arg)).resolve()
    if not run_dir.is_dir():
        raise UserError(f"resume={arg}: no such directory: give a run directory printed as run_dir: by a run")
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
        stages = manifest["stages"]
        if not isinstance(stages, list):
            raise TypeError
    except FileNotFoundError:
        raise UserError(f"resume={arg}: no manifest.json there: not a run directory made by python -m slurm_router")\
            from None
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"resume={arg}: manifest.json is damaged (not a slurm_router manifest)") from None
    try:
        cfg = OmegaConf.load(run_dir / "config.yaml")
    except Exception:                           # missing, unreadable or not YAML: same advice
        raise UserError(f"resume={arg}: config.yaml is missing or damaged") from None
    return run_dir, cfg, manifest


def _task(run_dir: Path, name: str) -> TaskSpec:
    path = run_dir / "tasks" / str(name) / "task.json"
    try:
        spec = TaskSpec.load(path)
    except (OSError, ValueError, TypeError):
        raise UserError(f"resume: {path} is missing or damaged") from None
    if Path(spec.run_dir).resolve() != run_dir:
        raise UserError(f"resume: {path} belongs to {spec.run_dir}: a run directory cannot be moved and resumed")
    return spec


def plan_resume(arg: str) -> tuple[Path, object, dict, list[Stage]]:
    """(run dir, config, manifest, stages holding only the unfinished tasks). Raises UserError (one line) for
    a run dir that is not one, or a task whose checkpoints are all damaged."""
    from slurm_router.checkpoint import CheckpointError, latest_valid_checkpoint
    run_dir, cfg, manifest = _load_run(arg)
    stages, notes = [], []
    for s in manifest["stages"]:
        todo = []
        for name in s.get("tasks", []):
            spec = _task(run_dir, name)
            done = spec.task_dir / RESULT_FILE
            cache = Path(spec.save_weights).with_name("meta.json") if spec.save_weights else None
            if not done.is_file() and cache is not None and cache.is_file() and Path(spec.save_weights).is_file():
                shutil.copy(cache, done)         # another run has trained this base since: reuse it
            if done.is_file():
                notes.append(f"{name} completed")
                continue
            try:
                path, warnings = latest_valid_checkpoint(spec.task_dir / "checkpoints")
            except CheckpointError as e:
                raise UserError(f"resume: task {name}: {e}") from None
            for w in warnings:
                print(f"warning: {name}: {w}", file=sys.stderr)
            notes.append(f"{name} from {'step ' + path.stem.split('-')[1].lstrip('0') if path else 'step 0'}")
            todo.append(spec)
        stages.append(Stage(s["name"], todo, cached=not todo, depends_on=list(s.get("depends_on", []))))
    print(f"resume {run_dir}: {', '.join(notes)}")
    return run_dir, cfg, manifest, stages


def renew_timeout_budget(specs: list[TaskSpec]) -> None:
    """A resume is the user's decision to go on: each task gets launcher.max_requeues time-limit requeues
    afresh (its attempt count and requeue history stay)."""
    from slurm_router.requeue import reset_timeouts
    for spec in specs:
        reset_timeouts(spec.task_dir)
