"""launcher=sbatch: each stage is rendered to RUN_DIR/submit[-<stage>].sbatch from sbatch_templates/ and
submitted with sbatch; its array tasks run `python -m slurm_router.supervise.job --run-dir RUN_DIR --stage NAME`.
launcher.dry_run=true renders the scripts and submits nothing. A resumed run submits only the unfinished
tasks' array indices, to submit[-<stage>]-resume<N>.sbatch: an array index always means the same task.
How the task's command is formed (launcher.setup, .python, .container, .snapshot): sbatch_render, container."""

from __future__ import annotations

import shlex
import sys

from slurm_router.backends.slurm import time_limit
from slurm_router.backends.slurm.common import (
    REPORT_TIMEOUT_MIN,
    SlurmLauncher,
    check_colocation,
    check_nodes,
    check_slurm,
    colocated_tasks,
    job_cpus,
    mail_options,
    sbatch_error,
    srun_layout,
    stage_devices,
)
from slurm_router.backends.slurm.config import SbatchLauncherConfig
from slurm_router.backends.slurm.container import container_spec, resolve_container, task_python
from slurm_router.backends.slurm.sbatch_render import (
    SbatchSpec,
    safe_job_name,
    sbatch_directives,
    script_path,
    submit_sbatch,
    submit_wrapped,
    write_sbatch,
)
from slurm_router.backends.slurm.setup_lines import guarded
from slurm_router.config.schema import launcher_setting
from slurm_router.errors import SchedulerUnavailable, UserError
from slurm_router.launch.base import StageJobs, TaskJob
from slurm_router.rundir.spec import Stage


def sbatch_spec(
    cfg,
    run_dir: str,
    stage: str,
    n_arrays: int,
    devices: int,
    after: str | None,
    indices: tuple[int, ...] | None = None,
    pythonpath: str | None = None,
    after_round: str | None = None,
) -> SbatchSpec:
    lc, per_array_task = cfg.launcher, colocated_tasks(cfg)
    gpus, mail = 1 if lc.srun_workers else devices, mail_options(lc)
    container = container_spec(cfg, run_dir, gpus=gpus > 0)
    return SbatchSpec(
        job_name=safe_job_name(f"{cfg.experiment}-{stage}"),
        run_dir=run_dir,
        array_size=n_arrays,
        array_parallelism=lc.array_parallelism,
        array_indices=indices,
        gpus_per_task=gpus,
        cpus_per_task=job_cpus(cfg, devices),
        mem_gb=lc.mem_gb,
        timeout_min=time_limit.stage_minutes(cfg, stage, run_dir),
        partition=lc.partition,
        account=lc.account,
        qos=lc.qos,
        constraint=lc.constraint,
        signal_delay_s=lc.signal_delay_s,
        requeue=True,
        dependency_job_id=after,
        after_round_job_id=after_round,
        ntasks=devices if lc.srun_workers else 1,
        nodes=srun_layout(cfg, devices)[0] if lc.srun_workers else 1,
        extra_sbatch=tuple((str(k), str(v)) for k, v in (lc.additional_parameters or {}).items()),
        python=task_python(cfg, in_container=container is not None),
        task_argv=("-m", "slurm_router.supervise.job", "--run-dir", run_dir, "--stage", stage)
        + (("--colocate", str(per_array_task)) if per_array_task > 1 else ()),
        setup=tuple(str(line) for line in launcher_setting(lc, "setup") or ()),
        pythonpath=pythonpath,
        container=container,
        mail_type=mail.get("mail-type"),
        mail_user=mail.get("mail-user"),
    )


