"""Read a run directory into pandas: the manifest, and every task's events, cleaned for analysis.

Cleaning rules (the report's figures depend on them):
- rows of a requeued task may repeat a step (the `attempt` field increases): per (step, device) only the
  last attempt's rows are kept, so no step is counted twice;
- rank 0's step row is the global view of a step (loss, busy_s_all, planned_cost); every device's own step
  row carries its t_sync_wait_s, oom_retries and memory peak;
- a non-finite loss (NaN, inf: a diverged variant) is a value, not damage: its rows are kept;
- damage (a line that is not an event row, a row without a field the report needs, an events file without
  any row) is left out and named in the task's `problems`, which the report lists under "What is missing":
  the rest of the run is still reported and nothing asks the user to delete data. Only a run dir without a
  readable manifest is a ReportError (one line).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from slurm_router.fileio import WriteError, atomic_write_bytes
from slurm_router.rundir.events import EVENT, EndRow, EvalRow, MicroRow, Row, StartRow, StepRow, fields_of, scan_events
from slurm_router.rundir.layout import RunLayout, TaskPaths
from slurm_router.rundir.manifest import Manifest, NotARunDir

# Fields the report cannot do without, per event kind (anything else is optional); names checked against the
# schema (slurm_router/rundir/events.py) when this module loads.
REQUIRED = {
    StepRow.KIND: fields_of(StepRow, "step", "device", "loss", "n_tokens", "t_step_s", "busy_s_all"),
    MicroRow.KIND: fields_of(MicroRow, "step", "device", "n_tokens", "n_pad_tokens"),
    EvalRow.KIND: fields_of(EvalRow, "step", "device", "val_loss"),
}


class ReportError(Exception):
    """The run dir cannot be reported on (no readable manifest): one line for the user."""


@dataclass
class Task:
    """One task of a run (one variant, or the base stage), with its events cleaned."""

    name: str
    meta: dict  # the manifest's entry for this task
    files: list[Path] = field(default_factory=list)
    events: pd.DataFrame = field(default_factory=pd.DataFrame)  # every row, as written
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)  # rank 0, one row per step, last attempt
    dev_steps: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per (step, device), last attempt
    micro: pd.DataFrame = field(default_factory=pd.DataFrame)  # micro rows of the kept attempts
    evals: pd.DataFrame = field(default_factory=pd.DataFrame)  # rank 0, one row per eval step
    start: dict | None = None  # rank 0's start row of the last attempt
    end: dict | None = None  # rank 0's last `end` row of the last attempt
    ended: bool = False  # an `end` row of the last attempt exists
    problems: list[str] = field(default_factory=list)  # damage left out of the report, in words
    seed: int | None = None  # the training seed of this replicate (manifest, task.json, or the run's seed)

    @property
    def stage(self) -> str:
        return str(self.meta.get("stage", ""))

    @property
    def variant(self) -> str:
        """The variant this task trains (a replicate r8-s1 trains r8); the task's name for older manifests."""
        return str(self.meta.get("variant") or self.name)

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
        if self.start and self.start.get("steps") is not None:
            return int(self.start["steps"])
        if self.not_needed and self.end and self.end.get("steps") is not None:  # a reserve never run: its end row
            return int(self.end["steps"])
        return None

    @property
    def diverged(self) -> dict | None:
        """{step, lr, detail} when the last attempt ended because the loss went non-finite, else None."""
        if not self.end or self.end.get("exit_state") != "diverged":
            return None
        step = self.end.get("step")
        return {
            "step": None if step is None else int(step),
            "lr": (self.start or {}).get("lr"),
            "detail": self.end.get("detail"),
        }

    @property
    def pruned(self) -> dict | None:
        """{step, detail} when prune=true stopped this task at an evaluation (verdict/pruning.py), else None."""
        if not self.end or self.end.get("exit_state") != "pruned":
            return None
        step = self.end.get("step")
        return {
            "step": None if step is None else int(step),
            "detail": self.end.get("detail") or f"{self.name}: pruned at step {step}",
        }

    @property
    def not_needed(self) -> dict | None:
        """{step, detail} when this seeds=auto reserve was not needed (worker/auto_seeds.py): step 0 when it never
        ran, else the step it stopped at once its contest was decided; None for any other task."""
        if not self.end or self.end.get("exit_state") != "not_needed":
            return None
        return {"step": int(self.end.get("step") or 0), "detail": self.end.get("detail") or f"{self.name}: not needed"}


