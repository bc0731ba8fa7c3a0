"""The Slurm backend: launcher=slurm (submitit) and launcher=sbatch, their config schemas (config.py, added to the
launcher group here), their scripts, squeue and sacct and their parsers, scancel, and the job side (job.py).
Imports of the rest happen when asked for: the registry loads this module in every process that looks a backend
up."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from slurm_router.backends.slurm.config import SbatchLauncherConfig, SubmititLauncherConfig
from slurm_router.backends.slurm.states import FAILED_STATES, NEVER_SATISFIED
from slurm_router.scheduler.base import Backend, JobEnvironment, Runner
from slurm_router.scheduler.registry import add_launcher_schema

if TYPE_CHECKING:
    from omegaconf import DictConfig


class SlurmBackend(Backend):
    name = "slurm"
    launchers = {
        "slurm": "slurm_router.backends.slurm.submitit_launcher:SubmititLauncher",
        "sbatch": "slurm_router.backends.slurm.sbatch_launcher:SbatchLauncher",
    }
    queued = True
    failed_states = FAILED_STATES
    never_runs_reasons = (NEVER_SATISFIED,)
    dependency_word = "afterok"
    packages = ("submitit",)

    def job_environment(self) -> JobEnvironment | None:
        if not os.environ.get("SLURM_JOB_ID"):
            return None
        from slurm_router.backends.slurm.job import SlurmJobEnvironment

        return SlurmJobEnvironment()

    def live_jobs(self) -> dict[str, str]:
        """Every job Slurm holds now, by array job id: 'RUNNING' if any of its tasks runs, else its state."""
        from slurm_router.backends.slurm.commands import run_command

        out: dict[str, str] = {}
        for line in run_command(["squeue", "-h", "-o", "%F|%T"]).splitlines():
            job, _, state = line.strip().partition("|")
            if job and out.get(job) != "RUNNING":
                out[job] = state.strip()
        return out

    def job_facts(self, manifest: dict, facts: dict[str, dict], runner: Runner | None = None) -> None:
        from slurm_router.backends.slurm.jobfacts import sacct_facts

        sacct_facts(manifest, facts, runner)

    def poll_floor_s(self) -> float:
        from slurm_router.backends.slurm.commands import poll_floor_s

        return poll_floor_s()

    def colocated_tasks(self, cfg: DictConfig) -> int:
        from slurm_router.backends.slurm.common import colocated_tasks

        return colocated_tasks(cfg)

    def time_limit_h(self, cfg: DictConfig) -> float | None:
        return float(cfg.launcher.timeout_min) / 60

    def devices(self, cfg: DictConfig) -> tuple[str, int | None, str] | None:
        gres = str((cfg.launcher.get("additional_parameters") or {}).get("gres") or "")
        return "cuda", None, f"a Slurm GPU{' (' + gres + ')' if gres else ''}: its memory is known once the job starts"

    def preview(self, cfg: DictConfig, manifest: Any, stages: list) -> list[str]:
        from slurm_router.backends.slurm.preview import preview_lines

        return preview_lines(cfg, manifest, stages)


BACKEND = SlurmBackend()
for _schema in (SubmititLauncherConfig, SbatchLauncherConfig):  # launcher=slurm and launcher=sbatch, in that order
    add_launcher_schema(_schema)
