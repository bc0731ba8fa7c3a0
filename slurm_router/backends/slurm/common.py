"""What both Slurm launchers share: the checks, the one-line rejection, co-location, and the end of a run
(print the job ids; with launcher.wait=true wait for every task AND the report job, then print the report
that job wrote: one writer of report/ at a time).

Every stage is ONE array job (one array task per variant, or per resources.tasks_per_gpu co-located variants),
but seeds=auto's reserve rounds, each its own array after the round before (afterany: chains_rounds);
a later stage waits with --dependency=afterok and --kill-on-invalid-dep=yes (if the stage it waits on fails,
Slurm cancels it rather than keep it PENDING forever: DependencyNeverSatisfied); a last small job writes the
report once every stage has ended (afterany), so a failed stage still gets a report saying what happened.
Both ask Slurm for USR2 launcher.signal_delay_s before the time limit and allow requeues: the task
checkpoints at its step end and is requeued into the same run dir (slurm_router.supervise.job, slurm_router.supervise.requeue).
"""

from __future__ import annotations

import json
import re
import shutil
import sys

from slurm_router.config.schema import FUSE_AUTO, fusing, launcher_setting
from slurm_router.errors import UserError
from slurm_router.launch.base import Launcher, RunJobs
from slurm_router.rundir.spec import Stage
from slurm_router.scheduler.task_view import TaskView

REPORT_TIMEOUT_MIN = 30  # the report job reads events and sacct: minutes at most
KILL_ON_INVALID_DEP = "kill-on-invalid-dep"  # sbatch's option: cancel a job whose dependency cannot be met


def afterok(job_id: str | None, after_round: str | None = None) -> dict[str, str]:
    """The sbatch options of a job that waits (--key=value): on job_id, the stage before, to complete (Slurm
    cancels it if job_id failed: never a dependant PENDING forever, docs/ARCHITECTURE.md); and on after_round,
    seeds=auto's round before, to end in any state (launch/base.py reserve_rounds)."""
    words = [f"afterok:{job_id}"] * bool(job_id) + [f"afterany:{after_round}"] * bool(after_round)
    kill = {KILL_ON_INVALID_DEP: "yes"} if job_id else {}
    return {"dependency": ",".join(words), **kill} if words else {}


def mail_options(launcher) -> dict[str, str]:
    """launcher.mail_type and mail_user as sbatch options, {'mail-type': 'END,FAIL', 'mail-user': ...}, the unset
    ones left out (checked by config.check_job_values; a run made before they existed has neither)."""
    from slurm_router.backends.slurm.settings import mail_types
    from slurm_router.config.schema import launcher_setting

    types, user = ",".join(mail_types(launcher_setting(launcher, "mail_type"))), launcher_setting(launcher, "mail_user")
    return {k: v for k, v in (("mail-type", types), ("mail-user", user)) if v}


def check_slurm() -> None:
    if shutil.which("sbatch") is None:
        raise UserError("sbatch is not on the PATH: this is not a Slurm machine; run here with launcher=local")


def sbatch_error(e: Exception, stderr: str = "") -> UserError:
    """sbatch's refusal (however submitit or subprocess wrapped it) as one line."""
    text = f"{stderr}\n{e}"
    reasons = list(dict.fromkeys(m.strip() for m in re.findall(r"sbatch: error: ([^\n]+)", text)))
    detail = "; ".join(reasons) if reasons else str(e).strip().replace("\n", " ")[:300]
    return UserError(f"Slurm rejected the job: {detail}")


# sbatch's options that ask for GPUs: a user's own (launcher.additional_parameters, '_' or '-') replaces the built-in
# request (--gres=gpu:D, --gpus-per-task=1, submitit's gpus_per_node), so that a job never asks twice
GPU_REQUEST_KEYS = ("gres", "gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket")


def user_gpu_request(keys) -> list[str]:
    """The keys among `keys` (launcher.additional_parameters') that ask for GPUs themselves."""
    return [str(k) for k in keys if str(k).replace("_", "-") in GPU_REQUEST_KEYS]


def job_cpus(cfg, devices: int) -> int:
    """--cpus-per-task of a stage's Slurm task, by one rule: the user's launcher.cpus_per_task when set; else
    launcher.cpus_per_device for each worker process the task runs: one (launcher.srun_workers: a srun task is
    one worker), or devices x co-located tasks (one process starts a worker per device, for each co-located task)."""
    lc = cfg.launcher
    if lc.get("cpus_per_task") is not None:
        return int(lc.cpus_per_task)
    workers = 1 if lc.get("srun_workers") else devices * colocated_tasks(cfg)
    return max(1, workers) * int(launcher_setting(lc, "cpus_per_device"))


