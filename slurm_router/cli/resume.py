"""`resume=RUN_DIR` (and `slurm-router resume RUN_DIR`): its arguments checked, then the run's unfinished tasks
launched again, each from its newest valid checkpoint (launch/resume.py plans them)."""

from __future__ import annotations

from slurm_router.errors import UserError


def is_resume(override: str) -> bool:
    return override.split("=", 1)[0].lstrip("+") == "resume"


def resume(overrides: list[str], multirun: bool) -> int:
    """resume=RUN_DIR [launcher=local] [new_snapshot=true]: no other argument, the run keeps its own config."""
    from slurm_router.launch.snapshot import NEW_SNAPSHOT

    given = [o for o in overrides if is_resume(o)]
    flags = [o for o in overrides if o.split("=", 1)[0] == NEW_SNAPSHOT]
    others = [o for o in overrides if o not in given and o not in flags]
    if len(given) > 1 or others not in ([], ["launcher=local"]) or multirun or len(flags) > 1:
        raise UserError(
            f"resume=RUN_DIR takes no other arguments but launcher=local and {NEW_SNAPSHOT}=true: "
            "the run continues with its own config.yaml"
        )
    new = _new_snapshot_flag(flags[0]) if flags else False
    if new and others:
        raise UserError(
            f"{NEW_SNAPSHOT}=true renews the code snapshot a Slurm run's jobs import; with "
            "launcher=local the tasks run this checkout as it is: drop one of the two"
        )
    return resume_run(given[0].split("=", 1)[1], here=bool(others), new_snapshot=new)


def _new_snapshot_flag(flag: str) -> bool:
    from slurm_router.launch.snapshot import NEW_SNAPSHOT

    value = flag.split("=", 1)[1].strip().lower()
    if value not in ("true", "false"):
        raise UserError(
            f"{flag}: {NEW_SNAPSHOT} is true or false (true: the jobs import the current code, recorded "
            "as a new snapshot beside the run's first)"
        )
    return value == "true"


def resume_run(arg: str, here: bool = False, new_snapshot: bool = False) -> int:
    """resume=RUN_DIR: the unfinished tasks of that run, each from its newest valid checkpoint, with the run's
    own launcher (a Slurm run is submitted again), or here with launcher=local. plan_resume takes the run's
    lock first (a second writer is refused, naming the holder) and plans from the manifest read under it.
    new_snapshot: the Slurm jobs import the current code, snapshotted anew beside the run's first snapshot (which
    is kept); without it a run whose snapshot is gone is refused (launch/snapshot.py)."""
    if not arg:
        raise UserError("resume= needs a run directory: resume=runs/<experiment>/<timestamp>")
    from slurm_router.launch.base import launch
    from slurm_router.launch.resume import plan_resume, renew_timeout_budget
    from slurm_router.scheduler.registry import launcher_class

    manifest, cfg, stages = plan_resume(arg)
    run_dir = manifest.layout.root
    kind = "local" if here else cfg.get("launcher", {}).get("kind", "local")
    todo = [t for s in stages if not s.cached for t in s.tasks]
    # never run a task twice at once: whatever launched the run before must hold none of its tasks now
    refuse_live_tasks = launcher_class(manifest.data.get("launcher", "local"))(cfg, manifest).refuse_live_tasks
    if not todo:
        if manifest.layout.summary.is_file():
            print(f"resume: every task of {run_dir} has completed; nothing to do\nrun_dir: {run_dir}")
            return 0
        refuse_live_tasks()  # interrupted during its report, or the report job failed: write it here
        print(f"resume: every task of {run_dir} has completed; writing the report")
        launcher_class("local")(cfg, manifest).report_job(after=None)
        manifest.set(state="completed")
        print(f"run_dir: {run_dir}")
        return 0
    if new_snapshot and launcher_class(kind).synchronous:
        raise UserError(
            f"new_snapshot=true: {run_dir} ran with launcher={kind}, whose tasks run this checkout as it "
            "is (no code snapshot): resume it without new_snapshot"
        )
    from slurm_router.cli.checks import check_resumed_run

    launcher = launcher_class(kind)(cfg, manifest)
    launcher.new_snapshot = new_snapshot
    check_resumed_run(cfg, launcher)
    refuse_live_tasks()
    renew_timeout_budget(todo)  # the user chose to go on: launcher.max_requeues counts afresh
    manifest.set(state="running", resumed=manifest.data.get("resumed", 0) + 1, launcher=kind)
    return launch(launcher, stages)