def load_manifest(run_dir: Path) -> dict:
    """The run's manifest through the one validated reader (rundir.manifest.Manifest.load); ReportError, its one
    line, when the folder is not a run directory or the manifest is damaged."""
    try:
        return Manifest.load(run_dir).data
    except NotARunDir as e:
        raise ReportError(str(e)) from None


def read_rows(path: Path, problems: list[str]) -> list[dict]:
    """Every event row of one file. A line that is not an event row (anywhere but a torn last line, which a
    crash leaves and which is skipped silently) is left out and named in `problems`, as is a file without rows."""
    try:
        rows, bad = scan_events(path)
    except OSError as e:
        problems.append(f"{path}: unreadable ({e.strerror or e}): left out")
        return []
    if bad:
        problems.append(f"{path}: {_lines(bad)} not an event row: left out")
    if not rows:
        problems.append(f"{path}: no complete event row (an empty file, or one torn line)")
    return rows


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:3])) + (f" and {len(numbers) - 3} more" if len(numbers) > 3 else "")
    return f"line {shown} is" if len(numbers) == 1 else f"lines {shown} are"


def usable_rows(rows: list[dict], path: Path, problems: list[str]) -> list[dict]:
    """The rows the report can use: a row of a kind in REQUIRED needs each of its fields present and numeric
    (NaN and inf are numbers: a diverged loss is kept); others are left out and named in `problems`."""
    dropped: dict[tuple[str, tuple[str, ...]], list[dict]]
    keep, dropped = [], {}
    for row in rows:
        bad = tuple(f for f in REQUIRED.get(row[EVENT], ()) if not _fits(f, row.get(f)))
        if bad:
            dropped.setdefault((row[EVENT], bad), []).append(row)
        else:
            keep.append(row)
    for (kind, bad), left_out in dropped.items():
        problems.append(
            f"{path}: {len(left_out)} '{kind}' row(s) without a numeric {', '.join(bad)} (damaged, or "
            "not written by slurm_router): left out"
        )
    return keep


def _fits(name: str, value) -> bool:
    if name == "busy_s_all":
        return _number_list(value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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


def load_task(run_dir: Path, name: str, meta: dict, run_seed: int | None = None) -> Task:
    task_dir = RunLayout(run_dir).task(name).dir
    if meta.get("task_dir") and not task_dir.is_dir():
        task_dir = Path(meta["task_dir"])
    paths = TaskPaths(task_dir)
    task = Task(name, meta, files=paths.events_files(), seed=task_seed(meta, paths.task_file, run_seed))
    frames = []
    for path in task.files:
        rows = usable_rows(read_rows(path, task.problems), path, task.problems)
        if rows:
            frames.append(pd.DataFrame(rows))
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
    ends = of_kind(last_attempt, EndRow, device=rank0)
    if len(ends):
        task.end = {k: v for k, v in ends.sort_values("time", kind="stable").iloc[-1].items() if not _isna(v)}
    task.ended = bool((last_attempt[EVENT] == EndRow.KIND).any())
    return task


def load_run(run_dir: Path) -> tuple[dict, list[Task]]:
    manifest = load_manifest(run_dir)
    seed = run_seed(run_dir)
    return manifest, [
        load_task(run_dir, name, meta if isinstance(meta, dict) else {"state": meta}, seed)
        for name, meta in manifest.get("tasks", {}).items()
    ]


def task_seed(meta: dict, task_file: Path, run_seed: int | None) -> int | None:
    """A task's training seed: its manifest entry's `seed`, else its task.json's, else the run's `seed` (runs
    made before seed replicates trained every task with it)."""
    if isinstance(meta.get("seed"), int):
        return meta["seed"]
    try:
        seed = json.loads(task_file.read_text()).get("seed")
    except (OSError, ValueError, AttributeError):
        seed = None
    return seed if isinstance(seed, int) else run_seed


def run_seed(run_dir: Path) -> int | None:
    """The run's `seed` from its config.yaml (None when it is unreadable: the report goes on without it)."""
    import yaml

    try:
        seed = (yaml.safe_load(RunLayout(run_dir).config.read_text()) or {}).get("seed")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return seed if isinstance(seed, int) else None


def _number_list(v) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(x, (int, float)) for x in v)


def _isna(v) -> bool:
    return not isinstance(v, (list, dict)) and pd.isna(v)


def make_dir(path: Path) -> None:
    """mkdir -p, or WriteError (one line naming the path and the cause)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError.of(path, e) from None


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write beside `path`, then rename: a reader (or a report regenerated concurrently) never sees half a file.
    WriteError (one line naming the path and the cause) when the disk refuses."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    atomic_write_bytes(path, lambda f: f.write(raw))