def colocated_tasks(cfg) -> int:
    """Tasks per array task under Slurm (resources.tasks_per_gpu); checked by check_colocation."""
    return max(1, int(cfg.resources.tasks_per_gpu))


def check_colocation(cfg) -> None:
    if cfg.resources.tasks_per_gpu == 0:
        raise UserError(
            "resources.tasks_per_gpu=0 (pack by predicted memory) works with launcher=local only: "
            "the GPU's memory is unknown at submit time; set resources.tasks_per_gpu=N"
        )
    if cfg.resources.tasks_per_gpu > 1 and cfg.launcher.srun_workers:
        raise UserError(
            "resources.tasks_per_gpu>1 and launcher.srun_workers=true do not combine: "
            "a co-located array task runs its tasks side by side on the same GPUs"
        )
    # resources.fuse_variants with tasks_per_gpu=N co-locates N fused tasks (their leaders) in an array task: the runner
    # runs each leader's task.json as any task's (supervise/colocate.py)
    fuse = cfg.resources.get("fuse_variants", 1)
    if fuse == FUSE_AUTO:
        raise UserError(
            "resources.fuse_variants=auto works with launcher=local only: the devices a Slurm task gets and their "
            "memory are unknown at submit time; set resources.fuse_variants=K"
        )
    if fusing(cfg) and cfg.launcher.srun_workers:
        raise UserError(
            f"resources.fuse_variants={fuse} and launcher.srun_workers=true do not combine: a fused task's job "
            "process starts its workers itself; set launcher.srun_workers=false (or resources.fuse_variants=1)"
        )


def check_nodes(cfg) -> None:
    """resources.nodes_per_task=N > 1 spreads each task's D devices over N nodes, D/N srun tasks on each: it
    needs launcher.srun_workers (one process per device) and a D that N divides, for every variant."""
    nodes = int(cfg.resources.nodes_per_task)
    if nodes == 1:
        return
    if not cfg.launcher.srun_workers:
        raise UserError(
            f"resources.nodes_per_task={nodes} needs launcher.srun_workers=true: without it one process "
            "per task starts its workers on one node"
        )
    devices = {("", int(cfg.resources.devices_per_task))} | {
        (f"variants.{name}.", int(v["resources"]["devices_per_task"]))
        for name, v in (cfg.variants or {}).items()
        if v and "devices_per_task" in (v.get("resources") or {})
    }
    for where, d in sorted(devices):
        if d % nodes:
            raise UserError(
                f"{where}resources.devices_per_task={d} does not split evenly over resources."
                f"nodes_per_task={nodes}: use a multiple of {nodes} (each node runs devices/nodes workers)"
            )


def srun_layout(cfg, devices: int) -> tuple[int, int]:
    """(nodes, srun tasks per node) of one array task with launcher.srun_workers (checked by check_nodes)."""
    nodes = int(cfg.resources.nodes_per_task)
    return nodes, devices // nodes


def stage_devices(stage: Stage) -> int:
    """GPUs per array task: the stage's largest task (every array task asks for the same)."""
    return max(t.devices for t in stage.tasks)


