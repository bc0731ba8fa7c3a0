"""A task's attempts, kept in RUN_DIR/tasks/<name>/attempts.json (stable across requeues): every start of a task is
a new attempt (0, 1, ...), and the time-limit hits, requeues and failures counted against launcher.max_requeues
and launcher.max_failures (slurm_router.supervise.requeue and retry decide; this module only keeps the count)."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_router.fileio import atomic_write_text
from slurm_router.rundir.layout import TaskPaths


def load_attempts(task_dir: Path) -> dict:
    """tasks/<name>/attempts.json (attempts, timeouts, requeues, failures); {} when missing or damaged."""
    try:
        data = json.loads(TaskPaths(Path(task_dir)).attempts.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def save_attempts(task_dir: Path, data: dict) -> None:
    atomic_write_text(TaskPaths(Path(task_dir)).attempts, json.dumps(data, indent=1))


def next_attempt(task_dir: Path) -> int:
    """Count one more start of this task; returns its attempt number (0 for the first)."""
    data = load_attempts(task_dir)
    attempt = int(data.get("attempts", 0))
    data["attempts"] = attempt + 1
    save_attempts(task_dir, data)
    return attempt


def reset_timeouts(task_dir: Path) -> None:
    """Start launcher.max_requeues over (resume=): earlier time-limit hits no longer count."""
    data = load_attempts(task_dir)
    if data.get("timeouts"):
        data["timeouts_before_resume"] = int(data.get("timeouts_before_resume", 0)) + int(data["timeouts"])
        data["timeouts"] = 0
        save_attempts(task_dir, data)


def current_attempt(task_dir: Path) -> int:
    """The attempt number of the latest start (what next_attempt returned last)."""
    return max(0, int(load_attempts(task_dir).get("attempts", 1)) - 1)
