"""launcher.container: how a task's command is wrapped to run inside an image (docs/design/jobs.md, "How a
job runs"). Pure: argv lists, no I/O but os.path.

    apptainer   apptainer exec [--nv] --bind RUN_DIR,DATA,...  IMAGE  python3 -m slurm_router.supervise.job ...
    pyxis       srun ... --container-image=IMAGE --container-mounts=RUN_DIR:RUN_DIR,... --container-workdir=RUN_DIR
                         python3 -m slurm_router.supervise.job ...

Requeue from inside a container: images seldom carry Slurm's client, so the task never calls `scontrol` there.
Whatever runs outside the container does it:
- launcher=sbatch: the batch shell stays outside (the task is its child, not exec'd; the shell passes USR2 and
  TERM on). The task, told by REQUEUE_REQUEST_ENV where, writes a requeue request file and exits EXIT_REQUEUE
  (76) when its verdict (requeue.after_stop) is a requeue; the shell then runs `scontrol requeue` for its own
  array task and exits 75.
- launcher=slurm, apptainer: submitit's own process runs outside, on the submitting interpreter, and starts
  the task as a child `apptainer exec ... python3 -m slurm_router.supervise.job TASK_FILE` (backends/slurm/runners.py ColocatedRunner with
  one task); the child asks for the requeue with exit 76 and submitit requeues, as for co-located tasks.
- launcher=slurm, pyxis: pyxis wraps srun steps, and submitit's process is the step, so it runs inside the
  image: the image needs submitit, and `scontrol` for requeues (else use launcher=sbatch).

Paths are bound at the same place inside: the run dir (code snapshot, checkpoints, logs), data.path,
model.name_or_path and the base cache, plus launcher.container.mounts (SRC[:DST]).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# The task's interpreter inside an image when launcher.python is not set (the submitter's path rarely exists there)
CONTAINER_PYTHON = "python3"
_BAD_BIND = re.compile(r"[,:\x00-\x1f\x7f]")  # both runtimes split their bind lists on ',' and ':'


@dataclass(frozen=True)
class ContainerSpec:
    """One task's container: runtime, image, what to bind (absolute host paths, same place inside)."""

    runtime: str  # apptainer | pyxis
    image: str
    binds: tuple[str, ...] = ()  # host dirs bound at the same path
    mounts: tuple[str, ...] = ()  # the user's SRC[:DST], as given
    runtime_cmd: str = "apptainer"
    gpus: bool = True  # apptainer --nv (the host's NVIDIA driver inside)
    workdir: str | None = None  # pyxis --container-workdir

    def check(self) -> None:
        """ValueError (one line) for what the runtime's bind list cannot carry."""
        if self.runtime not in ("apptainer", "pyxis"):
            raise ValueError(f"container runtime {self.runtime!r}: expected apptainer or pyxis")
        if not self.image or any(c in self.image for c in "\n\r\x00"):
            raise ValueError(f"container image {self.image!r} is empty or holds a newline")
        from slurm_router.config.secrets import redact_text

        if redact_text(self.image) != self.image:  # the job scripts would hold it, readable by all
            raise ValueError(
                f"container image {redact_text(self.image)!r} holds a password: give the registry's credentials "
                "by the environment (APPTAINER_DOCKER_USERNAME and APPTAINER_DOCKER_PASSWORD; pyxis: enroot's "
                "credentials file), not in the image's URI"
            )
        for path in self.binds:
            if _BAD_BIND.search(path):
                raise ValueError(
                    f"{path!r} cannot be bound into a container: ',' and ':' separate the runtime's "
                    "bind list; use a path without them"
                )
        for mount in self.mounts:
            if not mount or "," in mount or any(ord(c) < 32 for c in mount):
                raise ValueError(f"launcher.container.mounts entry {mount!r}: give SRC[:DST] without ','")

    def _bind_list(self, pyxis: bool) -> str:
        """apptainer takes SRC alone (same place inside); pyxis is given SRC:DST always."""
        binds = [*self.binds, *self.mounts]
        return ",".join(f"{b}:{b}" if pyxis and ":" not in b else b for b in binds)

    def exec_argv(self) -> list[str]:
        """apptainer: the words before the interpreter (the task's argv follows IMAGE)."""
        argv = [self.runtime_cmd, "exec"]
        if self.gpus:
            argv.append("--nv")
        binds = self._bind_list(pyxis=False)
        if binds:
            argv += ["--bind", binds]
        return [*argv, self.image]

    def srun_args(self) -> list[str]:
        """pyxis: srun's options that run the step in the image."""
        args = [f"--container-image={self.image}"]
        mounts = self._bind_list(pyxis=True)
        if mounts:
            args.append(f"--container-mounts={mounts}")
        if self.workdir:
            args.append(f"--container-workdir={self.workdir}")
        return args


