"""One launcher interface and the one loop that drives it (docs/design/orchestration.md, "Orchestration").

    Launcher (one per launcher= kind)     check(cfg); submit_stage(stage, after) -> StageJobs; report_job(after)
    submit_stages(launcher, stages)        the order, the cached base, the dependency chain, the manifest, the report

In the spirit of Hydra's BaseSubmititLauncher and submitit's Executor: what differs between backends is small
and lives in a Launcher; everything a run does the same way on each of them lives in submit_stages, which a
fresh run and resume= (with only the unfinished tasks) both call. The local launcher is synchronous: its
submit_stage runs the stage's queue to the end and returns the tasks' final states; a queue's launchers
return as soon as the stage's array job is queued, and the next stage waits on it (its scheduler's dependency).
"""

from __future__ import annotations

import shutil
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, cast

from omegaconf import OmegaConf

from slurm_router.artifacts import base_cache
from slurm_router.errors import SchedulerUnavailable, UserError
from slurm_router.rundir.layout import RunLayout
from slurm_router.rundir.lifecycle import TaskState, raise_if_stop_dropped
from slurm_router.rundir.spec import Stage, TaskSpec
from slurm_router.scheduler.task_view import TaskView
from slurm_router.worker.auto_seeds import reserve_index


@dataclass(frozen=True)
class TaskJob:
    """Where a queue runs one task: its job id (JOB_INDEX for an array task; co-located tasks share one) and logs."""

    job_id: str
    log_path: str
    err_path: str

    @property
    def array_index(self) -> int | None:
        return int(self.job_id.split("_")[1]) if "_" in self.job_id else None


@dataclass
class StageJobs:
    """What submit_stage did with one stage."""

    job_id: str | None = None  # the stage's job (the next stage's dependency); None: nothing queued
    tasks: dict[str, TaskJob] = field(default_factory=dict)  # a queue: task name -> its job
    states: dict[str, TaskState] = field(default_factory=dict)  # synchronous: task name -> final state
    job_name: str | None = None  # the scheduler's name of the job: status matches its rows by id, name and submit time


@dataclass
class RunJobs:
    """What submit_stages did with a whole run."""

    job_ids: list[str] = field(default_factory=list)  # one per submitted stage, in order
    states: dict[str, TaskState] = field(default_factory=dict)  # synchronous launchers' final states
    report_job_id: str | None = None

    @property
    def ok(self) -> bool:
        return all(s.done for s in self.states.values())


class Launcher(ABC):
    """One backend. Instances are made after the run directory exists; check() runs before anything is written."""

    schema: ClassVar[type]  # its config dataclass (slurm_router.config.schema); schema.kind names it
    synchronous: ClassVar[bool] = False  # submit_stage returns only once the stage's tasks have ended
    new_snapshot: bool  # set by resume= before submitting (backends/slurm/common.py reads it)

    @property
    def chains_rounds(self) -> bool:
        """A queue that can hold a job until another has ended, whatever its state: seeds=auto's reserves are then
        queued round by round (reserve_rounds), each part's submit_stage given after_round, so a reserve starts
        only once its call can be made and never holds devices while it waits for it."""
        return False

    def __init__(self, cfg, manifest):
        self.cfg, self.manifest = cfg, manifest
        self.layout: RunLayout = manifest.layout

    @classmethod
    def check(cls, cfg) -> None:
        """Every check this launcher needs, before any file is written. Raises UserError (one line)."""

    @classmethod
    def auto_fuse_variants(cls, cfg, n_tasks: int) -> tuple[int, str]:
        """resources.fuse_variants=auto: (K, one line saying why) for a variants stage of n_tasks tasks. Only a
        launcher that knows the devices its tasks get can choose (check() refuses auto elsewhere)."""
        raise UserError(
            f"resources.fuse_variants=auto does not work with {cls.__name__}: set resources.fuse_variants=K"
        )

    def check_resume(self) -> None:
        """resume= with this launcher: what must hold before the run's unfinished tasks start again."""

    def prepare(self) -> None:
        """Once per submission, before the first stage (a queue's code snapshot: launch/snapshot.py)."""

    def refuse_live_tasks(self) -> None:
        """resume= of a run this launcher ran: refuse (UserError) while any of its tasks still runs."""

    @abstractmethod
    def submit_stage(self, stage: Stage, after: str | None, after_round: str | None = None) -> StageJobs:
        """Run or queue one stage's tasks; `after` is the previous stage's job id (the one it waits on, to succeed);
        `after_round` (chains_rounds only): the job of the round before, which must have ended, in any state."""

    @abstractmethod
    def report_job(self, after: str | None) -> str | None:
        """Write the report (synchronous) or queue the job that writes it once `after` has ended; its id."""

    @abstractmethod
    def finish(self, run: RunJobs) -> int:
        """After submit_stages: tell the user (and wait, if asked); the command's exit code."""

    # ---- what status, --wait, --cancel and resume= ask of the scheduler that runs a run's tasks ------------------
    @classmethod
    @abstractmethod
    def task_states(cls, manifest: dict) -> list[TaskView]:
        """Each task of a run this launcher ran, in scheduler/task_view.py's words (task_view.describe adds the
        logs and progress): the local launcher's from the manifest it keeps; a launcher that returns before its
        tasks end asks its scheduler."""

    @classmethod
    @abstractmethod
    def cancel(cls, manifest: dict) -> str | None:
        """Stop a run's tasks (`status RUN_DIR --cancel`): one line saying what was done, None if nothing runs."""

    def interrupted(self) -> int:
        """Ctrl-C while submit_stages ran (only a synchronous launcher is still running tasks then)."""
        raise KeyboardInterrupt


