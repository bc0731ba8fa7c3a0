"""`python -m slurm_router.status` without a run dir: the recent runs under run_root, newest first, each with its
state, experiment, launcher, start time and tasks done/total, read from its manifest (rundir.Manifest) and its
tasks' result files. Runs that a scheduler runs are looked up with one query of it for all of them. dry_run=true
previews are left out (a line says how many), and listed with --previews.

    python -m slurm_router.status [--run-root runs] [--limit 20] [--previews] [--json]
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slurm_router.errors import UserError
from slurm_router.rundir.layout import MANIFEST, RunLayout
from slurm_router.rundir.manifest import Manifest
from slurm_router.rundir.progress import decided_state, task_ended_as


@dataclass
class RunRow:
    run_dir: str
    run_id: str | None
    experiment: str | None
    launcher: str | None
    created: float | None  # unix time the run dir was made
    state: str  # the manifest's state, made current (below)
    tasks_done: int  # tasks with a result (completed or cached, or ended by the run's decision)
    tasks_total: int
    decided: dict[str, int] = field(default_factory=dict)  # of those, ended by the run's decision: PRUNED: n, ...


def find_runs(run_root: str) -> list[Path]:
    """The run dirs under run_root (runs/<experiment>/<timestamp>/, or an experiment's folder itself), newest
    first by their timestamp names. UserError (one line) if run_root is not a folder."""
    root = Path(os.path.expanduser(run_root))
    if not root.is_dir():
        raise UserError(
            f"--run-root {run_root}: no such folder: give the run_root your runs were written to "
            "(python -m slurm_router.status --run-root DIR), or a run dir"
        )
    found = [p.parent for pattern in (f"*/*/{MANIFEST}", f"*/{MANIFEST}") for p in root.glob(pattern)]
    return sorted(found, key=lambda p: (p.name, str(p)), reverse=True)


def live_jobs(data: dict, seen: dict[str, dict[str, str]]) -> dict[str, str]:
    """The jobs the run's scheduler holds now (scheduler/registry.py: the manifest's launcher), asked once per
    scheduler for all the runs listed."""
    from slurm_router.scheduler.registry import run_backend

    try:
        backend = run_backend(data)
    except UserError:  # a launcher no backend has now: nothing to ask
        return {}
    if backend.name not in seen:
        seen[backend.name] = backend.live_jobs()
    return seen[backend.name]


def run_state(data: dict, live: dict[str, str], done: int, total: int) -> str:
    """The manifest's state, made current: a Slurm run is running or pending while Slurm holds one of its jobs,
    else completed (every task has its result) or ended; a local run whose launcher is gone is interrupted."""
    from slurm_router.rundir.lock import owner_alive

    state = str(data.get("state") or "?")
    if state == "running" and data.get("launcher") == "local" and owner_alive(data.get("owner") or {}) is False:
        return "interrupted (launcher gone)"
    if state != "submitted":
        return state
    ids = [str(j.get("job_id")) for j in data.get("jobs") or []] + [str(data.get("report_job_id") or "")]
    states = [live[i] for i in ids if i in live]
    if states:
        return "running" if "RUNNING" in states else states[0].lower()
    return "completed" if total and done == total else "ended"


def list_runs(run_root: str, limit: int = 20, previews: bool = False) -> tuple[list[RunRow], int]:
    """(the newest `limit` runs, the dry_run=true previews left out among the runs looked at)."""
    rows: list[RunRow] = []
    seen: dict[str, dict[str, str]] = {}
    hidden = 0
    for run_dir in find_runs(run_root):
        if len(rows) >= limit:
            break
        try:
            data = Manifest.load(run_dir).data
        except UserError:
            continue  # damaged, or being made: not listed
        if data.get("state") == "previewed" and not previews:  # launch/preview.py: nothing ran
            hidden += 1
            continue
        tasks = data.get("tasks") or {}
        layout = RunLayout(run_dir)
        ended = [name for name in tasks if layout.task(name).result.is_file()]
        decided: dict[str, int] = {}
        for word in (decided_state(task_ended_as(layout.task(name).dir)) for name in ended):
            if word:
                decided[word] = decided.get(word, 0) + 1
        done = len(ended)
        live = live_jobs(data, seen) if data.get("state") == "submitted" else {}
        rows.append(
            RunRow(
                str(run_dir),
                data.get("run_id"),
                data.get("experiment"),
                data.get("launcher"),
                data.get("created"),
                run_state(data, live, done, len(tasks)),
                done,
                len(tasks),
                decided,
            )
        )
    return rows, hidden


def _decided_words(decided: dict[str, int]) -> str:
    """' (4 pruned, 2 not needed)': the tasks counted done that the run's decision ended, not trained to the end."""
    words = [f"{n} {state.lower().replace('_', ' ')}" for state, n in decided.items()]
    return f" ({', '.join(words)})" if words else ""


def print_runs(run_root: str, limit: int = 20, as_json: bool = False, previews: bool = False) -> None:
    rows, hidden = list_runs(run_root, limit, previews=previews)
    if as_json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return
    left_out = (
        f"{hidden} dry_run=true preview(s) not listed (--previews lists them, --clean-previews deletes them)"
        if hidden
        else ""
    )
    if not rows:
        print(f"no runs under {run_root}" + (f"; {left_out}" if left_out else ""))
        return
    table = [("started", "state", "experiment", "launcher", "tasks", "run_dir")] + [
        (
            time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created)) if r.created else "-",
            r.state,
            r.experiment or "-",
            r.launcher or "-",
            f"{r.tasks_done}/{r.tasks_total}" + _decided_words(r.decided),
            r.run_dir,
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    if left_out:
        print(left_out)


def clean_previews(run_root: str) -> int:
    """Delete the dry_run=true previews under run_root: run dirs whose manifest says previewed and that hold no
    events, checkpoint or result (nothing ever ran in them). Prints what it deleted; returns how many."""
    import shutil

    gone = 0
    for run_dir in find_runs(run_root):
        try:
            data = Manifest.load(run_dir).data
        except UserError:
            continue
        ran = any(run_dir.glob("tasks/*/events-rank*.jsonl")) or any(run_dir.glob("tasks/*/result.json"))
        if data.get("state") != "previewed" or ran:
            continue
        shutil.rmtree(run_dir)
        print(f"deleted the preview {run_dir}")
        gone += 1
    print(f"{gone} dry_run=true preview(s) deleted under {run_root}" if gone else f"no previews under {run_root}")
    return gone