def _dir_of(path: str | None) -> str | None:
    if not path or "://" in str(path):
        return None
    p = Path(os.path.expanduser(str(path))).absolute()
    return str(p.parent if p.is_file() else p)


def _absolute(path: str) -> str:
    return str(Path(os.path.expanduser(path)).absolute()) if "://" not in path else path


def _image(runtime: str, image: str) -> str:
    """apptainer: a file path (made absolute) or a URI; pyxis: an image name (nvcr.io#org/image:tag), or a local
    squashfs file when one exists at that path."""
    if runtime == "apptainer" or os.path.exists(os.path.expanduser(image)):
        return _absolute(image)
    return image


def task_binds(cfg, run_dir: str) -> tuple[str, ...]:
    """What a task reads or writes outside its run dir: data.path, model.name_or_path, the base cache."""
    from slurm_router.artifacts.base_cache import cache_root

    paths = [run_dir, _dir_of(cfg.data.get("path")), _dir_of(cfg.model.get("name_or_path"))]
    if cfg.base.get("enabled"):
        paths.append(str(cache_root(cfg).absolute()))
    out: list[str] = []
    for p in paths:
        if p and p not in out:
            out.append(p)
    return tuple(out)


def container_spec(cfg, run_dir: str, gpus: bool) -> ContainerSpec | None:
    """launcher.container as a ContainerSpec for this run (None: no container). Image and runtime_cmd paths
    are made absolute (the job runs elsewhere); check() has passed."""
    c = cfg.launcher.get("container")
    if c is None or not c.image:
        return None
    cmd = str(c.runtime_cmd)
    spec = ContainerSpec(
        runtime=str(c.runtime),
        image=_image(str(c.runtime), str(c.image)),
        binds=task_binds(cfg, run_dir),
        mounts=tuple(str(m) for m in c.mounts or ()),
        gpus=gpus,
        runtime_cmd=_absolute(cmd) if os.sep in cmd else cmd,
        workdir=run_dir if c.runtime == "pyxis" else None,
    )
    spec.check()
    return spec


def task_python(cfg, in_container: bool) -> str:
    """The interpreter that runs the task: launcher.python, else the submitter's (python3 inside an image)."""
    python = cfg.launcher.get("python")
    if python:
        return str(python)
    return CONTAINER_PYTHON if in_container else sys.executable


def resolve_container(cfg) -> None:
    """Before anything is written: launcher.container's image and runtime_cmd paths made absolute in cfg (the
    job runs elsewhere, and resume= may start from another folder), and what the runtime's bind lists cannot
    carry (a ',' or ':' in run_root or a bound path) refused in one line (UserError)."""
    from slurm_router.errors import UserError

    c = cfg.launcher.get("container")
    if c is None or not c.image:
        return
    c.image = _image(str(c.runtime), str(c.image))
    if os.sep in str(c.runtime_cmd):
        c.runtime_cmd = _absolute(str(c.runtime_cmd))
    try:
        container_spec(cfg, str(Path(os.path.expanduser(cfg.run_root)).absolute() / cfg.experiment), gpus=True)
    except ValueError as e:
        raise UserError(f"launcher.container: {e}") from None
