"""launcher=slurm: each stage is one submitit map_array (one sbatch call); the callables are job.TaskRunner,
or launch.pack.PackRunner for K packed tasks, and job.write_report_job for the report (slurm_common)."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile

from slurm_router.config import SubmititLauncherConfig
from slurm_router.launch.base import StageJobs, TaskJob
from slurm_router.launch.slurm_common import (REPORT_TIMEOUT_MIN, SlurmLauncher, afterok, sbatch_error,
                                              stage_devices, tasks_per_pack)
from slurm_router.plan import Stage

# slurm_router counts time-outs itself (launcher.max_requeues, slurm_router.requeue: the same rule for both
# Slurm launchers), so submitit's own count must never be the one that stops a requeue.
SUBMITIT_MAX_TIMEOUTS = 10_000


@contextlib.contextmanager
def _captured_stderr():
    """submitit lets sbatch write to our stderr; capture it so the user gets one line, not three."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as tmp:
        os.dup2(tmp.fileno(), 2)
        out = {"text": ""}
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out["text"] = tmp.read()


def submitit_params(cfg, devices: int, stage: str, after: str | None) -> dict:
    """The executor's parameters for one stage; `after`: the job it waits on (afterok, cancelled if that fails)."""
    lc = cfg.launcher
    extra = dict(lc.additional_parameters or {})
    if after:                   # the user's own kill-on-invalid-dep, if any, wins (submitit: '_' means '-')
        mine = {k.replace("_", "-") for k in extra}
        extra.update({k: v for k, v in afterok(after).items() if k == "dependency" or k not in mine})
    params = dict(name=f"{cfg.experiment}-{stage}", timeout_min=lc.timeout_min, cpus_per_task=lc.cpus_per_task,
                  slurm_array_parallelism=lc.array_parallelism, slurm_signal_delay_s=lc.signal_delay_s,
                  slurm_additional_parameters=extra)
    if lc.srun_workers:           # D srun tasks, one GPU each: a task may span nodes
        params.update(tasks_per_node=devices, slurm_gpus_per_task=1)
    else:                         # one process per task starts D workers on its D GPUs
        params.update(tasks_per_node=1, gpus_per_node=devices)
    for key in ("partition", "account", "qos", "constraint"):
        if lc[key]:
            params[f"slurm_{key}"] = lc[key]
    if lc.mem_gb:
        params["mem_gb"] = lc.mem_gb
    return params


class SubmititLauncher(SlurmLauncher):
    schema = SubmititLauncherConfig

    def _executor(self, **params):
        import submitit
        ex = submitit.AutoExecutor(folder=self.layout.logs / "%j", cluster="slurm",
                                   slurm_max_num_timeout=SUBMITIT_MAX_TIMEOUTS)
        ex.update_parameters(**params)
        return ex

    def submit_stage(self, stage: Stage, after: str | None) -> StageJobs:
        from slurm_router.job import TaskRunner
        from slurm_router.launch.pack import PackRunner
        ex = self._executor(**submitit_params(self.cfg, stage_devices(stage), stage.name, after))
        per_pack = tasks_per_pack(self.cfg)
        files = [str(self.layout.task(t.name).task_file) for t in stage.tasks]
        with _captured_stderr() as err:
            try:
                if per_pack > 1:        # K tasks share one array task's GPUs
                    jobs = ex.map_array(PackRunner(), [files[i:i + per_pack] for i in range(0, len(files), per_pack)])
                else:
                    jobs = ex.map_array(TaskRunner(), files)
            except Exception as e:          # submitit wraps sbatch's refusal in several exception types
                failure = e
            else:
                failure = None
        if failure is not None:
            raise sbatch_error(failure, err["text"]) from None
        # Task i ran in pack i // K. submitit submits a 1-task stage as a plain job (id 18, not 18_0).
        packs = [jobs[i // per_pack] for i in range(len(stage.tasks))]
        return StageJobs(job_id=jobs[0].job_id.split("_")[0], tasks={
            t.name: TaskJob(j.job_id, str(j.paths.stdout), str(j.paths.stderr)) for t, j in zip(stage.tasks, packs)})

    def report_job(self, after: str | None) -> str | None:
        from slurm_router.job import write_report_job
        partition = {"slurm_partition": self.cfg.launcher.partition} if self.cfg.launcher.partition else {}
        ex = self._executor(name=f"{self.cfg.experiment}-report", timeout_min=REPORT_TIMEOUT_MIN, cpus_per_task=1,
                            slurm_additional_parameters={"dependency": f"afterany:{after}"} if after else {},
                            **partition)
        return ex.submit(write_report_job, str(self.layout.root)).job_id
