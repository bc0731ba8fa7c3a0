"""Live progress of a local run's tasks, read from their rank-0 event files (rundir.progress, the one reader).

On a terminal: a rich progress bar per task (step, loss, pace: tokens/s over the newest steps' wall time).
Elsewhere (CI, a log file): one plain line per task every 10% of its steps, so a captured log still shows the run
moving.
"""

from __future__ import annotations

import sys
from pathlib import Path

from slurm_router.rundir.lifecycle import TaskState
from slurm_router.rundir.progress import Progress as TaskProgress
from slurm_router.rundir.progress import read_progress
from slurm_router.rundir.spec import TaskSpec


class Progress:
    """The local launcher's view of its running tasks; what it shows comes from rundir.progress.read_progress,
    the one reader of a task's progress (the same numbers `python -m slurm_router.status` prints)."""

    def __init__(self, tasks: list[TaskSpec]):
        # a fused task's variants each show their own progress (their own events); the launcher knows the leader
        self.members = {t.name: t.members for t in tasks}
        self.tasks = {s.name: s for t in tasks for s in (t.group_specs() if t.members else [t])}
        self.state: dict[str, dict] = {n: {"progress": TaskProgress(), "printed": -1} for n in self.tasks}
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

    def _info(self, name: str) -> str:
        p = self.state[name]["progress"]
        if p.train_loss is None:
            return "starting" if p.val_loss is None else f"val {p.val_loss:.3f}"
        rate = f"  pace {p.pace_tokens_per_s:,.0f} tok/s" if p.pace_tokens_per_s else ""
        return f"loss {p.train_loss:.3f}{rate}"

    def _show(self, name: str) -> None:
        st, total = self.state[name], self.tasks[name].steps
        step = st["progress"].step or 0
        if self._rich is not None:
            self._rich.update(self._ids[name], completed=step, info=self._info(name))
            return
        decile = step * 10 // max(1, total)
        if step and decile != st["printed"]:
            st["printed"] = decile
            print(f"  {self.tasks[name].stage}/{name}: step {step}/{total}  {self._info(name)}", flush=True)

    def finish(self, name: str, state: TaskState, log: Path) -> None:
        """A task ended (a fused task: each of its variants, with the group's state)."""
        self.update()
        for each in [name, *self.members.get(name, [])]:
            msg = f"{self.tasks[each].stage}/{each}: {state.value}"
            if state is not TaskState.COMPLETED:
                msg += f" (log: {log})"
            if self._rich is not None:
                self._rich.update(self._ids[each], info=state.value)
                self._rich.console.print(msg)
            else:
                print(msg, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
