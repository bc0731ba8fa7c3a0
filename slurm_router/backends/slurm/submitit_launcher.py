"""launcher=slurm: each stage is one submitit map_array (one sbatch call); the callables are runners.TaskRunner,
or runners.ColocatedRunner for K co-located tasks, and analysis.report.write_report_job for the report (backends/slurm/common.py).

How the job's command is formed, as Hydra's submitit launcher does it: launcher.setup is submitit's `setup`
(shell lines before srun, as written), then the snapshot first on PYTHONPATH, with PYTHONSAFEPATH=1 so that
`python -m` does not put the submission directory (often the checkout itself) before it; launcher.python is
the executor's `python`. launcher.container (container.py):
apptainer wraps the task inside the callable (a ColocatedRunner of one runs `apptainer exec ... python3 -m
slurm_router.supervise.job TASK_FILE`), so submitit's own process stays outside and requeues; pyxis adds
--container-image/--container-mounts to submitit's srun (`srun_args`): its process then runs in the image."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import tempfile

from slurm_router.backends.slurm import time_limit
from slurm_router.backends.slurm.commands import CONTROLLER_UP, SAY_FILE_ENV, UNAVAILABLE_MARK
from slurm_router.backends.slurm.common import (
    REPORT_TIMEOUT_MIN,
    SlurmLauncher,
    afterok,
    colocated_tasks,
    job_cpus,
    mail_options,
    sbatch_error,
    srun_layout,
    stage_devices,
    user_gpu_request,
)
from slurm_router.backends.slurm.config import SubmititLauncherConfig
from slurm_router.backends.slurm.container import ContainerSpec, container_spec, task_python
from slurm_router.backends.slurm.job import outside_exports
from slurm_router.backends.slurm.setup_lines import guarded
from slurm_router.config.schema import launcher_setting
from slurm_router.errors import SchedulerUnavailable
from slurm_router.launch.base import StageJobs, TaskJob
from slurm_router.rundir.spec import Stage

# slurm_router counts time-outs itself (launcher.max_requeues, slurm_router.supervise.requeue: the same rule for both
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


@contextlib.contextmanager
def _sbatch_through_runner():
    """submitit's sbatch runs as `python -m slurm_router.backends.slurm.commands sbatch FILE`: retried while the
    controller is busy, never submitted twice (backends/slurm/commands.py). submitit makes a fresh SlurmExecutor for
    each array, so its class's method is swapped for the submission only. Its retry lines come back through a
    file (submitit keeps the child's stderr) and are said here; an unreachable controller is SchedulerUnavailable."""
    from submitit.slurm.slurm import SlurmExecutor

    own = SlurmExecutor._make_submission_command
    runner = [sys.executable, "-m", "slurm_router.backends.slurm.commands", "sbatch"]
    SlurmExecutor._make_submission_command = lambda self, path: [*runner, str(path)]  # type: ignore[method-assign]
    with tempfile.NamedTemporaryFile(mode="r") as said:
        os.environ[SAY_FILE_ENV] = said.name
        try:
            yield
        except Exception as e:
            mark = next((line for line in str(e).splitlines() if UNAVAILABLE_MARK in line), None)
            if mark is None:
                raise
            raise SchedulerUnavailable(mark.split(UNAVAILABLE_MARK, 1)[1].split("; ")[0], back=CONTROLLER_UP) from None
        finally:
            SlurmExecutor._make_submission_command = own  # type: ignore[method-assign]
            os.environ.pop(SAY_FILE_ENV, None)
            for line in said.read().splitlines():
                print(line, file=sys.stderr, flush=True)


def job_setup(cfg, pythonpath: str | None, run_dir: str = "/run_dir") -> list[str]:
    """submitit's `setup`: launcher.setup as written (the user's shell, trusted; a failing line stops the job, as
    under launcher=sbatch, and names itself: setup_lines.py), then ours, quoted: the snapshot first on PYTHONPATH.
    The job keeps the submission directory as its cwd (relative paths in the config mean what they meant there),
    so PYTHONSAFEPATH=1 (Python 3.11) keeps `python -m` from putting that directory, often the checkout itself,
    first on sys.path."""
    lines = guarded(launcher_setting(cfg.launcher, "setup"), run_dir, ("set -e", "set +e"))
    if pythonpath:
        lines += [
            f'export PYTHONPATH={shlex.quote(pythonpath)}"${{PYTHONPATH:+:$PYTHONPATH}}"',
            "export PYTHONSAFEPATH=1",
        ]
    return lines


def mail_params(cfg) -> dict:
    """launcher.mail_type/mail_user as submitit's slurm_mail_type/slurm_mail_user."""
    return {f"slurm_{key.replace('-', '_')}": value for key, value in mail_options(cfg.launcher).items()}


def submitit_python(cfg, container: ContainerSpec | None) -> str:
    """The executor's `python` (a shell word): the interpreter submitit's own process runs on. With apptainer
    that process stays outside the image (the submitter's); with pyxis it runs inside (launcher.python)."""
    if container is not None and container.runtime == "apptainer":
        return shlex.quote(sys.executable)
    return shlex.quote(task_python(cfg, in_container=container is not None))


def submitit_params(
    cfg,
    devices: int,
    stage: str,
    after: str | None,
    run_dir: str = "/run_dir",
    pythonpath: str | None = None,
    after_round: str | None = None,
) -> dict:
    """The executor's parameters for one stage; `after`: the job it waits on (afterok, cancelled if that fails);
    `after_round`: seeds=auto's round before, which must have ended (afterany)."""
    lc = cfg.launcher
    extra = dict(lc.additional_parameters or {})
    if after or after_round:  # the user's own kill-on-invalid-dep, if any, wins (submitit: '_' means '-')
        mine = {k.replace("_", "-") for k in extra}
        extra.update({k: v for k, v in afterok(after, after_round).items() if k == "dependency" or k not in mine})
    params = dict(
        name=f"{cfg.experiment}-{stage}",
        timeout_min=time_limit.stage_minutes(cfg, stage, run_dir),
        cpus_per_task=job_cpus(cfg, devices),
        slurm_array_parallelism=lc.array_parallelism,
        slurm_signal_delay_s=lc.signal_delay_s,
        slurm_additional_parameters=extra,
    )
    own_gpus = not user_gpu_request(extra)  # the user's gres/gpus replaces the built-in GPU request
    if lc.srun_workers:  # D srun tasks, one GPU each, over resources.nodes_per_task nodes
        nodes, per_node = srun_layout(cfg, devices)
        params.update(nodes=nodes, tasks_per_node=per_node, **({"slurm_gpus_per_task": 1} if own_gpus else {}))
    else:  # one process per task starts D workers on its D GPUs
        params.update(tasks_per_node=1, **({"gpus_per_node": devices} if own_gpus else {}))
    for key in ("partition", "account", "qos", "constraint"):
        if lc[key]:
            params[f"slurm_{key}"] = lc[key]
    if lc.mem_gb:
        params["mem_gb"] = lc.mem_gb
    container = container_spec(cfg, run_dir, gpus=True)
    outside = outside_exports(srun_workers=lc.srun_workers) if container is not None else []
    params.update(slurm_setup=job_setup(cfg, pythonpath, run_dir) + outside, **mail_params(cfg))
    if container is not None and container.runtime == "pyxis":
        params["slurm_srun_args"] = container.srun_args()
    return params


def task_runner_python(cfg, run_dir: str) -> list[str] | None:
    """With apptainer, the words a ColocatedRunner starts each task with (inside the image); None: no wrapping."""
    container = container_spec(cfg, run_dir, gpus=True)
    if container is None or container.runtime != "apptainer":
        return None
    return [*container.exec_argv(), task_python(cfg, in_container=True)]


class SubmititLauncher(SlurmLauncher):
    schema = SubmititLauncherConfig

    def _executor(self, python: str, **params):
        import submitit

        ex = submitit.AutoExecutor(
            folder=self.layout.logs / "%j",
            cluster="slurm",
            slurm_max_num_timeout=SUBMITIT_MAX_TIMEOUTS,
            slurm_python=python,
        )
        ex.update_parameters(**params)
        return ex

    def submit_stage(self, stage: Stage, after: str | None, after_round: str | None = None) -> StageJobs:
        from slurm_router.backends.slurm.runners import ColocatedRunner, TaskRunner

        run_dir = str(self.layout.root)
        params = submitit_params(
            self.cfg, stage_devices(stage), stage.name, after, run_dir, self.pythonpath, after_round
        )
        ex = self._executor(submitit_python(self.cfg, container_spec(self.cfg, run_dir, gpus=True)), **params)
        per_array_task, wrapped = colocated_tasks(self.cfg), task_runner_python(self.cfg, run_dir)
        files = [str(self.layout.task(t.name).task_file) for t in stage.tasks]
        failure: Exception | None
        with _sbatch_through_runner(), _captured_stderr() as err:
            try:
                if per_array_task > 1 or wrapped:  # K tasks share one array task's GPUs; or 1 task in a container
                    jobs = ex.map_array(
                        ColocatedRunner(wrapped),
                        [files[i : i + per_array_task] for i in range(0, len(files), per_array_task)],
                    )
                else:
                    jobs = ex.map_array(TaskRunner(), files)
            except Exception as e:  # submitit wraps sbatch's refusal in several exception types
                if UNAVAILABLE_MARK in f"{e}":
                    raise
                failure = e
            else:
                failure = None
        if failure is not None:
            raise sbatch_error(failure, err["text"]) from None
        # Task i ran in array task i // K. submitit submits a 1-task stage as a plain job (id 18, not 18_0).
        array_jobs = [jobs[i // per_array_task] for i in range(len(stage.tasks))]
        return StageJobs(
            job_id=jobs[0].job_id.split("_")[0],
            tasks={
                t.name: TaskJob(j.job_id, str(j.paths.stdout), str(j.paths.stderr))
                for t, j in zip(stage.tasks, array_jobs)
            },
            job_name=ex._executor.parameters.get("job_name"),
        )

    def report_job(self, after: str | None) -> str | None:
        from slurm_router.analysis.report import write_report_job

        partition = {"slurm_partition": self.cfg.launcher.partition} if self.cfg.launcher.partition else {}
        run_dir = str(self.layout.root)
        on_host = sys.executable if container_spec(self.cfg, run_dir, gpus=False) else task_python(self.cfg, False)
        ex = self._executor(
            shlex.quote(on_host),  # the report runs outside any image
            name=f"{self.cfg.experiment}-report",
            timeout_min=REPORT_TIMEOUT_MIN,
            cpus_per_task=1,
            slurm_additional_parameters={"dependency": f"afterany:{after}"} if after else {},
            slurm_setup=job_setup(self.cfg, self.pythonpath, run_dir),
            **mail_params(self.cfg),
            **partition,
        )
        try:
            with _sbatch_through_runner():
                return ex.submit(write_report_job, str(self.layout.root)).job_id
        except SchedulerUnavailable as e:  # the tasks are queued: the report can be written later
            print(
                f"warning: the report job was not submitted ({e.what}): "
                f"write it with python -m slurm_router.analysis {self.layout.root}",
                file=sys.stderr,
            )
            return None
