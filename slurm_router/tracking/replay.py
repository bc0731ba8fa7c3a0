"""After the run: a run's events replayed into a tracker (`python -m slurm_router.analysis RUN_DIR --to KIND`), and
the lines that say how to open each tracker's view of it (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from slurm_router.errors import UserError
from slurm_router.tracking.trackers import (
    Target,
    missing_package,
    open_trackers,
    read_records,
    tracked_rows,
    tracker_file,
)


def replay(run_dir: str | os.PathLike, kind: str) -> list[str]:
    """`python -m slurm_router.analysis RUN_DIR --to KIND`: each task's rank-0 events, in the order written, into
    a new tracker run per task, through the sink the workers use. Returns the lines to print. UserError (one line)
    for a missing package, or a task whose tracker.json already has a run of that tracker."""
    from slurm_router.rundir.manifest import Manifest
    from slurm_router.rundir.spec import TaskSpec

    error = missing_package(kind)
    if error:
        raise error
    manifest = Manifest.load(run_dir)
    layout = manifest.layout
    tasks = [layout.task(name) for name in manifest.data["tasks"]]
    tasks = [t for t in tasks if t.events(0).is_file() and t.task_file.is_file()]
    if not tasks:
        raise UserError(f"{run_dir}: no task has written events yet: nothing to replay")
    for t in tasks:
        record = read_records(t.dir).get(kind)
        if record:
            which = record.get("run_id") or record.get("id") or record.get("log_dir")
            raise UserError(
                f"{tracker_file(t.dir)}: task {t.name} already has a {kind} run ({which}): its events "
                f"are there; remove the {kind!r} entry to replay again"
            )
    lines = []
    state = manifest.data.get("state")
    if state not in ("completed", "failed", "interrupted"):
        lines.append(f"note: the run is {state}: its tasks are replayed up to the last step they have written")
    for t in tasks:
        try:
            sink = open_trackers(Target.of(TaskSpec.load(t.task_file), [kind], layout.root), t.dir, replay=True)
        except RuntimeError as e:  # the tracker refused (a server that cannot be reached, ...)
            raise UserError(str(e)) from None
        for row in tracked_rows(t.events(0)):
            sink.log(row)
        sink.close()
        lines.append(f"{t.name}: {sink.logged['step']} steps, {sink.logged['eval']} evaluations -> {kind}")
    return lines + tracker_lines(layout.root)


def tracker_lines(run_dir: str | os.PathLike) -> list[str]:
    """What to type to look at a run's trackers (and to upload its offline W&B runs), from its tasks' tracker.json:
    printed under the report's table and by the replay."""
    from slurm_router.rundir.layout import RunLayout

    tasks = RunLayout(run_dir).tasks
    records = [read_records(d) for d in sorted(tasks.iterdir())] if tasks.is_dir() else []
    lines = []
    tb = sorted({str(Path(r["tensorboard"]["log_dir"]).parents[1]) for r in records if "tensorboard" in r})
    lines += [f"tensorboard: tensorboard --logdir {shlex.quote(d)}" for d in tb]
    ml = sorted({r["mlflow"]["tracking_uri"] for r in records if "mlflow" in r})
    lines += [
        f"mlflow: MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {shlex.quote(u)}"
        if u.startswith("file:")
        else f"mlflow: runs in {u}"
        for u in ml
    ]
    for d in sorted({r["wandb"]["dir"] for r in records if "wandb" in r}):
        offline = Path(d) / "wandb"
        ids = sorted(
            r["wandb"]["id"]
            for r in records
            if r.get("wandb", {}).get("dir") == d and any(offline.glob(f"offline-run-*-{r['wandb']['id']}"))
        )
        if not ids:  # online: W&B has them already
            continue
        # this run's own folder holds its runs only; a shared tracker.dir is named run by run (each attempt of a
        # task is an offline-run-<time>-<id> folder; wandb sync uploads them as one run, in start order)
        own = Path(run_dir).absolute() in offline.parents
        patterns = ["offline-run-*"] if own else [f"offline-run-*-{i}" for i in ids]
        paths = " ".join(f"{shlex.quote(str(offline))}/{p}" for p in patterns)
        lines.append(f"wandb: offline runs; upload them with: wandb sync {paths}")
    return lines
