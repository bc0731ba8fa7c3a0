"""Slurm launchers: every stage becomes ONE array job (one array task per variant); a later stage waits on the
earlier one with --dependency=afterok; a last small job writes the report once every stage has ended.

launcher=slurm submits through submitit (map_array: one sbatch call per stage); launcher=sbatch renders
RUN_DIR/submit.sbatch from sbatch_templates/ and submits it with sbatch. Both return as soon as the jobs
are queued (unless launcher.wait=true) and record the job ids in the manifest.

Both ask Slurm for USR2 launcher.signal_delay_s before the time limit and allow requeues: the task
checkpoints at its step end and is requeued into the same run dir (slurm_router.job, slurm_router.requeue).
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from slurm_router.config import UserError
from slurm_router.plan import Stage

def check_slurm() -> None:
    if shutil.which("sbatch") is None:
        raise UserError("sbatch is not on the PATH: this is not a Slurm machine; run here with launcher=local")


def _sbatch_error(e: Exception, stderr: str = "") -> UserError:
    text = f"{stderr}\n{e}"
    reasons = list(dict.fromkeys(m.strip() for m in re.findall(r"sbatch: error: ([^\n]+)", text)))
    detail = "; ".join(reasons) if reasons else str(e).strip().replace("\n", " ")[:300]
    return UserError(f"Slurm rejected the job: {detail}")


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


def _submitit_params(cfg, devices: int, stage: str, dependency: str | None) -> dict:
    lc = cfg.launcher
    extra = dict(lc.additional_parameters or {})
    if dependency:
        extra["dependency"] = dependency
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


def submit_submitit(stages: list[Stage], cfg, run_dir: Path, manifest) -> list[str]:
    """One submitit map_array per stage; returns the job ids (array masters) in stage order."""
    import submitit
    from slurm_router.job import TaskRunner, write_report_job
    from slurm_router.launch.pack import PackRunner
    job_ids: list[str] = []
    last = None
    for stage in stages:
        if stage.cached:
            continue
        devices = max(t.devices for t in stage.tasks)
        # slurm_router counts time-outs itself (launcher.max_requeues, slurm_router.requeue: the same rule for
        # both Slurm launchers), so submitit's own count must never be the one that stops a requeue.
        ex = submitit.AutoExecutor(folder=run_dir / "logs" / "%j", cluster="slurm", slurm_max_num_timeout=10_000)
        ex.update_parameters(**_submitit_params(cfg, devices, stage.name, f"afterok:{last}" if last else None))
        files = [str(t.task_dir / "task.json") for t in stage.tasks]
        per_pack = tasks_per_pack(cfg)
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
            raise _sbatch_error(failure, err["text"]) from None
        last = jobs[0].job_id.split("_")[0]      # submitit submits a 1-task stage as a plain job, not an array
        job_ids.append(last)
        packs = [jobs[i // per_pack] for i in range(len(stage.tasks))]
        _record(manifest, stage, last, [(j.job_id, str(j.paths.stdout), str(j.paths.stderr)) for j in packs])
    ex = submitit.AutoExecutor(folder=run_dir / "logs" / "%j", cluster="slurm")
    ex.update_parameters(name=f"{cfg.experiment}-report", timeout_min=30, cpus_per_task=1,
                         slurm_additional_parameters={"dependency": f"afterany:{last}"} if last else {},
                         **({"slurm_partition": cfg.launcher.partition} if cfg.launcher.partition else {}))
    report = ex.submit(write_report_job, str(run_dir))
    manifest.set(report_job_id=report.job_id)
    return job_ids


def _sbatch_spec(cfg, run_dir: str, stage: str, n_tasks: int, devices: int, after: str | None,
                 indices: tuple[int, ...] | None = None):
    from slurm_router.launch.sbatch_render import SbatchSpec, safe_job_name
    lc = cfg.launcher
    return SbatchSpec(
        job_name=safe_job_name(f"{cfg.experiment}-{stage}"), run_dir=run_dir,
        array_size=n_tasks, array_parallelism=lc.array_parallelism, array_indices=indices,
        gpus_per_task=1 if lc.srun_workers else devices, cpus_per_task=lc.cpus_per_task, mem_gb=lc.mem_gb,
        timeout_min=lc.timeout_min, partition=lc.partition, account=lc.account, qos=lc.qos,
        constraint=lc.constraint, signal_delay_s=lc.signal_delay_s, requeue=True, dependency_job_id=after,
        ntasks=devices if lc.srun_workers else 1,
        extra_sbatch=tuple((str(k), str(v)) for k, v in (lc.additional_parameters or {}).items()),
        python=sys.executable,
        task_argv=("-m", "slurm_router.job", "--run-dir", run_dir, "--stage", stage)
        + (("--pack", str(tasks_per_pack(cfg))) if tasks_per_pack(cfg) > 1 else ()))


def tasks_per_pack(cfg) -> int:
    """Tasks per array task under Slurm (resources.tasks_per_gpu); checked by check_packing."""
    return max(1, int(cfg.resources.tasks_per_gpu))


def check_packing(cfg) -> None:
    if cfg.resources.tasks_per_gpu == 0:
        raise UserError("resources.tasks_per_gpu=0 (pack by predicted memory) works with launcher=local only: "
                        "the GPU's memory is unknown at submit time; set resources.tasks_per_gpu=N")
    if cfg.resources.tasks_per_gpu > 1 and cfg.launcher.srun_workers:
        raise UserError("resources.tasks_per_gpu>1 and launcher.srun_workers=true do not combine: "
                        "a packed array task runs its tasks side by side on the same GPUs")


def check_sbatch(cfg) -> None:
    """The launcher values sbatch cannot carry, found before any file is written (UserError, one line)."""
    from slurm_router.launch.sbatch_render import sbatch_directives
    devices = cfg.resources.devices_per_task
    try:
        sbatch_directives(_sbatch_spec(cfg, "/run_dir", "check", 1, devices, None))
    except ValueError as e:
        raise UserError(f"launcher: {e}") from None


def submit_sbatch(stages: list[Stage], cfg, run_dir: Path, manifest) -> list[str]:
    """Render RUN_DIR/submit.sbatch (submit-<stage>.sbatch for earlier stages) and sbatch them in order.
    A resumed run (stages holding only unfinished tasks) submits just their array indices, to
    submit[-<stage>]-resume<N>.sbatch: an array index always means the same task (pack_task_files)."""
    from slurm_router.launch.sbatch_render import safe_job_name, submit_sbatch as sbatch, write_sbatch
    lc = cfg.launcher
    job_ids, last = [], None
    suffix = f"-resume{manifest.data['resumed']}" if manifest.data.get("resumed") else ""
    for stage in stages:
        if stage.cached:
            continue
        devices = max(t.devices for t in stage.tasks)
        per_pack = tasks_per_pack(cfg)
        n_arrays = -(-len(manifest.stage_tasks(stage.name)) // per_pack)
        indices = tuple(sorted({t.index // per_pack for t in stage.tasks}))
        spec = _sbatch_spec(cfg, str(run_dir), stage.name, n_arrays, devices, last,
                            indices if len(indices) < n_arrays else None)
        name = f"submit{suffix}.sbatch" if stage is stages[-1] else f"submit-{stage.name}{suffix}.sbatch"
        try:
            script = write_sbatch(spec, run_dir / name)
        except ValueError as e:
            raise UserError(f"launcher: {e}") from None
        if lc.dry_run:
            print(f"rendered {script} (launcher.dry_run=true: not submitted)")
            continue
        try:
            last = sbatch(script)
        except RuntimeError as e:
            raise _sbatch_error(e) from None
        job_ids.append(last)
        arrays = [t.index // per_pack for t in stage.tasks]
        _record(manifest, stage, last, [(f"{last}_{a}", f"{run_dir}/logs/{last}_{a}.out",
                                         f"{run_dir}/logs/{last}_{a}.err") for a in arrays])
    if job_ids:
        # argv, not a shell line: only --wrap is shell, and every word of it is shlex-quoted.
        logs = str(run_dir / "logs").replace("%", "%%")          # Slurm expands %j etc. in --output
        report = subprocess.run(["sbatch", "--parsable", f"--dependency=afterany:{last}", "--job-name",
                                 safe_job_name(f"{cfg.experiment}-report"), "--output", f"{logs}/report-%j.out",
                                 "--time", "30", *([f"--partition={lc.partition}"] if lc.partition else []),
                                 "--wrap", shlex.join([sys.executable, "-m", "slurm_router.analysis", str(run_dir)])],
                                capture_output=True, text=True)
        if report.returncode == 0:
            manifest.set(report_job_id=report.stdout.strip().split(";")[0])
    return job_ids


def _record(manifest, stage: Stage, job_id: str, tasks_jobs: list[tuple[str, str, str]]) -> None:
    """tasks_jobs: (task job id, stdout path, stderr path) per task of the stage, in order."""
    tasks = []
    for t, (task_job_id, out, err) in zip(stage.tasks, tasks_jobs):
        array_index = int(task_job_id.split("_")[1]) if "_" in task_job_id else None   # packed: shared
        tasks.append({"variant": t.name, "array_index": array_index, "job_id": task_job_id, "log_path": out,
                      "err_path": err})
        manifest.data["tasks"][t.name].update(state="submitted", job_id=task_job_id, log_path=out)
    array = any("_" in j for j, _, _ in tasks_jobs)
    manifest.data["jobs"].append({"stage": stage.name, "job_id": job_id, "array": array, "tasks": tasks})
    manifest.save()