class SlurmLauncher(Launcher):
    """The part of launcher=slurm (submitit) and launcher=sbatch that does not depend on how they submit."""

    pythonpath: str | None = None  # launcher.snapshot's RUN_DIR/code once prepare() ran (launch/snapshot.py)
    new_snapshot: bool = False  # resume=RUN_DIR new_snapshot=true: the current code, as a new snapshot

    @property
    def chains_rounds(self) -> bool:
        """seeds=auto's reserves queued round by round, each round's array after the one before (afterany); only
        with one task per array task: launcher=sbatch's array index is a fixed slot of the stage's script, which
        co-located tasks (resources.tasks_per_gpu) of two rounds could share (their reserves then wait inside
        the job, worker/auto_seeds.py)."""
        return colocated_tasks(self.cfg) == 1

    @classmethod
    def task_states(cls, manifest: dict) -> list[TaskView]:
        from slurm_router.backends.slurm.queries import slurm_states

        return slurm_states(manifest)

    @classmethod
    def cancel(cls, manifest: dict) -> str | None:
        from slurm_router.backends.slurm.queries import cancel_run

        ids = cancel_run(manifest)
        return f"scancel {' '.join(ids)}" if ids else None

    @classmethod
    def check(cls, cfg) -> None:
        from slurm_router.backends.slurm.container import resolve_container

        if not cfg.get("dry_run"):  # dry_run=true only renders and prints: no Slurm needed here
            check_slurm()
        check_colocation(cfg)
        check_nodes(cfg)
        resolve_container(cfg)
        from slurm_router.backends.slurm import time_limit

        time_limit.check(cfg)  # launcher.time_limit: auto or unset

    def prepare(self) -> None:
        from slurm_router.launch import snapshot

        self.pythonpath = snapshot.ensure(
            self.manifest, bool(self.cfg.launcher.get("snapshot", False)), self.new_snapshot
        )

    def check_resume(self) -> None:
        from slurm_router.launch import snapshot

        check_slurm()
        snapshot.check_resume(self.manifest, bool(self.cfg.launcher.get("snapshot", False)), self.new_snapshot)

    def refuse_live_tasks(self) -> None:
        """Never run a task twice at once: a resumed Slurm run must have nothing left in Slurm. Tasks that wait
        on a failed stage will never run: they are cancelled (one line), and resume= submits them again."""
        if not self.manifest.data.get("job_ids") and not self.manifest.data.get("jobs"):
            return
        from slurm_router.backends.slurm.queries import live_tasks

        cancelled = self.cancel_never_runnable("resume", report_too=True)  # sacct lags the scancel
        live = [t for t in live_tasks(self.manifest.data) if t.job_id not in cancelled]
        if live:
            run_dir = self.layout.root
            raise UserError(
                f"resume={run_dir}: {len(live)} task(s) of this run are still in Slurm "
                f"({', '.join(f'{t.variant} {t.job_id} {t.state}' for t in live[:3])}): wait for them "
                f"(python -m slurm_router.status {run_dir} --wait) or cancel them (--cancel) first"
            )

    def cancel_never_runnable(self, who: str, report_too: bool = False) -> set[str]:
        """scancel what waits on a dependency that can never be satisfied (a stage it waits on failed); one line.
        Returns the job ids of the tasks cancelled."""
        from slurm_router.backends.slurm.queries import cancel_never_runnable

        stuck, report = cancel_never_runnable(self.manifest.data, report_too=report_too)
        if stuck:
            names = ", ".join(f"{t.variant} {t.job_id}" for t in stuck[:5]) + (", ..." if len(stuck) > 5 else "")
            also = f" and the report job {report} that waited on them" if report else ""
            print(f"{who}: cancelled {len(stuck)} task(s) that could never start ({names}){also}: {stuck[0].reason}")
        return {t.job_id for t in stuck}

    def finish(self, run: RunJobs) -> int:
        run_dir = self.layout.root
        if not run.job_ids:
            print(f"run_dir: {run_dir}")
            return 0
        print(
            f"submitted {len(run.job_ids)} array job(s): {' '.join(run.job_ids)} "
            f"(python -m slurm_router.status {run_dir} [--wait])"
        )
        if not self.cfg.launcher.wait:
            print(f"run_dir: {run_dir}")
            return 0
        return self._wait(run)

    def progress(self):
        """launcher.wait=true's live view of the tasks (launch/progress.py): each task's own task.json, a fused
        task's leader with its members."""
        from slurm_router.launch.progress import Progress
        from slurm_router.rundir.spec import TaskSpec

        specs = []
        for name, entry in (self.manifest.data.get("tasks") or {}).items():
            task_file = self.layout.task(name).task_file
            if not entry.get("fused_into") and task_file.is_file():
                specs.append(TaskSpec.load(task_file))
        return Progress(specs)

    def _wait(self, run: RunJobs) -> int:
        """launcher.wait=true: the whole run, report job included; then print the report that job wrote (or,
        if it did not, say so and write it here: by then nothing else writes report/)."""
        from slurm_router.analysis.console import print_table
        from slurm_router.analysis.report import write_report
        from slurm_router.backends.slurm.queries import SUCCESS_STATES, wait_for_job, wait_for_run

        progress = self.progress()  # a bar per task on a terminal, plain lines in a log: as a local run shows
        try:
            tasks = wait_for_run(self.manifest.data, poll_s=2.0, on_poll=progress.follow)
            progress.follow(tasks)
        finally:
            progress.close()
        ok = all(t.state in SUCCESS_STATES for t in tasks)
        self.cancel_never_runnable("launcher.wait")  # a cluster that kept them PENDING: free the report job
        self.manifest.set(state="completed" if ok else "failed")
        report_state = wait_for_job(run.report_job_id, poll_s=2.0) if run.report_job_id else "NOT SUBMITTED"
        summary_file = self.layout.summary
        if report_state == "COMPLETED" and summary_file.is_file():
            summary = json.loads(summary_file.read_text())
        else:
            from slurm_router.rundir.progress import setup_failure

            setup = setup_failure(self.layout.root, run.report_job_id)
            print(
                f"report job {run.report_job_id or '-'} ended {report_state}"
                f"{f' (setup failed: {setup})' if setup else ''}: writing the report here",
                file=sys.stderr,
            )
            summary = write_report(self.layout.root)
        print_table(summary)
        print(f"run_dir: {self.layout.root}")
        return 0 if ok else 1
