"""A stub scheduler backend for the tests (tests/test_stub_backend.py): a queue whose "cluster" is detached local
subprocesses (cluster.py), added the way any scheduler is: this package, its config file (conf/launcher/stub.yaml,
found with --config-dir) and one registry line (here SLURM_ROUTER_BACKENDS=stub=stub_backend; in the package, a
line in slurm_router/scheduler/registry.py BACKENDS).

Submit side: StubLauncher (launcher.py). Job side: StubJobEnvironment, which a job process finds through the
registry by STUB_JOB_ID, the variable the stub's cluster gives each job it starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from slurm_router.config.schema import LauncherConfig
from slurm_router.scheduler.base import Backend, JobEnvironment
from slurm_router.scheduler.registry import add_launcher_schema

JOB_ENV = "STUB_JOB_ID"


@dataclass
class StubLauncherConfig(LauncherConfig):
    kind: str = "stub"
    wait: bool = True  # finish() waits for every job, the report's too


add_launcher_schema(StubLauncherConfig)


class StubJobEnvironment(JobEnvironment):
    name = "stub"

    def job_id(self) -> str | None:
        return os.environ.get(JOB_ENV) or None


class StubBackend(Backend):
    name = "stub"
    launchers = {"stub": "stub_backend.launcher:StubLauncher"}
    queued = True

    def job_environment(self) -> JobEnvironment | None:
        return StubJobEnvironment() if os.environ.get(JOB_ENV) else None


BACKEND = StubBackend()
