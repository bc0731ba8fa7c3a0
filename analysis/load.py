"""Read a run directory into pandas: the manifest, and every task's events, cleaned for analysis.

Cleaning rules (the report's figures depend on them):
- rows of a requeued task may repeat a step (the `attempt` field increases): per (step, device) only the
  last attempt's rows are kept, so no step is counted twice;
- rank 0's step row is the global view of a step (loss, busy_s_all, planned_cost); every device's own step
  row carries its t_sync_wait_s, oom_retries and memory peak;
- an events file that holds no event, or a line that is not an event (anywhere but a torn last line), is an
  error the user must act on: ReportError, one line.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from slurm_router.layout import RunLayout, TaskPaths
from slurm_router.events import (EVENT, EndRow, EvalRow, MicroRow, Row, StartRow, StepRow, fields_of,
                                  read_events)

# Fields the report cannot do without, per event kind (anything else is optional); names checked against the
# schema (slurm_router/events.py) when this module loads.
REQUIRED = {
    StepRow.KIND: fields_of(StepRow, "step", "device", "loss", "n_tokens", "t_step_s", "busy_s_all"),
    MicroRow.KIND: fields_of(MicroRow, "step", "device", "n_tokens", "n_pad_tokens"),
    EvalRow.KIND: fields_of(EvalRow, "step", "device", "val_loss"),
}


class ReportError(Exception):
    """The run dir cannot be reported on (missing manifest, garbage events): one line for the user."""


@dataclass
class Task:
    """One task of a run (one variant, or the base stage), with its events cleaned."""
    name: str
    meta: dict                      # the manifest's entry for this task
    files: list[Path] = field(default_factory=list)
    events: pd.DataFrame = field(default_factory=pd.DataFrame)   # every row, as written
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)    # rank 0, one row per step, last attempt
    dev_steps: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per (step, device), last attempt
    micro: pd.DataFrame = field(default_factory=pd.DataFrame)    # micro rows of the kept attempts
    evals: pd.DataFrame = field(default_factory=pd.DataFrame)    # rank 0, one row per eval step
    start: dict | None = None       # rank 0's start row of the last attempt
    ended: bool = False             # an `end` row of the last attempt exists

    @property
    def stage(self) -> str:
        return str(self.meta.get("stage", ""))

    @property
    def has_events(self) -> bool:
        return not self.events.empty

    @property
    def attempts(self) -> int:
        return int(self.events["attempt"].max()) + 1 if self.has_events else 0

    @property
    def n_devices(self) -> int | None:
        if len(self.steps):
            return len(self.steps["busy_s_all"].iloc[0])
        if self.start and self.start.get("world"):
            return int(self.start["world"])
        devices = self.meta.get("devices")
        return len(devices) if isinstance(devices, list) else devices

    @property
    def expected_steps(self) -> int | None:
        return int(self.start["steps"]) if self.start and self.start.get("steps") is not None else None


def load_manifest(run_dir: Path) -> dict:
    path = RunLayout(run_dir).manifest
    if not path.is_file():
        raise ReportError(f"{run_dir} has no manifest.json: give a run directory made by python -m slurm_router")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ReportError(f"{path} is not valid JSON: the run directory is damaged") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("tasks", {}), dict):
        raise ReportError(f"{path} is not a slurm_router manifest (no 'tasks' mapping)")
    return manifest


def read_rows(path: Path) -> list[dict]:
    """Every event row of one file; ReportError (one line) for an empty or damaged file."""
    try:
        rows = list(read_events(path))
    except (ValueError, OSError) as e:
        raise ReportError(f"{e}: the events file is damaged; remove it to report on the rest") from None
    if not rows:
        raise ReportError(f"{path}: no complete event row (an empty file, or one torn line); remove it to report "
                          "on the rest")
    return rows


def _check(df: pd.DataFrame, path_hint: str) -> None:
    for kind, fields in REQUIRED.items():
        rows = df[df[EVENT] == kind]
        if rows.empty:
            continue
        missing = [f for f in fields if f not in rows or rows[f].isna().any()]
        if missing:
            raise ReportError(f"{path_hint}: '{kind}' rows without {', '.join(missing)}: not events written by "
                              "slurm_router; remove the file to report on the rest")
        numeric = [f for f in fields if f != "busy_s_all" and not pd.api.types.is_numeric_dtype(rows[f])]
        if numeric or (kind == StepRow.KIND and not rows["busy_s_all"].map(_number_list).all()):
            raise ReportError(f"{path_hint}: '{kind}' rows with non-numeric {', '.join(numeric) or 'busy_s_all'}"
                              ": the events are damaged")


def of_kind(df: pd.DataFrame, kind: type[Row], device: int | None = None) -> pd.DataFrame:
    """The rows of one event kind (of one device), as written."""
    if df.empty or EVENT not in df:
        return df
    keep = df[EVENT] == kind.KIND
    if device is not None:
        keep &= df["device"] == device
    return df[keep]


def _last_attempt(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """One row per key: the last attempt's (then the last written)."""
    return df.sort_values(["attempt", "time"], kind="stable").drop_duplicates(keys, keep="last")


def load_task(run_dir: Path, name: str, meta: dict) -> Task:
    task_dir = RunLayout(run_dir).task(name).dir
    if meta.get("task_dir") and not task_dir.is_dir():
        task_dir = Path(meta["task_dir"])
    task = Task(name, meta, files=TaskPaths(task_dir).events_files())
    frames = []
    for path in task.files:
        df = pd.DataFrame(read_rows(path))
        _check(df, str(path))
        frames.append(df)
    if not frames:
        return task
    ev = pd.concat(frames, ignore_index=True)
    for col, default in (("attempt", 0), ("device", 0), ("time", 0.0)):
        ev[col] = pd.to_numeric(ev[col], errors="coerce").fillna(default) if col in ev else default
    ev["attempt"] = ev["attempt"].astype(int)
    task.events = ev
    rank0 = int(ev["device"].min())
    steps = of_kind(ev, StepRow)
    if len(steps):
        task.dev_steps = _last_attempt(steps, ["step", "device"]).sort_values(["step", "device"])
        task.steps = task.dev_steps[task.dev_steps["device"] == rank0].reset_index(drop=True)
    micro = of_kind(ev, MicroRow)
    if len(micro):
        last = micro.groupby(["step", "device"])["attempt"].transform("max")
        task.micro = micro[micro["attempt"] == last].sort_values(["step", "device", "time"]).reset_index(drop=True)
    evals = of_kind(ev, EvalRow, device=rank0)
    if len(evals):
        task.evals = _last_attempt(evals, ["step"]).sort_values("step").reset_index(drop=True)
    last_attempt = ev[ev["attempt"] == ev["attempt"].max()]
    starts = of_kind(last_attempt, StartRow, device=rank0)
    if len(starts):
        task.start = {k: v for k, v in starts.iloc[-1].items() if not _isna(v)}
    task.ended = bool((last_attempt[EVENT] == EndRow.KIND).any())
    return task


def load_run(run_dir: Path) -> tuple[dict, list[Task]]:
    manifest = load_manifest(run_dir)
    return manifest, [load_task(run_dir, name, meta if isinstance(meta, dict) else {"state": meta})
                      for name, meta in manifest.get("tasks", {}).items()]


def _number_list(v) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(x, (int, float)) for x in v)


def _isna(v) -> bool:
    return not isinstance(v, (list, dict)) and pd.isna(v)


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write beside `path`, then rename: a reader (or a report regenerated concurrently) never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