def launch(launcher: Launcher, stages: list[Stage]) -> int:
    """submit_stages, then the launcher's finish; the run is marked failed if a submission was refused."""
    try:
        run = submit_stages(launcher, stages)
    except KeyboardInterrupt:
        return launcher.interrupted()
    except UserError:
        launcher.manifest.set(state="failed")
        raise
    except SchedulerUnavailable as e:  # what was not submitted is submitted by resume=, once the scheduler answers
        launcher.manifest.set(state="interrupted")
        root = launcher.layout.root
        print(f"run_dir: {root}")
        todo = f"once {e.back}, continue with: python -m slurm_router resume={root}"
        raise SchedulerUnavailable(e.what, todo, e.back) from None
    return launcher.finish(run)


def submit_stages(launcher: Launcher, stages: list[Stage]) -> RunJobs:
    """The one loop: stages in order; a cached base is not run (its cache meta becomes its result; a cache found
    damaged or gone by then is trained again, as the stage it is); each stage
    waits on the one before (its dependency); a stage after a failed one is skipped; the manifest records every task's
    job or state; the report job comes last. resume= passes stages holding only the unfinished tasks."""
    manifest, run, after = launcher.manifest, RunJobs(), None
    launcher.prepare()
    for stage in stages:
        raise_if_stop_dropped()
        if stage.cached and _reuse_cached(stage, manifest):
            continue
        if _blocked(stage, stages, run.states):
            for t in stage.tasks:
                run.states[t.name] = TaskState.SKIPPED
                manifest.set_task(t.name, state=TaskState.SKIPPED.value)
            continue
        last_round = None
        for part in reserve_rounds(stage) if launcher.chains_rounds else [stage]:
            asked = time.time()  # no earlier than the scheduler's submit time of the part's job
            jobs = launcher.submit_stage(part, after=after, after_round=last_round)
            _record(manifest, part, jobs, asked)
            run.states.update(jobs.states)
            if jobs.job_id:
                run.job_ids.append(jobs.job_id)
                last_round = jobs.job_id
        after = last_round or after
    if launcher.synchronous:
        manifest.set(state="completed" if run.ok else "failed")
    elif run.job_ids:
        manifest.set(state="submitted", job_ids=run.job_ids)
    else:  # launcher.dry_run: scripts rendered, nothing queued, nothing to report
        manifest.set(state="rendered")
        return run
    run.report_job_id = launcher.report_job(after=after)
    if run.report_job_id:
        manifest.set(report_job_id=run.report_job_id)
    return run


