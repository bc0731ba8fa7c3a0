"""The run's contest as the report reads it (prune=true's looks, seeds=auto's rounds): RUN_DIR/decisions.jsonl and
each task's end, put in the summary by report.py; the rules themselves are verdict/contest.py's."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_router.analysis.load import Task
from slurm_router.rundir.layout import RunLayout
from slurm_router.verdict import AUTO_FIRST, contest


def task_config(run_dir: Path, name: str) -> dict:
    """A task's resolved config (its task.json), {} when it cannot be read."""
    spec = RunLayout(run_dir).task(name).task_file
    try:
        return json.loads(spec.read_text()).get("config") or {}
    except (OSError, ValueError):
        return {}


def rounds(run_dir: Path, every: list[Task]) -> dict[str, int]:
    """seeds=auto's round of each replicate (0: the first AUTO_FIRST of each variant, then one round per reserve
    depth); {} for any other run."""
    config = next((task_config(run_dir, t.name) for t in every if t.stage != "base"), {})
    if config.get("seeds") != "auto":
        return {}
    first = int(config.get("seed", 0))
    reps = [t for t in every if t.stage != "base" and t.seed is not None]
    return {t.name: max(0, int(t.seed or 0) - first - AUTO_FIRST + 1) for t in reps}


def prune_looks(run_dir: Path) -> list[dict]:
    """RUN_DIR/decisions.jsonl: prune=true's looks, each {look, step, threshold, looks, rows, pruned}."""
    from slurm_router.worker.prune import read_looks  # the reader the tasks use (a torn line is left out)

    try:
        looks = read_looks(run_dir)
    except OSError:  # unreadable: the report goes on without the looks
        return []
    keys = ("look", "step", "threshold", "looks", "rows", "pruned", "depth", "cap", "min_effect", "equivalent")
    return [{k: row[k] for k in keys if k in row} for row in looks]


def auto_seeds(run_dir: Path, every: list[Task], looks: list[dict]) -> dict | None:
    """seeds=auto's account: replicates run per variant, the reserves not run (why) or stopped once the contest was
    decided, and its one line."""
    config = next((task_config(run_dir, t.name) for t in every if t.stage != "base"), {})
    if config.get("seeds") != "auto":
        return None
    unneeded = {t.name: t.not_needed for t in every if t.not_needed}  # step 0: never ran
    ran: dict[str, int] = {}  # the replicates that count: ended completed, pruned, or stopped once decided
    lost: list[str] = []  # the ones the verdict cannot use (failed, diverged, still running)
    for t in every:
        if t.stage != "base":
            state = (t.end or {}).get("exit_state")
            counts = state in ("completed", "pruned") or (t.name in unneeded and unneeded[t.name]["step"])
            ran[t.variant] = ran.get(t.variant, 0) + (1 if counts else 0)
            if not counts and t.name not in unneeded:
                lost.append(f"{t.name} {state or 'not ended'}")
    not_run = [u["detail"] for u in unneeded.values() if not u["step"]]
    stopped = [f"{n}: stopped at step {u['step']}: {u['detail']}" for n, u in unneeded.items() if u["step"]]
    cap = int((config.get("auto_seeds") or {}).get("max", 6))
    settled = contest.settled_by(looks)
    trained = [t for t in every if t.stage != "base" and t.name not in unneeded]
    diverged = {t.variant for t in trained if t.diverged} - {t.variant for t in trained if not t.diverged}
    return {
        "cap": cap,
        "ran": ran,
        "not_run": not_run,
        "stopped": stopped,  # reserves running when the contest was decided for their variant: stopped then
        "settled_at_look": settled["look"] if settled else None,  # auto_seeds.min_effect: all within it
        "diverged": sorted(diverged),  # variants out of the contest: every replicate diverged
        "lost": lost,
        "line": contest.auto_line(looks, ran, not_run, cap, stopped, diverged)
        + (f"; not counted: {', '.join(lost)}" if lost else ""),
    }
