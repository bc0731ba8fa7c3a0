"""resume=RUN_DIR: continue the unfinished tasks of a run, each from its newest valid checkpoint, with the
launcher the run used (a Slurm run's unfinished tasks are submitted again, into the same run dir), or here
with launcher=local. Completed tasks are skipped; a base stage finished by another run is taken from the cache.

    python -m slurm_router resume=runs/lora_ab/2024-01-01_12-00-00
    python -m slurm_router resume=runs/lora_ab/2024-01-01_12-00-00 launcher=local
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import cast

from omegaconf import DictConfig, OmegaConf

from slurm_router.errors import UserError
from slurm_router.launch.base import cached_base
from slurm_router.launch.preview import PREVIEWED
from slurm_router.rundir.layout import checkpoint_step
from slurm_router.rundir.lifecycle import TaskState, finished, lost_weights
from slurm_router.rundir.manifest import Manifest
from slurm_router.rundir.spec import Stage, TaskSpec


def _load_run(arg: str) -> tuple[Manifest, DictConfig]:
    """The run's validated manifest (NotARunDir: one line) and its own config.yaml, read once this process holds
    the run's lock (rundir.lock.RunInUse, one line naming the holder, if another one does): a plan is made from
    the current state, and two resumes never both run or submit the same tasks."""
    from slurm_router.rundir.lock import own_run

    manifest = Manifest.load(Path(arg).expanduser().resolve())  # a run dir, before run.lock is made in it
    if manifest.data.get("state") == PREVIEWED:  # refused before run.lock: a preview is left as it was
        raise UserError(
            f"resume={arg}: a dry_run=true preview, never run: nothing to resume; to run it, give the command "
            "that made it without dry_run=true"
        )
    own_run(manifest)  # its manifest write reads the file again
    try:
        cfg = cast(DictConfig, OmegaConf.load(manifest.layout.config))
    except Exception:  # missing, unreadable or not YAML: same advice
        raise UserError(f"resume={arg}: config.yaml is missing or damaged") from None
    from slurm_router.config.secrets import read_secrets, reveal

    if read_secrets(manifest.layout.secrets):  # config.yaml shows credentials as ***: the checks need the real ones
        cfg = OmegaConf.create(reveal(cast(dict, OmegaConf.to_container(cfg)), manifest.layout.secrets)[0])
    return manifest, cfg


def _task(manifest: Manifest, name: str) -> TaskSpec:
    path = manifest.layout.task(name).task_file
    try:
        spec = TaskSpec.load(path)
    except (OSError, ValueError, TypeError):
        raise UserError(f"resume: {path} is missing or damaged") from None
    if Path(spec.run_dir).resolve() != manifest.layout.root:
        raise UserError(f"resume: {path} belongs to {spec.run_dir}: a run directory cannot be moved and resumed")
    return spec


def plan_resume(arg: str) -> tuple[Manifest, DictConfig, list[Stage]]:
    """(manifest, config, stages holding only the unfinished tasks). Raises UserError (one line) for a run dir
    that is not one, or a task whose checkpoints are all damaged. A fused task (resources.fuse_variants) runs
    again, as one task from its leader's checkpoint, while any of its variants has no result."""
    from slurm_router.worker.checkpoint import CheckpointError, latest_valid_checkpoint

    manifest, cfg = _load_run(arg)
    check_config_unchanged(manifest)
    stages, notes = [], []
    for s in manifest.data["stages"]:
        todo, reuse, fused = [], [], []
        for name in s["tasks"]:  # the tasks that run: a fused task's members are never resumed alone
            spec = _task(manifest, name)
            members = [_task(manifest, m) for m in spec.members]
            paths = manifest.layout.task(name)
            shown = f"{name} (+ {', '.join(spec.members)} fused)" if spec.members else name
            if all(finished(manifest.layout.task(n)) for n in spec.group):  # every variant of it
                notes.append(f"{shown} completed{_record_finished(manifest, name)}")
                continue
            for n in spec.group:  # finished once, its final adapter deleted since: trained again
                if lost := lost_weights(manifest.layout.task(n)):
                    print(f"resume: {n} completed, but its {lost} is gone: the task trains again to rebuild it")
            if cached_base(spec):  # another run has trained this base since: submit_stages reuses it
                notes.append(f"{name} from the base cache")
                reuse.append(spec)
                continue
            try:
                path, warnings = latest_valid_checkpoint(paths.checkpoints)
            except CheckpointError as e:
                raise UserError(f"resume: task {name}: {e}") from None
            for w in warnings:
                print(f"warning: {name}: {w}", file=sys.stderr)
            notes.append(f"{shown} from step {checkpoint_step(path) if path else 0}")
            todo.append(spec)
            fused += members
        depends_on = list(s.get("depends_on", []))
        stages.append(Stage(s["name"], todo or reuse, cached=not todo, depends_on=depends_on, fused=fused))
    print(f"resume {manifest.layout.root}: {', '.join(notes)}")
    return manifest, cfg, stages


