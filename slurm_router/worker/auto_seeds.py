"""seeds=auto's reserves, where the run's files are: a variant's replicates after the first two are reserves (queued
last: launch/plan.py queue_order). Before its workers start, a reserve's job waits here until the contest says what
it does (verdict/contest.py reserve_call): it runs once every earlier replicate of the variants still in the contest
has ended undecided, or it ends at once, `not_needed`, when its variant was pruned, the contest is decided, or
auto_seeds.budget_device_hours is spent. The call is recorded in tasks/<name>/reserve.json, taken once under
RUN_DIR/decisions.lock: every rank of a multi-node reserve, and a requeued attempt, follow the same call
(docs/design/pruning.md, "seeds=auto")."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from slurm_router.fileio import atomic_write_text
from slurm_router.rundir.layout import RunLayout, TaskPaths
from slurm_router.rundir.lock import short_lock
from slurm_router.verdict import AUTO_FIRST
from slurm_router.verdict.contest import RUN, SKIP, Replicate, decided_stop, diverged_out, reserve_call
from slurm_router.worker.prune import diverged, ended, planned, read_looks, read_rows, replicate_index

RESERVE_FILE = "reserve.json"
POLL_S = 1.0
NOT_NEEDED = "not_needed"  # a reserve's exit_state when it never ran, or stopped once its contest was decided


def reserve_index(spec) -> int | None:
    """The replicate's place among its variant's seeds when it is a seeds=auto reserve (>= AUTO_FIRST), else
    None (a base, a fused group, any other run)."""
    config = spec.config or {}
    if config.get("seeds") != "auto" or spec.stage != "variants" or spec.members or spec.fused_into:
        return None
    index = replicate_index(spec)
    return index if index >= AUTO_FIRST else None


def decided_reserve(spec) -> str | None:
    """Why this running seeds=auto reserve stops now: its contest was decided, its variant the one left
    (verdict/contest.py decided_stop); None for any other task, or while the contest is open."""
    index = reserve_index(spec)
    if index is None:
        return None
    reps = replicates(spec.run_dir)
    variants = {r.variant for r in reps} - diverged_out(reps)  # a variant that diverged is out of the contest
    return decided_stop(spec.variant, index, variants, read_looks(spec.run_dir))


def wait_for_call(spec, stop: Callable[[], bool] = lambda: False, poll_s: float = POLL_S) -> dict | None:
    """Block until the reserve's call is made: None to run it, or its not_needed result (the job writes it and
    its end row: supervise/job.py). Any other task returns None at once; so does a reserve told to stop while
    it waits (stop(): a signal came; the job then stops as before its workers start). The local queue starts a
    reserve only once its call is made (call_now), so there it never waits here; a Slurm array task may."""
    index = reserve_index(spec)
    if index is None:
        return None
    plan = planned(spec.run_dir)  # read once: which tasks the run has; each poll only asks which have ended
    announced = False
    while True:
        made = call_now(spec, plan)
        if made is not None:
            if made["call"] == RUN:
                print(f"{spec.name}: seeds=auto reserve {index + 1}: the contest is undecided, it runs", flush=True)
                return None
            assert made["call"] == SKIP
            print(made["reason"], flush=True)
            return {"exit_state": NOT_NEEDED, "reason": made["reason"], "steps": spec.steps}
        if stop():
            return None
        if not announced:
            print(f"{spec.name}: seeds=auto reserve {index + 1}: waiting for the earlier replicates", flush=True)
            announced = True
        time.sleep(poll_s)


def call_now(spec, plan: list | None = None) -> dict | None:
    """The reserve's call ({call: run | skip, reason, index, time}) when it can be made now, else None (it waits).
    Made once for the run, under RUN_DIR/decisions.lock, and kept in tasks/<name>/reserve.json: every rank, a
    requeued attempt and the local queue that asks before starting it follow the same call."""
    index = reserve_index(spec)
    if index is None:
        return {"call": RUN, "reason": None, "index": None, "time": time.time()}
    paths = TaskPaths(spec.task_dir)
    budget = ((spec.config.get("auto_seeds") or {}).get("budget_device_hours")) if spec.config else None
    with short_lock(RunLayout(spec.run_dir).decisions_lock):
        made = _read(paths.dir / RESERVE_FILE)
        if made is None:
            reps = [Replicate(v, i, ended(p), diverged(p)) for v, i, p in (plan or planned(spec.run_dir))]
            spent = spent_device_hours(spec.run_dir) if budget is not None else 0.0
            call, why = reserve_call(spec.variant, index, reps, read_looks(spec.run_dir), spent, budget)
            if call != "wait":
                made = {"call": call, "reason": why, "index": index, "time": time.time()}
                atomic_write_text(paths.dir / RESERVE_FILE, json.dumps(made))
    return made


def replicates(run_dir) -> list[Replicate]:
    """Every variants-stage task of the run as the contest sees it, ended or not."""
    return [Replicate(v, i, ended(p), diverged(p)) for v, i, p in planned(run_dir)]


def spent_device_hours(run_dir) -> float:
    """Device-hours the run's tasks have used so far, counted as the report counts them (analysis/report.py): a task
    that ended, its elapsed time as the launcher recorded it (the manifest's elapsed_s) x its devices; one still
    running, its events' first to last row in each attempt; a fused group once, by its leader (its members'
    entries mirror the leader's). It counted each fused member again, and the gaps between attempts."""
    layout = RunLayout(run_dir)
    manifest = _read(layout.manifest) or {}
    total_s = 0.0
    for paths in (TaskPaths(d) for d in sorted(layout.tasks.iterdir()) if d.is_dir()):
        spec = _read(paths.task_file) or {}
        if spec.get("fused_into"):
            continue
        entry = (manifest.get("tasks") or {}).get(paths.name) or {}
        elapsed = entry.get("elapsed_s")
        if isinstance(elapsed, (int, float)):
            seconds = float(elapsed)
        else:
            spans: dict[int, list[float]] = {}
            for row in read_rows(paths.events(0)):
                if "time" in row:
                    spans.setdefault(int(row.get("attempt") or 0), []).append(float(row["time"]))
            seconds = sum(max(t) - min(t) for t in spans.values())
        total_s += int(spec.get("devices", 1)) * seconds
    return total_s / 3600


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
