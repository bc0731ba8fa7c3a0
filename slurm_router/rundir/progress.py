"""A task's progress from its own files, cheap enough for every poll of `python -m slurm_router.status`: the
newest step and eval rows of rank 0's events (rank 0's step row is the task's global view), the task's total
steps (task.json) and what attempts.json keeps of its starts and retries (requeue.py, retry.py).

The rows are found from the end of the file: EventWriter starts every row with `{"event":"KIND"`, so an mmap
rfind of that opening finds the newest rows of a kind without reading (or parsing) the rest. A 100 MB events
file costs what its last rows cost; a kind that is far back (the first evaluation, with train.eval_every=0)
costs one scan in C, no JSON.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

from slurm_router.rundir.attempts import load_attempts
from slurm_router.rundir.events import EVENT, EndRow, EvalRow, StepRow
from slurm_router.rundir.layout import RunLayout, TaskPaths
from slurm_router.rundir.throughput import tokens_per_s

RECENT_STEPS = 10  # the pace and the ETA: over this many of the newest steps (of the current attempt)


def last_rows(path: str | os.PathLike, kind: str, n: int | None = 1) -> list[dict]:
    """The newest n rows of one kind in an events file (n=None: all of them), newest first; [] if there are none
    (or no file). A row being written (no newline yet) is not one."""
    needle = json.dumps({EVENT: kind}, separators=(",", ":"))[:-1].encode()  # {"event":"step"
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return []
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                out: list[dict]
                out, end = [], len(m)
                while n is None or len(out) < n:
                    start = m.rfind(needle, 0, end)
                    if start < 0:
                        break
                    stop = m.find(b"\n", start)
                    if (start == 0 or m[start - 1] == ord("\n")) and stop >= 0:
                        try:
                            out.append(json.loads(m[start:stop]))
                        except ValueError:
                            pass  # a damaged line: the readers skip it too
                    end = start
                return out
    except (OSError, ValueError):
        return []


@dataclass
class TaskProgress:
    """Where a task is. None: not known (no step yet, no evaluation yet, not running)."""

    step: int | None = None  # steps done: the newest step row's step + 1
    steps: int | None = None  # the task's total (task.json)
    train_loss: float | None = None  # the newest step's global, token-weighted loss
    val_loss: float | None = None  # the newest held-out loss
    val_step: int | None = None  # ... at this step
    tokens_per_s: float | None = None  # the report's figure, one definition: rundir/throughput.py
    pace_tokens_per_s: float | None = None  # another figure: the wall time of the newest RECENT_STEPS steps
    eta_s: float | None = None  # running tasks: the remaining steps at that pace
    attempts: int = 0  # starts of the task (attempts.json): requeues and resumes are attempts - 1
    retries: list = field(default_factory=list)  # launcher.max_failures records (retry.py), oldest first
    ended_as: str | None = None  # 'pruned at step 4' or 'not needed': ended early by the run's decision, exit 0

    @property
    def retry_note(self) -> str | None:
        """'retried after SIGKILL of worker rank 0 on node n1 (1/2)': the newest retry record's own words."""
        return self.retries[-1].get("detail") if self.retries and isinstance(self.retries[-1], dict) else None


def pace(rows: list[dict], steps: int | None) -> tuple[float | None, float | None]:
    """(pace in tokens/s, ETA in s) from the newest step rows (newest first) of one attempt. The wall time between
    rows includes evaluations and checkpoints, so the pace and the ETA do too (tokens/s, rundir/throughput.py, does
    not: it is another figure); one row alone: its own step time."""
    if not rows:
        return None, None
    newest = rows[0]
    rows = [r for r in rows if r.get("attempt") == newest.get("attempt")]
    if len(rows) >= 2 and newest["time"] > rows[-1]["time"]:
        span = newest["time"] - rows[-1]["time"]
        per_step, tokens = span / (len(rows) - 1), sum(int(r.get("n_tokens") or 0) for r in rows[:-1]) / span
    elif newest.get("t_step_s"):
        per_step = float(newest["t_step_s"])
        tokens = int(newest.get("n_tokens") or 0) / per_step
    else:
        return None, None
    left = None if steps is None else max(0, steps - (int(newest["step"]) + 1))
    return tokens, None if left is None else left * per_step


def read_progress(task_dir: str | os.PathLike, running: bool, all_steps: bool = True) -> TaskProgress:
    """A task's progress from its folder; the ETA only while it runs. tokens/s reads every step row of rank 0
    (all_steps=False: not, for a live display that polls often and shows the pace)."""
    paths = TaskPaths(Path(task_dir))
    out = TaskProgress()
    try:
        out.steps = int(json.loads(paths.task_file.read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    attempts = load_attempts(paths.dir)
    out.attempts = int(attempts.get("attempts", 0) or 0)
    out.retries = list(attempts.get("failures") or [])
    events = paths.events(0)
    recent = last_rows(events, StepRow.KIND, RECENT_STEPS)
    if recent:
        out.step, out.train_loss = int(recent[0]["step"]) + 1, recent[0].get("loss")
        tokens, eta = pace(recent, out.steps)
        out.pace_tokens_per_s = None if tokens is None else round(tokens, 1)
        out.eta_s = None if eta is None or not running else round(eta, 1)
        if all_steps:
            out.tokens_per_s = tokens_per_s(reversed(last_rows(events, StepRow.KIND, None)))
    evals = last_rows(events, EvalRow.KIND)
    if evals:
        out.val_loss, out.val_step = evals[0].get("val_loss"), evals[0].get("step")
    out.ended_as = ended_as(last_rows(events, EndRow.KIND))
    return out


def ended_as(end: list[dict]) -> str | None:
    """How the newest attempt's end row says the run's decision ended the task: 'pruned at step 4' (prune=true),
    'not needed' (a seeds=auto reserve that never ran; 'not needed (stopped at step 7)' when its contest was decided
    while it ran); None for any other end, or none yet."""
    state = end[0].get("exit_state") if end else None
    if state == "pruned":
        return f"pruned at step {end[0].get('step')}"
    if state == "not_needed":  # a reserve stopped once its contest was decided has a step
        return f"not needed (stopped at step {end[0]['step']})" if end[0].get("step") else "not needed"
    return None


def decided_state(ended: str | None) -> str | None:
    """The word for a task that exited 0 because the run's decision ended it (ended_as): PRUNED, STOPPED (a
    seeds=auto reserve stopped once its contest was decided) or NOT_NEEDED (a reserve that never ran); None for a
    task that trained to its end. Four different things wherever a state is shown, none of them COMPLETED."""
    if not ended:
        return None
    if ended.startswith("pruned"):
        return "PRUNED"
    return "STOPPED" if "stopped at step" in ended else "NOT_NEEDED"


def task_ended_as(task_dir: str | os.PathLike) -> str | None:
    """ended_as of a task's folder (its rank 0's newest end row)."""
    return ended_as(last_rows(TaskPaths(Path(task_dir)).events(0), EndRow.KIND))


def setup_failure(run_dir: str | Path | None, job_id: str | None) -> str | None:
    """What RUN_DIR/logs/setup-failed.<job id> says (`launcher.setup line 1 (exit 3) failed with exit code 3`), or
    None: the job's setup passed, or has not run."""
    if not run_dir or not job_id:
        return None
    try:
        text = RunLayout(run_dir).setup_failed(str(job_id)).read_text(errors="replace").strip()
    except OSError:
        return None
    return text.splitlines()[0] if text else None