def _record_finished(manifest: Manifest, name: str) -> str:
    """A finished task the manifest records otherwise (a stop signal during its exit, before that was read as
    finished): recorded completed now, so that status and the report agree with its files. What it said, or ''."""
    said = manifest.data["tasks"][name].get("state")
    if said in (TaskState.COMPLETED.value, TaskState.CACHED.value):
        return ""
    manifest.set_task(name, state=TaskState.COMPLETED.value, note=f"finished: recorded {said} before resume=")
    return f" (its result is whole: recorded completed, not {said})"


class _Unset:
    def __repr__(self) -> str:
        return "(not set)"


_UNSET = _Unset()


def _first_difference(edited, ran, key: str = ""):
    """(dotted key, edited value, value that ran) of the first setting that differs, or None."""
    if not (isinstance(edited, dict) and isinstance(ran, dict)):
        return None if edited == ran else (key, edited, ran)
    for k in [*edited, *(k for k in ran if k not in edited)]:
        found = _first_difference(edited.get(k, _UNSET), ran.get(k, _UNSET), f"{key}.{k}" if key else str(k))
        if found:
            return found
    return None


def check_config_unchanged(manifest: Manifest) -> None:
    """RUN_DIR/config.yaml against what every task recorded (task.json, what a resumed task runs): an edit to it
    would be ignored, and the run's results labelled by settings that never ran. UserError naming the first key."""
    from slurm_router.config.variants import variant_configs

    path = manifest.layout.config
    # as written: credentials shown as *** in config.yaml and task.json alike (config/secrets.py)
    edited = cast(DictConfig, OmegaConf.load(path))
    fix = "undo the edit, or start a new run with the new settings"
    if not isinstance(edited, DictConfig) or "variants" not in edited:  # every config.yaml written has it
        raise UserError(f"resume: {path} was edited: it has no variants key (each run's config.yaml has one): {fix}")
    try:
        variants = variant_configs(edited) or {"main": edited}  # no variants: one task, "main"
    except UserError as e:
        raise UserError(f"resume: {path} was edited: {e}") from None
    for s in manifest.data["stages"]:
        for name in (n for t in s["tasks"] for n in _task(manifest, t).group):
            spec = _task(manifest, name)
            now = edited if spec.stage == "base" else variants.get(spec.variant)
            if now is None:
                raise UserError(
                    f"resume: {path} was edited: it has no variant {spec.variant}, which task {name} runs: {fix}"
                )
            found = _first_difference(OmegaConf.to_container(now, resolve=True), spec.config)
            if found:
                key, new, old = found
                raise UserError(
                    f"resume: {path} was edited: it gives task {name} {key}={new!r}, but the task runs with "
                    f"{key}={old!r} (tasks/{name}/task.json): {fix}"
                )


def renew_timeout_budget(specs: list[TaskSpec]) -> None:
    """A resume is the user's decision to go on: each task gets launcher.max_requeues time-limit requeues and
    launcher.max_failures retries afresh (its attempt count, requeue and failure history stay)."""
    from slurm_router.rundir.attempts import reset_timeouts
    from slurm_router.supervise.retry import renew

    for spec in specs:
        reset_timeouts(spec.task_dir)
        renew(spec.task_dir)