def reserve_rounds(stage: Stage) -> list[Stage]:
    """The stage as a queue submits it: one part, or, with seeds=auto reserves (worker/auto_seeds.py), the first
    round (every task that is not a reserve) and then one part per reserve replicate, in order. A part after the
    first waits for the one before to end, so its reserves' call (verdict/contest.py reserve_call: every earlier
    replicate ended undecided) can be made as they start: they spend no device time waiting for it."""
    by_round: dict[int, list[TaskSpec]] = {}
    for t in stage.tasks:
        by_round.setdefault(reserve_index(t) or 0, []).append(t)
    if len(by_round) < 2:
        return [stage]
    return [
        Stage(stage.name, by_round[r], stage.cached, stage.depends_on, stage.fused if r == 0 else [], round=r)
        for r in sorted(by_round)
    ]


def cached_base(task: TaskSpec) -> Path | None:
    """The cache's meta.json of a base stage task whose weights an earlier run trained, if the cache is whole
    (verified: slurm_router.artifacts.base_cache), else None; a damaged cache is named in one line."""
    if not task.save_weights or not base_cache.usable(task.save_weights):
        return None
    return base_cache.meta_path(task.save_weights)


def _reuse_cached(stage: Stage, manifest) -> bool:
    """A base an earlier run trained: its cache's meta.json is this run's result for it. False when the cache
    cannot be used now (damaged, or deleted since the plan or since the run's first attempt): the stage then
    holds the tasks to train again, and submit_stages runs it like any other stage."""
    tasks = [t for t in stage.tasks or _finished_tasks(stage, manifest) if t.save_weights]
    rebuild = [t for t in tasks if base_cache.check(cast(str, t.save_weights)) is not None]
    for t in rebuild:
        base_cache.say_unusable(cast(str, t.save_weights), cast(str, base_cache.check(cast(str, t.save_weights))))
        base_cache.check_room(OmegaConf.create(t.config))  # UserError before anything changes
    for t in tasks:
        result = RunLayout(t.run_dir).task(t.name).result
        if t in rebuild:
            result.unlink(missing_ok=True)  # it stood for weights that are gone
            manifest.set_task(t.name, state=TaskState.PENDING.value)
        elif not result.is_file():
            shutil.copy(base_cache.meta_path(cast(str, t.save_weights)), result)
            manifest.set_task(t.name, state=TaskState.CACHED.value)
            print(f"base stage: reusing the cached base model {t.save_weights}")
    if rebuild:
        stage.tasks, stage.cached = rebuild, False
    return not rebuild


def _finished_tasks(stage: Stage, manifest) -> list[TaskSpec]:
    """resume= passes a stage whose tasks all finished without them: their specs, from the run dir."""
    specs = []
    for name in manifest.stage_tasks(stage.name):
        try:
            specs.append(TaskSpec.load(manifest.layout.task(name).task_file))
        except (OSError, ValueError, TypeError):
            continue  # resume has already refused a run with a damaged task.json
    return specs


def _blocked(stage: Stage, stages: list[Stage], states: dict[str, TaskState]) -> bool:
    """An earlier stage this one depends on did not complete here (only synchronous launchers know yet)."""
    return any(
        states.get(t.name, TaskState.COMPLETED) not in (TaskState.COMPLETED, TaskState.CACHED)
        for s in stages
        if s.name in stage.depends_on
        for t in s.tasks
    )


def _record(manifest, stage: Stage, jobs: StageJobs, asked: float | None = None) -> None:
    """The manifest's record of one stage: each task's job (a queue) or final state (synchronous launchers)."""
    for name, state in jobs.states.items():
        manifest.data["tasks"][name]["state"] = state.value
    if jobs.job_id:
        rows = []
        for t in stage.tasks:
            job = jobs.tasks[t.name]
            rows.append(
                {
                    "variant": t.name,
                    "array_index": job.array_index,
                    "job_id": job.job_id,
                    "log_path": job.log_path,
                    "err_path": job.err_path,
                }
            )
            manifest.data["tasks"][t.name].update(
                state=TaskState.SUBMITTED.value, job_id=job.job_id, log_path=job.log_path
            )
        array = any(job.array_index is not None for job in jobs.tasks.values())
        record = {"stage": stage.name, "job_id": jobs.job_id, "array": array, "tasks": rows}
        if (
            jobs.job_name
        ):  # a job id a scheduler hands out again later (ids wrap, accounting reset) is told apart by these
            record.update(name=jobs.job_name, submitted_at=asked)
        manifest.data["jobs"].append(record)
    manifest.save()
