"""The scheduler's view of a run's tasks, whatever ran them: the words status, --wait, resume= and the report use
(shared by every backend, plus the ended states each declares: Backend.failed_states; the local launcher's
manifest states map onto them: LOCAL_STATES), one TaskView per task, and what is added
to a launcher's raw states (log tails of a failed task, a setup line's failure, progress from the task's files).

Each launcher says where its states come from (Launcher.task_states, launch/base.py): the local launcher from
the manifest it keeps, a queue's from its scheduler (the Slurm backend's: squeue and sacct). `describe` and
`poll` are the same for every launcher.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from slurm_router.errors import SchedulerUnavailable, UserError
from slurm_router.rundir.lifecycle import TaskState
from slurm_router.rundir.manifest import Manifest
from slurm_router.rundir.progress import TaskProgress, read_progress, setup_failure

# The words every backend's states are said in (a backend maps its scheduler's onto them, or declares its own
# ended ones: Backend.failed_states). CACHED is the run's: a task whose result an earlier run already produced
# (nothing submitted).
SUCCESS_STATES = frozenset({"COMPLETED", "CACHED"})
# INTERRUPTED is the run's too: a task stopped (Ctrl-C, kill, its launcher gone) that resume= continues; the run
# list says the same word of its run (one word per state)
STOPPED_STATES = frozenset({"INTERRUPTED"})
SHARED_FAILED = frozenset({"FAILED", "TIMEOUT", "CANCELLED"})


class BackendWords:
    """A set of state words: the shared ones plus what every registered backend declares under `attr` (read through
    the registry when asked, so a backend loaded later, a test's stub, counts too)."""

    def __init__(self, shared: frozenset[str], attr: str):
        self.shared, self.attr = shared, attr

    def words(self) -> frozenset[str]:
        from slurm_router.scheduler.registry import backends

        return self.shared.union(*(getattr(b, self.attr) for b in backends().values()))

    def __contains__(self, word: object) -> bool:
        return word in self.shared or word in self.words()

    def __iter__(self):
        return iter(sorted(self.words()))


FAILED_STATES = BackendWords(SHARED_FAILED, "failed_states")
TERMINAL_STATES = BackendWords(SUCCESS_STATES | SHARED_FAILED | STOPPED_STATES, "failed_states")
# The manifest's task states (slurm_router.rundir.lifecycle.TaskState) in these words, for runs no scheduler ran.
LOCAL_STATES = {s.value: s.status_word for s in TaskState}


@dataclass
class SchedulerRow:
    state: str
    elapsed_s: int | None = None
    requeues: int = 0
    exit_code: str | None = None
    node: str | None = None
    reason: str | None = None
    foreign: str | None = None  # this row's job only shares the task's id (backends/slurm/parse.py, not_ours): which


@dataclass(kw_only=True)
class TaskView(SchedulerRow):
    """The scheduler's view of one task of a run: what its scheduler (or the local launcher) says of it, plus where it sits
    in the run. Not the manifest's lifecycle state (rundir/lifecycle.py TaskState) nor how its process ended
    (TaskOutcome)."""

    stage: str
    variant: str
    job_id: str  # the task's job id (a Slurm array task's: 123_4; a plain job's: 123)
    log_path: str | None = None
    err_path: str | None = None
    out_tail: list[str] = field(default_factory=list)
    err_tail: list[str] = field(default_factory=list)
    progress: TaskProgress = field(
        default_factory=TaskProgress
    )  # from the task's own files (backends.slurm.queries.attach_progress)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES or never_runs(self)

    @property
    def blocked(self) -> bool:
        """It never ran, and never will, because a stage it waits on failed (blame_failed_stages says which)."""
        return (self.reason or "").startswith(_never_reasons())


def _never_reasons() -> tuple[str, ...]:
    from slurm_router.scheduler.registry import backends

    return tuple(r for b in backends().values() for r in b.never_runs_reasons)


def never_runs_why(reason: str | None) -> str:
    """What follows a never-runs reason ("<reason>: stage base failed (r8)" -> "stage base failed (r8)"), else ''."""
    for word in _never_reasons():
        if (reason or "").startswith(f"{word}: "):
            return (reason or "")[len(word) + 2 :]
    return ""


def never_runs(row: SchedulerRow) -> bool:
    """PENDING for a reason its scheduler gives a job it will never start (Backend.never_runs_reasons: a dependency
    that can never be satisfied); only a cancel ends it."""
    return row.state == "PENDING" and (row.reason or "").startswith(_never_reasons())


def normalize_state(raw: str) -> str:
    """'CANCELLED by 0' -> 'CANCELLED'; 'COMPLETED+' -> 'COMPLETED'; '' -> 'UNKNOWN'."""
    word = raw.strip().split(" ")[0].rstrip("+") if raw.strip() else ""
    return word.upper() or "UNKNOWN"


def format_duration(seconds: float | None) -> str:
    """H:MM:SS; the local launcher records elapsed_s as a float, Slurm as whole seconds."""
    if seconds is None:
        return "-"
    h, rem = divmod(int(round(seconds)), 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"


def local_word(state) -> str:
    """A manifest state in status's words (TaskState.status_word); anything else upper-cased (normalize_state)."""
    return LOCAL_STATES.get(str(state).lower(), normalize_state(str(state or "")))


def local_status(manifest: dict) -> list[TaskView]:
    """Tasks of a local run: the states the local launcher recorded in manifest['tasks']."""
    tasks = manifest.get("tasks") or {}
    items = tasks.items() if isinstance(tasks, dict) else ((t.get("variant", str(i)), t) for i, t in enumerate(tasks))
    out = []
    for name, info in items:
        info = info if isinstance(info, dict) else {"state": info}
        out.append(
            TaskView(
                stage=str(info.get("stage", "")),
                variant=str(name),  # the task's name (r8, or r8-s1 with seeds): one row per task
                job_id=str(info.get("job_id") or info.get("pid") or "-"),
                state=local_word(info.get("state")),
                elapsed_s=info.get("elapsed_s"),
                requeues=int(info.get("requeues", info.get("attempt", 0)) or 0),
                exit_code=None if info.get("exit_code") is None else str(info.get("exit_code")),
                log_path=info.get("log_path"),
                err_path=info.get("err_path"),
            )
        )
    return out


TAIL_LINES = 20
UNKNOWN_GRACE_S = 600.0  # a wait gives up on a task its scheduler has had no record of for this long


def tail(path: str | None, n: int = TAIL_LINES) -> list[str]:
    if not path:
        return []
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in f.readlines()[-n:]]
    except OSError:
        return []


def attach_progress(manifest: dict, tasks: list[TaskView]) -> None:
    """Each task's progress from its folder (rundir.progress: the newest rows, read from the end of its events);
    requeues counted from its starts too (attempts.json: a requeue Slurm forgot, a resume); a retry
    (launcher.max_failures) said in its reason."""
    infos = manifest.get("tasks") or {}
    for t in tasks:
        task_dir = (infos.get(t.variant) or {}).get("task_dir") if isinstance(infos, dict) else None
        if not task_dir:
            continue
        t.progress = read_progress(task_dir, running=t.state == "RUNNING")
        t.requeues = max(t.requeues, t.progress.attempts - 1)
        note = t.progress.retry_note
        if note and note not in (t.reason or ""):
            t.reason = f"{t.reason}; {note}" if t.reason else note


def local_tasks(manifest: dict) -> list[TaskView]:
    """A local run's tasks as its manifest records them now (read again: a --wait sees them move). Only a
    running launcher moves them: if it is gone (its pid and start time: rundir.lock.owner_alive), or the run has
    ended (interrupted, failed), an unfinished task cannot progress and is shown so (terminal: --wait
    returns); resume= continues it."""
    from slurm_router.rundir.lock import owner_alive

    try:
        manifest = Manifest.load(manifest["run_dir"]).data if manifest.get("run_dir") else manifest
    except UserError:  # moved, or gone since: what the caller read is all there is
        pass
    tasks = local_status(manifest)
    infos = manifest.get("tasks") or {}
    infos = list(infos.values()) if isinstance(infos, dict) else list(infos)
    run_state, owner = manifest.get("state", "running"), manifest.get("owner") or {}
    word = "INTERRUPTED"  # the run's word for it (cli/run_list.py): resume= continues these tasks
    if run_state != "running":
        stuck = f"not run: the run is {run_state}"
        word = "INTERRUPTED" if run_state == "interrupted" else "CANCELLED"
    elif owner_alive(owner) is False:
        stuck = f"interrupted: launcher pid {owner.get('pid')} gone"
    else:
        stuck = None
    for t, info in zip(tasks, infos):
        note = info.get("note") if isinstance(info, dict) else None
        if stuck and not t.terminal:
            t.state, note = word, stuck
        t.reason = t.reason or note
    return tasks


def describe(manifest: dict, tasks: list[TaskView]) -> list[TaskView]:
    """A launcher's raw states, made what a user reads: the log tails of a failed task, a failed setup line named
    as the reason, each task's progress from its own files."""
    for t in tasks:
        if t.state in FAILED_STATES:
            t.out_tail, t.err_tail = tail(t.log_path), tail(t.err_path)
        setup = setup_failure(manifest.get("run_dir"), t.job_id) if t.state == "FAILED" else None
        if setup:  # the job ended in launcher.setup: the task itself never started
            t.reason = f"setup failed: {setup}"
    attach_progress(manifest, tasks)
    return tasks


# While the scheduler is slow, a poll waits this many times as long as its query took (a controller that takes
# 3 s to answer is asked every 30 s at most), up to SLOWEST_POLL_S: a query that waited out a controller's restart
# (its retries, backends/slurm/commands.py) must not keep the wait from seeing the run end for long.
SLOW_FACTOR, SLOWEST_POLL_S = 10.0, 60.0


def poll(
    collect: Callable[[], list[TaskView]],
    poll_s: float = 5.0,
    timeout_s: float | None = None,
    on_poll: Callable[[list[TaskView]], None] | None = None,
    unknown_grace_s: float = UNKNOWN_GRACE_S,
    min_s: float = 0.0,
) -> list[TaskView]:
    """Poll `collect` until every task is terminal (or timeout_s passes); returns the last statuses. A task its
    scheduler has had no record of for unknown_grace_s (and whose run dir says nothing) counts as ended, as
    UNKNOWN: a wait must not outlive a job the scheduler has forgotten (Slurm without accounting).
    The interval is never under min_s (the scheduler's floor), and grows while the scheduler is slow; a scheduler
    that does not answer (SchedulerUnavailable) is said in one line and asked again: its jobs run on without it."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    unknown_since: dict[str, float] = {}
    tasks: list[TaskView] = []
    while True:
        asked = time.monotonic()
        try:
            tasks = collect()
        except SchedulerUnavailable as e:
            wait = poll_interval(poll_s, min_s, 0.0)  # its retries have waited already
            print(f"[{time.strftime('%H:%M:%S')}] {e.what}: asking again in {wait:.0f} s", file=sys.stderr, flush=True)
            if deadline is not None and time.monotonic() >= deadline:
                return tasks
            time.sleep(wait)
            continue
        now = time.monotonic()
        for t in tasks:
            if t.state in ("UNKNOWN", "PREEMPTED"):
                unknown_since.setdefault(t.job_id, now)
            else:
                unknown_since.pop(t.job_id, None)
        if on_poll:
            on_poll(tasks)
        lost = {j for j, since in unknown_since.items() if now - since >= unknown_grace_s}
        if all(t.terminal or t.job_id in lost for t in tasks) or (deadline is not None and now >= deadline):
            for t in tasks:
                if t.job_id in lost and t.state == "PREEMPTED":
                    t.reason = f"preempted and not requeued for {unknown_grace_s:.0f} s: resume= submits it again"
                elif t.job_id in lost:
                    t.reason = f"no record in the scheduler or the run dir for {unknown_grace_s:.0f} s"
            return tasks
        time.sleep(poll_interval(poll_s, min_s, now - asked))


def poll_interval(poll_s: float, min_s: float, asked_s: float) -> float:
    """The wait before the next poll; a scheduler's floor (min_s > 0) also makes it grow while the scheduler is slow
    (a local run's polls read files: their time says nothing of a scheduler)."""
    slow = SLOW_FACTOR * asked_s if min_s > 0 else 0.0
    return min(SLOWEST_POLL_S, max(poll_s, min_s, slow))
