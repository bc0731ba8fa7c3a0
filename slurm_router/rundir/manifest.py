"""The run directory's manifest: created once every check has passed, loaded (and validated) by status,
resume, analysis and the job alike. File names come from slurm_router.rundir.layout; the manifest is rewritten
atomically on every change, so a reader never sees half of it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from importlib import metadata
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from slurm_router.config.checks import check_writable_dir
from slurm_router.config.secrets import redact_text, write_secrets
from slurm_router.errors import UserError
from slurm_router.fileio import WriteError, atomic_write_text
from slurm_router.rundir.layout import RunLayout
from slurm_router.rundir.lifecycle import TaskState
from slurm_router.rundir.lock import acquire, let_go, short_lock
from slurm_router.rundir.spec import Stage


class NotARunDir(UserError):
    """A path that is not a run directory made by python -m slurm_router (or whose manifest is damaged)."""


def _versions(packages: tuple[str, ...] = ()) -> dict:
    """Python's version and the installed packages': the core's, then the run's backend's (its `packages`)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("slurm_router", "torch", "transformers", "peft", "hydra-core", "pandas", *packages):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _git_dirty() -> bool | None:
    """Whether the checkout the code ran from has uncommitted changes to tracked files (None: not a checkout)."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return bool(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# a task entry's own fields, never copied from a fused task's leader to its members
IDENTITY_FIELDS = ("stage", "variant", "seed", "index", "task_dir", "devices", "members", "fused_into")


def mirror_leaders(data: dict) -> None:
    """resources.fuse_variants: a member's entry (fused_into its leader) takes every field of its leader's entry
    but its identity (IDENTITY_FIELDS): the state, job id, exit code, note and times a launcher or job recorded
    on the task that runs are its members' too."""
    tasks = data.get("tasks")
    if not isinstance(tasks, dict):
        return
    for entry in tasks.values():
        leader = tasks.get(entry.get("fused_into")) if isinstance(entry, dict) and entry.get("fused_into") else None
        if isinstance(leader, dict):
            entry.update({k: v for k, v in leader.items() if k not in IDENTITY_FIELDS})


def new_run_dir(cfg: DictConfig) -> tuple[str, Path]:
    """A fresh, unique run directory path (not created yet: nothing is written before the config checks pass)
    in a folder that can be written (a path under /proc, a file, no permission: one line, UserError)."""
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    root = check_writable_dir(Path(cfg.run_root) / cfg.experiment, f"run_root={cfg.run_root!r}").resolve()
    path, n = root / stamp, 1
    while path.exists():
        n += 1
        path = root / f"{stamp}_{n}"
    return f"{cfg.experiment}-{path.name}", path


