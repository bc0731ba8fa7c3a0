"""Live progress of a run's tasks, read from their rank-0 event files (rundir.progress, the one reader): the local
launcher's run, and a Slurm run followed with launcher.wait=true (backends/slurm/common.py).

On a terminal: a rich progress bar per task (step of steps, loss, pace: tokens/s over the newest steps' wall time,
ETA at that pace, time elapsed). Elsewhere (CI, a log file, a Slurm job's output): one plain line per task every
10% of its steps, or every PLAIN_EVERY_S while its steps move, so a captured log still shows the run moving.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from slurm_router.analysis.forecast import duration
from slurm_router.rundir.lifecycle import TaskState
from slurm_router.rundir.progress import TaskProgress, decided_state, read_progress, task_ended_as
from slurm_router.rundir.spec import TaskSpec

PLAIN_EVERY_S = 30.0  # plain lines: a task whose steps moved gets a line at least this often


def eta_text(seconds: float | None) -> str:
    """'ETA 42s', 'ETA 3m05s', 'ETA 1h02m' (the forecast's duration); '' when not known."""
    return "" if seconds is None else f"ETA {duration(seconds)}"


class Progress:
    """The local launcher's view of its running tasks; what it shows comes from rundir.progress.read_progress,
    the one reader of a task's progress (the same numbers `python -m slurm_router.status` prints)."""

    def __init__(self, tasks: list[TaskSpec]):
        # a fused task's variants each show their own progress (their own events); the launcher knows the leader
        self.members = {t.name: t.members for t in tasks}
        self.tasks = {s.name: s for t in tasks for s in (t.group_specs() if t.members else [t])}
        self.state: dict[str, dict] = {
            n: {"progress": TaskProgress(), "printed": -1, "step": 0, "at": time.monotonic()} for n in self.tasks
        }
        self.ended: set[str] = set()
        self.run_dir = tasks[0].run_dir if tasks else None
        self.eta_at = time.monotonic()  # the run's ETA (launch/forecast.py): a line every PLAIN_EVERY_S
        self.live = sys.stderr.isatty()
        self._rich = None
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                TextColumn("{task.description:<12}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                transient=False,
            )
            self._ids = {
                n: self._rich.add_task(f"{t.stage}/{n}", total=t.steps, info="waiting") for n, t in self.tasks.items()
            }
            self._rich.start()

    def update(self) -> None:
        for name, task in self.tasks.items():
            self.state[name]["progress"] = read_progress(task.task_dir, running=True, all_steps=False)
            self._show(name)
        if self.run_dir and time.monotonic() - self.eta_at >= PLAIN_EVERY_S:
            self.eta_at = time.monotonic()
            self._run_eta()

    def _run_eta(self) -> None:
        """The run's ETA, from its forecast and these tasks' progress: one line (a live bar's console line)."""
        from types import SimpleNamespace

        from slurm_router.launch.forecast import eta_line

        rows = [
            SimpleNamespace(
                variant=n,
                terminal=n in self.ended,
                elapsed_s=None,
                state="RUNNING" if st["progress"].step else "PENDING",
                progress=st["progress"],
            )
            for n, st in self.state.items()
        ]
        line = eta_line(str(self.run_dir), rows)
        if line and self._rich is not None:
            self._rich.console.print(line)
        elif line:
            print(f"  {line}", flush=True)

    def _info(self, name: str) -> str:
        """'loss 2.345  1,234 tok/s  ETA 1m02s' (the pace and the ETA over the newest steps)."""
        p = self.state[name]["progress"]
        if p.train_loss is None:
            return "starting" if p.val_loss is None else f"val {p.val_loss:.3f}"
        rate = f"  {p.pace_tokens_per_s:,.0f} tok/s" if p.pace_tokens_per_s else ""
        going = p.eta_s is not None and name not in self.ended and (p.step or 0) < self.tasks[name].steps
        eta = f"  {eta_text(p.eta_s)}" if going else ""
        return f"loss {p.train_loss:.3f}{rate}{eta}"

    def _show(self, name: str) -> None:
        st, total = self.state[name], self.tasks[name].steps
        step = st["progress"].step or 0
        if self._rich is not None:
            self._rich.update(self._ids[name], completed=step, info=self._info(name))
            return
        decile = step * 10 // max(1, total)
        due = step > st["step"] and time.monotonic() - st["at"] >= PLAIN_EVERY_S
        if step and (decile != st["printed"] or due):
            st["printed"], st["step"], st["at"] = decile, step, time.monotonic()
            print(f"  {self.tasks[name].stage}/{name}: step {step}/{total}  {self._info(name)}", flush=True)

    def follow(self, statuses: list) -> None:
        """launcher.wait=true's poll (a Slurm run's TaskView rows): every task's bar or line, and one line for
        each task as it ends, in Slurm's word (COMPLETED, FAILED, TIMEOUT...)."""
        self.update()
        for t in statuses:
            if t.terminal and t.variant in self.tasks and t.variant not in self.ended:
                self.finish(t.variant, t.state, Path(t.log_path) if t.log_path else None)

    def finish(self, name: str, state: TaskState | str, log: Path | None) -> None:
        """A task ended (a fused task: each of its variants, with the group's state)."""
        self.update()
        word = state.value if isinstance(state, TaskState) else str(state)
        ok = state is TaskState.COMPLETED or word == "COMPLETED"
        for each in [name, *self.members.get(name, [])]:
            if each in self.ended:
                continue
            self.ended.add(each)
            ended = task_ended_as(self.tasks[each].task_dir) if ok else None  # pruned, stopped, not needed
            decided = decided_state(ended)
            shown = word if not decided else decided.lower().replace("_", " ") if word.islower() else decided
            msg = f"{self.tasks[each].stage}/{each}: {shown}" + (f" ({ended})" if decided and ended != shown else "")
            if not ok and log is not None:
                msg += f" (log: {log})"
            if self._rich is not None:
                self._rich.update(self._ids[each], info=shown)
                self._rich.console.print(msg)
            else:
                print(msg, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()


def note_killed(log: Path, group: list[str], pid: int, code: int, run_dir: Path) -> None:
    """A job process killed from outside (kill -9, the out-of-memory killer) could not say so: its log says it."""
    import signal

    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    try:
        with open(log, "a", encoding="utf-8") as f:
            f.write(
                f"error: the job process of {', '.join(group)} (pid {pid}) was killed by {name}; "
                f"python -m slurm_router resume={run_dir} continues from the newest checkpoint\n"
            )
    except OSError:
        pass  # the launcher's own line on stderr still says it failed