def report_script(cfg, run_dir: str, pythonpath: str | None) -> str:
    """The report job's bash (sbatch --wrap runs sh: it runs this with bash -c): launcher.setup, the snapshot,
    then the report, on the host (outside any container)."""
    lc = cfg.launcher
    python = sys.executable if container_spec(cfg, run_dir, gpus=False) else task_python(cfg, in_container=False)
    lines = ["set -eo pipefail", *guarded(launcher_setting(lc, "setup"), run_dir)]
    if pythonpath:
        lines.append(f'export PYTHONPATH={shlex.quote(pythonpath)}"${{PYTHONPATH:+:$PYTHONPATH}}"')
    lines += [f"cd {shlex.quote(run_dir)}", "exec " + shlex.join([python, "-m", "slurm_router.analysis", run_dir])]
    return "\n".join(lines)


class SbatchLauncher(SlurmLauncher):
    schema = SbatchLauncherConfig

    @classmethod
    def check(cls, cfg) -> None:
        """The launcher values sbatch cannot carry, found before any file is written (UserError, one line);
        a dry run only renders, so it needs no Slurm here."""
        if not (cfg.launcher.dry_run or cfg.get("dry_run")):
            check_slurm()
        check_colocation(cfg)
        check_nodes(cfg)
        resolve_container(cfg)
        try:
            sbatch_directives(sbatch_spec(cfg, "/run_dir", "check", 1, cfg.resources.devices_per_task, None))
        except ValueError as e:
            raise UserError(f"launcher: {e}") from None

    def submit_stage(self, stage: Stage, after: str | None, after_round: str | None = None) -> StageJobs:
        per_array_task, resumed = colocated_tasks(self.cfg), self.manifest.data.get("resumed", 0)
        n_arrays = -(-len(self.manifest.stage_tasks(stage.name)) // per_array_task)
        indices = tuple(sorted({t.index // per_array_task for t in stage.tasks}))
        spec = sbatch_spec(
            self.cfg,
            str(self.layout.root),
            stage.name,
            n_arrays,
            stage_devices(stage),
            after,
            indices if len(indices) < n_arrays else None,
            self.pythonpath,
            after_round,
        )
        last = stage.name == self.manifest.data["stages"][-1]["name"]
        try:
            script = write_sbatch(spec, script_path(self.layout, stage.name, last, resumed, stage.round))
        except ValueError as e:
            raise UserError(f"launcher: {e}") from None
        if self.cfg.launcher.dry_run:
            print(f"rendered {script} (launcher.dry_run=true: not submitted)")
            return StageJobs()
        try:
            job_id = submit_sbatch(script)
        except RuntimeError as e:
            raise sbatch_error(e) from None
        return StageJobs(
            job_id=job_id,
            tasks={t.name: self._task_job(f"{job_id}_{t.index // per_array_task}") for t in stage.tasks},
            job_name=spec.job_name,
        )

    def _task_job(self, array_task: str) -> TaskJob:
        """An array task (JOB_INDEX; co-located tasks share one) and the logs the template names after it."""
        logs = self.layout.logs
        return TaskJob(array_task, str(logs / f"{array_task}.out"), str(logs / f"{array_task}.err"))

    def report_job(self, after: str | None) -> str | None:
        logs = str(self.layout.logs).replace("%", "%%")  # Slurm expands %j etc. in --output
        lc = self.cfg.launcher
        partition = [f"--partition={lc.partition}"] if lc.partition else []
        mail = [f"--{key}={value}" for key, value in mail_options(lc).items()]
        try:
            return submit_wrapped(
                ["bash", "-c", report_script(self.cfg, str(self.layout.root), self.pythonpath)],
                f"--dependency=afterany:{after}",
                *mail,
                "--job-name",
                safe_job_name(f"{self.cfg.experiment}-report"),
                "--output",
                f"{logs}/report-%j.out",
                "--time",
                str(REPORT_TIMEOUT_MIN),
                *partition,
                what="the report job",
            )
        except (RuntimeError, SchedulerUnavailable) as e:  # the tasks are queued: the report can be written later
            why = e.what if isinstance(e, SchedulerUnavailable) else sbatch_error(e)
            print(
                f"warning: the report job was not submitted ({why}): "
                f"write it with python -m slurm_router.analysis {self.layout.root}",
                file=sys.stderr,
            )
            return None