class Manifest:
    """A run's manifest.json. Every write is a read-modify-write under its own short lock (layout's manifest.lock,
    rundir.lock.short_lock): the file is read again, this change applied to it, and the file replaced atomically, so
    a local job process recording its own end and the launcher recording its states never overwrite each
    other's fields. `data` is the file as of this object's last read or write."""

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
        ok = (
            isinstance(data, dict)
            and isinstance(data.get("stages"), list)
            and isinstance(data.get("tasks"), dict)
            and all(isinstance(s, dict) and isinstance(s.get("tasks"), list) for s in data["stages"])
        )
        if not ok:
            raise NotARunDir(f"{path}: not a slurm_router manifest (no stages or tasks): the manifest is damaged")
        return cls(path, data)

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.path.parent)

    def _read(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and isinstance(data.get("tasks"), dict) else None

    def refresh(self) -> "Manifest":
        """Read the file again (another process may have written it)."""
        self.data = self._read() or self.data
        return self

    def update(self, change) -> None:
        """change(data) applied to the file as it is now, under the manifest's lock; then `data` is that. Every
        write then mirrors each fused task's leader onto its members (mirror_leaders): no writer knows of groups."""
        with short_lock(self.layout.manifest_lock):
            data = self._read() or self.data
            change(data)
            mirror_leaders(data)
            atomic_write_text(self.path, json.dumps(data, indent=1))
        self.data = data

    def save(self) -> None:
        """Write the changes made in place to `data`; fields only the file has (another process's) stay."""
        mine = self.data

        def merge(disk: dict) -> None:
            if disk is mine:
                return
            tasks = disk.get("tasks") or {}
            for name, fields in mine["tasks"].items():
                tasks.setdefault(name, {}).update(fields)
            disk.update({k: v for k, v in mine.items() if k != "tasks"}, tasks=tasks)

        self.update(merge)

    def stage_tasks(self, stage: str) -> list[str]:
        """The task names of a stage, in array-index order (index i of the stage's array is task i)."""
        return next(s["tasks"] for s in self.data["stages"] if s["name"] == stage)

    def set_task(self, name: str, **fields) -> None:
        self.update(lambda data: data["tasks"][name].update(fields))

    def set(self, **fields) -> None:
        self.update(lambda data: data.update(fields))


def create_run_dir(
    cfg: DictConfig,
    run_id: str,
    run_dir: Path,
    stages: list[Stage],
    launcher: str,
    lock: bool = True,
    secrets: dict | None = None,
    packages: tuple[str, ...] = (),
) -> Manifest:
    """Write config.yaml, every task.json and the manifest (cfg and the specs show credentials as ***; secrets:
    their real values, into RUN_DIR/secrets.json, mode 0600: config/secrets.py), holding the run's lock
    (rundir/lock.py) from the moment the directory exists: a Ctrl-C that finds the manifest finds this process its writer, and marks the
    run interrupted (lock=False: a dry_run preview, which nothing runs). Called only after every check passed.
    A write that fails (disk full, permission), or a Ctrl-C before the manifest is whole, removes what it made
    (and lets the lock go) and raises one line. packages: the run's backend's, whose versions the manifest records
    beside the core's (`Backend.packages`)."""
    run_dir, run_id = _claim(run_dir, run_id, stages)
    try:
        owner = acquire(run_dir).info if lock else None
        if secrets:
            write_secrets(RunLayout(run_dir).secrets, secrets)
        return _fill_run_dir(cfg, run_id, run_dir, stages, launcher, owner, packages)
    except BaseException as e:  # a Ctrl-C too: never a half-made run directory
        let_go(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        if isinstance(e, OSError):
            raise WriteError.of(e.filename or run_dir, e) from None
        raise


def _claim(run_dir: Path, run_id: str, stages: list[Stage]) -> tuple[Path, str]:
    """Make the run's directory, atomically: another run that chose the same name (started in the same second,
    by a script launching runs in parallel) made it first when mkdir finds it there, so this run takes the next
    free name, <name>_2, <name>_3, ..., and its task specs are moved to it before anything is written."""
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError.of(run_dir.parent, e) from None
    stem = re.sub(r"_\d+$", "", run_dir.name)  # new_run_dir's <timestamp>_<n>: count on from the timestamp
    first, n = run_dir, 1
    while True:
        try:
            run_dir.mkdir()
            break
        except FileExistsError:
            n += 1
            run_dir = run_dir.with_name(f"{stem}_{n}")
        except OSError as e:
            raise WriteError.of(run_dir, e) from None
    if run_dir != first:  # new_run_dir's run id ends with the folder's name
        run_id = run_id[: -len(first.name)] + run_dir.name if run_id.endswith(first.name) else f"{run_id}_{n}"
        for t in (t for s in stages for t in [*s.tasks, *s.fused]):
            t.run_dir, t.run_id = str(run_dir), run_id
    return run_dir, run_id


def _fill_run_dir(
    cfg: DictConfig,
    run_id: str,
    run_dir: Path,
    stages: list[Stage],
    launcher: str,
    owner: dict | None,
    packages: tuple[str, ...] = (),
) -> Manifest:
    layout = RunLayout(run_dir)
    layout.logs.mkdir()
    atomic_write_text(layout.config, OmegaConf.to_yaml(cfg, resolve=True))
    tasks = {}
    for stage in stages:
        fused = {t.name: t for t in stage.fused}
        for t in (t for leader in stage.tasks for t in [leader, *(fused[m] for m in leader.members)]):
            paths = layout.task(t.name)  # every task of a fused group has its own folder and task.json
            paths.dir.mkdir(parents=True)
            atomic_write_text(paths.task_file, t.to_json())
            state = TaskState.CACHED if stage.cached else TaskState.PENDING
            tasks[t.name] = {
                "stage": t.stage,
                "variant": t.variant,
                "seed": t.seed,
                "index": t.index,
                "devices": t.devices,
                "state": state.value,
                "task_dir": str(paths.dir),
                **({"members": t.members} if t.members else {}),
                **({"fused_into": t.fused_into} if t.fused_into else {}),
            }
    data = {
        "run_id": run_id,
        "experiment": cfg.experiment,
        "run_dir": str(run_dir),
        "launcher": launcher,
        "created": time.time(),
        "host": platform.node(),
        "command": [redact_text(a) for a in sys.argv],
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "versions": _versions(packages),
        "state": "running",
        "stages": [
            {"name": s.name, "tasks": [t.name for t in s.tasks], "cached": s.cached, "depends_on": s.depends_on}
            for s in stages
        ],
        "tasks": tasks,
        "jobs": [],
        **({"owner": owner} if owner else {}),  # who holds run.lock: what status checks for life
    }
    manifest = Manifest(layout.manifest, data)
    manifest.save()
    return manifest
