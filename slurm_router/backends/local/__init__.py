"""The local backend: launcher=local runs each task as a job process on this machine (backends/local/launcher.py).
No scheduler: its job environment is the base class's, and the manifest holds its tasks' states."""

from __future__ import annotations

from slurm_router.scheduler.base import Backend


class LocalBackend(Backend):
    name = "local"
    launchers = {"local": "slurm_router.backends.local.launcher:LocalLauncher"}


BACKEND = LocalBackend()
