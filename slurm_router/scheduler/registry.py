"""The scheduler backends by name: the one place a backend (and a `launcher=` kind) is looked up.

A backend is a package (backends/<name>/) whose `BACKEND` is a `scheduler.base.Backend`. It is named here by
its module path and imported only when asked for, so every room may look up the run's backend (the report, the
runs list, a job process) while the backends themselves sit above the launch room. A backend outside the package
joins through the entry point group `slurm_router.backends` (name = module), or, for one process tree (a test's
stub), BACKENDS_ENV="name=module,...".
"""

from __future__ import annotations

import functools
import importlib
import os
from importlib.metadata import entry_points
from typing import Any

from slurm_router.errors import UserError
from slurm_router.scheduler.base import Backend, JobEnvironment

BACKENDS: dict[str, str] = {  # a scheduler's name -> its package; the order is the launcher kinds' order
    "local": "slurm_router.backends.local",
    "slurm": "slurm_router.backends.slurm",
}
BACKENDS_ENV = "SLURM_ROUTER_BACKENDS"
ENTRY_POINTS = "slurm_router.backends"
DEFAULT = "slurm"  # a manifest that names no launcher predates the local launcher


@functools.cache
def _installed() -> dict[str, str]:
    """The backends installed packages declare (read once: every job process and status poll asks)."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS)}


def _modules() -> dict[str, str]:
    found = {**BACKENDS, **_installed()}
    for item in filter(None, os.environ.get(BACKENDS_ENV, "").split(",")):
        name, _, module = item.partition("=")
        found[name.strip()] = module.strip()
    return found


@functools.cache
def _load(module: str) -> Backend:
    return importlib.import_module(module).BACKEND


def backends() -> dict[str, Backend]:
    return {name: _load(module) for name, module in _modules().items()}


def backend(name: str) -> Backend:
    try:
        return _load(_modules()[name])
    except KeyError:
        raise UserError(f"no scheduler backend {name!r}; there are: {', '.join(_modules())}") from None


def launcher_kinds() -> dict[str, Backend]:
    """Every `launcher=` kind, with the backend it belongs to."""
    return {kind: b for b in backends().values() for kind in b.launchers}


def backend_of(kind: str) -> Backend:
    kinds = launcher_kinds()
    if kind not in kinds:
        raise UserError(f"launcher={kind}: no such launcher; choose one of: {', '.join(kinds)}")
    return kinds[kind]


def launcher_class(kind: str):
    """The `launch.base.Launcher` subclass of `launcher=kind`."""
    return backend_of(kind).launcher_class(kind)


def run_backend(manifest: dict) -> Backend:
    """The backend that ran (or runs) this run's tasks, as its manifest records its launcher."""
    return backend_of(str(manifest.get("launcher") or DEFAULT))


def add_launcher_schema(schema: type) -> None:
    """A backend from outside the package adds its launcher's schema (a `config.schema.LauncherConfig`) when it is
    loaded, before the config is composed: one more `launcher=` kind, checked like the others."""
    from slurm_router.config.schema import CHOICES, LAUNCHER_SCHEMAS

    if schema not in LAUNCHER_SCHEMAS:
        LAUNCHER_SCHEMAS.append(schema)
        CHOICES["launcher.kind"] = tuple(s.kind for s in LAUNCHER_SCHEMAS)


def launcher_setting(launcher: Any, key: str) -> Any:
    """A launcher value from a task's resolved config, or its schema's default (config/schema.py launcher_setting),
    with every backend loaded first: a job process finds the default of a key only a scheduler's launchers have
    (launcher.max_requeues is Slurm's: backends/slurm/config.py)."""
    from slurm_router.config.schema import launcher_setting as schema_setting

    backends()
    return schema_setting(launcher, key)


def job_environment() -> JobEnvironment:
    """The job side of the scheduler this process runs under; the base class (no scheduler) when none."""
    for b in backends().values():
        env = b.job_environment()
        if env is not None:
            return env
    return JobEnvironment()
