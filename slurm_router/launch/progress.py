"""Live progress of running tasks, read from their rank-0 event files (the only channel workers write).

On a terminal: a rich progress bar per task (step, loss, tokens/s). Elsewhere (CI, a log file): one plain
line per task every 10% of its steps, so a captured log still shows the run moving.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from slurm_router.rundir.events import EVENT, EvalRow, StepRow
from slurm_router.rundir.layout import TaskPaths
from slurm_router.rundir.lifecycle import TaskState
from slurm_router.rundir.spec import TaskSpec


class _Tail:
    """Reads complete new lines of a growing file."""

    def __init__(self, path: Path):
        self.path, self.offset, self.buf = path, 0, b""

    def rows(self):
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


class Progress:
    def __init__(self, tasks: list[TaskSpec]):
        self.tasks = {t.name: t for t in tasks}
        self.tails = {t.name: _Tail(TaskPaths(t.task_dir).events(0)) for t in tasks}
        self.state = {t.name: {"step": 0, "loss": None, "tokens": 0, "t0": None, "printed": -1} for t in tasks}
        self.live = sys.stderr.isatty()
        self._rich = None
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress
            self._rich = RichProgress(TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(), transient=False)
            self._ids = {n: self._rich.add_task(f"{t.stage}/{n}", total=t.steps, info="waiting")
                         for n, t in self.tasks.items()}
            self._rich.start()

    def update(self) -> None:
        for name, tail in self.tails.items():
            st = self.state[name]
            for row in tail.rows():
                if row.get(EVENT) == StepRow.KIND:
                    st["step"] = row["step"] + 1
                    st["loss"] = row["loss"]
                    st["tokens"] += row.get("n_tokens", 0)
                    st["t0"] = st["t0"] or row["time"] - row.get("t_step_s", 0)
                    st["t_last"] = row["time"]
                elif row.get(EVENT) == EvalRow.KIND:
                    st["val_loss"] = row["val_loss"]
            self._show(name)

    def _info(self, name: str) -> str:
        st = self.state[name]
        if st["loss"] is None:
            return "starting" if st.get("val_loss") is None else f"val {st['val_loss']:.3f}"
        rate = st["tokens"] / max(1e-9, st["t_last"] - st["t0"])
        return f"loss {st['loss']:.3f}  {rate:,.0f} tok/s"

    def _show(self, name: str) -> None:
        st, total = self.state[name], self.tasks[name].steps
        if self._rich is not None:
            self._rich.update(self._ids[name], completed=st["step"], info=self._info(name))
            return
        decile = st["step"] * 10 // max(1, total)
        if st["step"] and decile != st["printed"]:
            st["printed"] = decile
            print(f"  {self.tasks[name].stage}/{name}: step {st['step']}/{total}  {self._info(name)}", flush=True)

    def finish(self, name: str, state: TaskState, log: Path) -> None:
        self.update()
        msg = f"{self.tasks[name].stage}/{name}: {state.value}"
        if state is not TaskState.COMPLETED:
            msg += f" (log: {log})"
        if self._rich is not None:
            self._rich.update(self._ids[name], info=state.value)
            self._rich.console.print(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
