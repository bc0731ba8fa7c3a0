"""One vocabulary for a task's life (docs/ARCHITECTURE.md, "A task's lifecycle"): the states the manifest
records, the exit codes a task process ends with, and the outcome each code means.

    pending --submit--> submitted --start--> running --> completed | failed | interrupted
    (a cached base is `cached` from the start; a task whose earlier stage failed is `skipped`)

Every state here is one that something writes: the local queue and the Slurm launchers (manifest), and
`status` maps Slurm's own words onto them for display. The exit codes are shared by the job process, the
co-location runner and the local queue, so they all read a child's end the same way
(TaskOutcome.from_exit_code).
"""

from __future__ import annotations

import enum
import json
import signal
from pathlib import Path
from typing import cast

from slurm_router.rundir.layout import ADAPTER_FILES, TaskPaths

# The stop signals: Slurm's time-limit warning or a preemption (USR2), kill (TERM), Ctrl-C (INT). Each one makes a
# task finish its step, checkpoint and stop (slurm_router.supervise.supervisor, worker.state).
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)

EXIT_OK = 0
EXIT_FAILED = 1  # a worker died or raised
EXIT_USAGE = 2  # the user's mistake (bad config, unusable checkpoints): one line said why
EXIT_STOPPED = 75  # stopped on a signal after a checkpoint; resume continues (EX_TEMPFAIL)
EXIT_REQUEUE = 76  # stopped after a checkpoint, asks its runner (co-located, or in a container its script) to requeue
EXIT_INTERRUPTED = 130  # the launcher itself after Ctrl-C (128 + SIGINT, as shells report it)


# The command's stop signals (Ctrl-C, `kill`) raise KeyboardInterrupt, and none may be lost. One raised while the
# interpreter runs a callback (importlib's module-lock cleanup during a lazy import, a __del__) is printed as
# "Exception ignored" and dropped: the run would go on to its end. Each one raised is counted; the launcher's
# loops call raise_if_stop_dropped where none can be in flight, and raise it again.
_stops_raised = 0


def raise_stop(signum, frame) -> None:
    """The command's SIGINT and SIGTERM handler."""
    global _stops_raised
    _stops_raised += 1
    raise KeyboardInterrupt


def raise_if_stop_dropped() -> None:
    """Call only where no KeyboardInterrupt can be propagating (a loop's top): a stop raised before and not
    handled (the launcher ends after handling one) was dropped, and is raised again here."""
    if _stops_raised:
        raise KeyboardInterrupt


def stops_raised() -> int:
    """How many stops the handler raised since forget_stops (an error after one is the stop's doing)."""
    return _stops_raised


def forget_stops() -> None:
    """A new command in this process (tests call main() in-process): no stop raised yet."""
    global _stops_raised
    _stops_raised = 0


class TaskState(str, enum.Enum):
    """What manifest.json says of a task. A str enum: it is written to JSON as its value."""

    PENDING = "pending"  # planned, not started or submitted yet
    CACHED = "cached"  # a base stage an earlier run trained: nothing to run
    SUBMITTED = "submitted"  # in its scheduler's queue (status asks Slurm for the live state)
    RUNNING = "running"  # started by the local queue
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # stopped on a signal with a checkpoint: resume= continues it
    SKIPPED = "skipped"  # an earlier stage did not complete: never started

    @property
    def done(self) -> bool:
        """Its result exists (resume skips it)."""
        return self in (TaskState.COMPLETED, TaskState.CACHED)

    @property
    def status_word(self) -> str:
        """The word `status` shows for it, in the words every backend's states are said in
        (scheduler/task_view.py; CACHED and INTERRUPTED are the run's)."""
        return _STATUS_WORDS[self]


_STATUS_WORDS = {
    TaskState.PENDING: "PENDING",
    TaskState.CACHED: "CACHED",
    TaskState.SUBMITTED: "PENDING",
    TaskState.RUNNING: "RUNNING",
    TaskState.COMPLETED: "COMPLETED",
    TaskState.FAILED: "FAILED",
    TaskState.INTERRUPTED: "INTERRUPTED",  # ours, as the run list says it: stopped with a checkpoint, resumable
    TaskState.SKIPPED: "CANCELLED",
}


class TaskOutcome(str, enum.Enum):
    """How one task process (or K co-located ones) ended."""

    COMPLETED = "completed"
    STOPPED = "stopped"  # checkpointed after a signal; not requeued
    REQUEUE = "requeue"  # checkpointed and wants its allocation requeued (co-located tasks)
    FAILED = "failed"

    @classmethod
    def from_exit_code(cls, code: int | None) -> "TaskOutcome":
        return {EXIT_OK: cls.COMPLETED, EXIT_STOPPED: cls.STOPPED, EXIT_REQUEUE: cls.REQUEUE}.get(
            cast(int, code), cls.FAILED
        )

    @classmethod
    def combine(cls, outcomes: list["TaskOutcome"]) -> "TaskOutcome":
        """Co-located tasks' outcome: any failure fails it; else any requeue request requeues it (once); else stopped if
        any stopped."""
        for worst in (cls.FAILED, cls.REQUEUE, cls.STOPPED):
            if worst in outcomes:
                return worst
        return cls.COMPLETED

    @property
    def exit_code(self) -> int:
        return {
            TaskOutcome.COMPLETED: EXIT_OK,
            TaskOutcome.STOPPED: EXIT_STOPPED,
            TaskOutcome.REQUEUE: EXIT_REQUEUE,
            TaskOutcome.FAILED: EXIT_FAILED,
        }[self]

    @property
    def state(self) -> TaskState:
        """The manifest state this outcome leaves (a requeued task is interrupted until it runs again)."""
        return {TaskOutcome.COMPLETED: TaskState.COMPLETED, TaskOutcome.FAILED: TaskState.FAILED}.get(
            self, TaskState.INTERRUPTED
        )


def lost_weights(paths: TaskPaths) -> Path | None:
    """The final adapter (or whole model) a task's result.json names, when it is not whole in the task's folder
    any more (deleted since the task finished): resume= trains the task again. None when it is there, or when
    the result names none (a diverged, pruned or not-needed task saves no final weights)."""
    try:
        result = json.loads(paths.result.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict):
        return None
    if result.get("adapter") and not all((paths.adapter / f).is_file() for f in ADAPTER_FILES):
        return paths.adapter
    model = Path(str(result.get("model") or ""))
    if (model.name, model.parent.name) == (paths.full_model.name, paths.name):  # not a base's cache entry
        if not (paths.full_model / "config.json").is_file():
            return paths.full_model
    return None


def finished(paths: TaskPaths) -> bool:
    """The task's work is done and kept: its result.json (written last) with the weights it names. It stands
    whatever the task's process did after writing it (a stop signal during its exit: docs/troubleshooting.md)."""
    return paths.result.is_file() and lost_weights(paths) is None
