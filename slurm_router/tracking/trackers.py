"""Experiment trackers (TensorBoard, MLflow, Weights & Biases) fed from the rows rank 0 writes to its events file:
the EventWriter hands each row it has written to a TrackerSink (events.py), so a tracker holds what the report
reads, from one writer (docs/ARCHITECTURE.md). The libraries' own calls are in tracking/loggers.py.

    python -m slurm_router +experiment=lora_ab tracker=tensorboard
    python -m slurm_router +experiment=lora_ab tracker=[mlflow,wandb]     # W&B offline: `wandb sync ...` at the end
    python -m slurm_router.analysis RUN_DIR --to mlflow                   # replay a finished run's events

One tracker run per task, named `<run id>/<task>`; what identifies it (the TensorBoard log dir, the MLflow run
id, the W&B run id) is kept in RUN_DIR/tasks/<task>/tracker.json, so a requeued or resumed task continues the
same tracker run. Each (row kind, step) reaches a tracker once: a step that a resumed task runs again (it ran
after the last checkpoint, before a crash) keeps the value first logged (bitwise the same on CPU; the report
keeps the last); an interruption by a stop signal checkpoints at the step end and re-runs nothing. A crash can
cost W&B the rows of its last second (its offline log is flushed every second); replay rebuilds any tracker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_router.config.secrets import redact_text, reveal
from slurm_router.errors import UserError
from slurm_router.rundir.layout import TRACKER_FILE, TRACKERS_DIR, RunLayout
from slurm_router.tracking.loggers import ENDED_WELL, LOGGERS

KINDS = ("tensorboard", "mlflow", "wandb")
# what each tracker needs installed: the module, and what to pip install (pyproject.toml's `tracking` extra)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard>=2.14"),
    "mlflow": ("mlflow", "mlflow-skinny>=2.10"),
    "wandb": ("wandb", "wandb>=0.19"),
}
PIP_EXTRA = "pip install -e '.[tracking]'"
WANDB_MODES = ("offline", "online")

# The events' fields a tracker gets: row kind -> {field: metric name}. Steps are the rows' own: a step row's
# `step` is the optimizer step (0-based), an eval row's the number of steps done.
METRICS = {
    "step": {
        "loss": "train/loss",
        "lr": "train/lr",
        "t_step_s": "train/step_s",
        "n_tokens": "train/tokens",
        "mem_peak_bytes": "train/mem_peak_bytes",
    },
    "eval": {"val_loss": "eval/loss"},
}


def enabled(tracker: Any) -> list[str]:
    """The trackers a config's `tracker` node turns on, in KINDS order."""
    return [k for k in KINDS if tracker is not None and tracker.get(k)]


def missing_package(kind: str, where: str = "") -> UserError | None:
    module, requirement = PACKAGES[kind]
    if importlib.util.find_spec(module) is not None:
        return None
    return UserError(
        f"{where}tracker={kind} needs the {module} package, which is not installed: "
        f"pip install '{requirement}' (or {PIP_EXTRA} for every tracker)"
    )


def check_tracker(tracker: Any, where: str = "") -> None:
    """tracker=...: each tracker's package is installed, wandb_mode is known, and every store a tracker writes can
    be written: tracker.dir (TensorBoard's logs, W&B's runs, MLflow's default store) and MLflow's own store when
    tracker.mlflow_uri or $MLFLOW_TRACKING_URI names a local one. Raises UserError (one line) before anything is
    written: under Slurm a store found unwritable in the job would be found only after the queue."""
    if tracker is None:
        return
    if tracker.get("wandb_mode") not in (None, *WANDB_MODES):
        raise UserError(
            f"{where}tracker.wandb_mode={tracker.wandb_mode!r} is not valid: choose one of "
            f"{', '.join(WANDB_MODES)} (or leave it unset: $WANDB_MODE, else offline)"
        )
    from slurm_router.config.checks import check_writable_dir

    if enabled(tracker) and tracker.get("dir"):
        check_writable_dir(tracker.dir, f"{where}tracker.dir={tracker.dir!r}")
    if tracker.get("mlflow"):
        setting, uri = mlflow_uri_setting(tracker)
        folder = mlflow_local_folder(uri) if uri else None
        if folder is not None:
            where = where if setting.startswith("tracker.") else ""  # the environment's is the run's
            check_writable_dir(
                folder,
                f"{where}{setting}={redact_text(str(uri))!r}",
                fix=f"set {setting} to a file:// URI (or path) of a folder you can write",
            )
    for kind in enabled(tracker):
        error = missing_package(kind, where)
        if error:
            raise error


def mlflow_uri_setting(tracker: Any) -> tuple[str, str | None]:
    """(where the MLflow store's URI comes from, the URI): tracker.mlflow_uri, else $MLFLOW_TRACKING_URI, else
    None (the file store under tracker.dir, checked with it), the order Target.of resolves them in."""
    if tracker.get("mlflow_uri"):
        return "tracker.mlflow_uri", str(tracker.get("mlflow_uri"))
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return "MLFLOW_TRACKING_URI", os.environ["MLFLOW_TRACKING_URI"]
    return "tracker.mlflow_uri", None


def mlflow_local_folder(uri: str) -> Path | None:
    """The local folder an MLflow tracking URI writes in: a file: URI's or a plain path's folder, a sqlite
    database's parent; None for a server (http, databricks, ...: only reaching it would tell)."""
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(url2pathname(parsed.path))
    if parsed.scheme == "sqlite":  # sqlite:///relative.db, sqlite:////absolute.db
        path = uri.split(":///", 1)[1] if ":///" in uri else ""
        return Path(path).parent if path and path != ":memory:" else None
    if not parsed.scheme and "://" not in uri:  # a plain path is a file store
        return Path(uri)
    return None


# ---- where a task's trackers write ------------------------------------------------------------------------------
@dataclass
class Target:
    """One task's tracker settings, resolved: the config's `tracker` node, the environment, the run dir."""

    kinds: list[str]
    run_id: str
    task: str
    experiment: str
    dir: Path
    mlflow_uri: str
    mlflow_experiment: str
    wandb_project: str
    wandb_entity: str | None
    wandb_mode: str
    tags: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    run_dir: str = "RUN_DIR"  # where the run is (for the replay command a warning names)
    shown: dict = field(default_factory=dict)  # a revealed secret -> how it is shown (config/secrets.py)

    @classmethod
    def of(cls, spec, kinds: list[str] | None = None, run_dir: str | os.PathLike | None = None) -> "Target":
        """spec: a rundir.spec.TaskSpec (its config is the task's resolved config); kinds: the config's, unless given;
        run_dir: where the run is now (a replay of a run dir that was moved), else where it was made."""
        # the real credentials from RUN_DIR/secrets.json (spec.config shows them as ***: config/secrets.py)
        revealed, shown = reveal(spec.config, RunLayout(run_dir or spec.run_dir).secrets, spec.name)
        tracker = dict(revealed.get("tracker") or {})
        d = Path(os.path.expanduser(tracker.get("dir") or Path(run_dir or spec.run_dir) / TRACKERS_DIR)).absolute()
        uri = tracker.get("mlflow_uri") or os.environ.get("MLFLOW_TRACKING_URI") or (d / "mlruns").as_uri()
        return cls(
            kinds=list(kinds if kinds is not None else [k for k in KINDS if tracker.get(k)]),
            run_id=spec.run_id,
            task=spec.name,
            experiment=spec.experiment,
            dir=d,
            mlflow_uri=uri,
            mlflow_experiment=tracker.get("mlflow_experiment") or spec.experiment,
            wandb_project=tracker.get("wandb_project") or os.environ.get("WANDB_PROJECT") or spec.experiment,
            wandb_entity=tracker.get("wandb_entity"),
            wandb_mode=tracker.get("wandb_mode") or os.environ.get("WANDB_MODE") or "offline",
            tags={
                "run_id": spec.run_id,
                "task": spec.name,
                "variant": spec.variant,
                "stage": spec.stage,
                "seed": spec.seed,
            },
            config={k: v for k, v in spec.config.items() if k != "variants"},  # the task's own, as shown
            run_dir=str(run_dir or spec.run_dir),
            shown=shown,
        )

    def show(self, value: str) -> str:
        """A value as it may be written (tracker.json, a warning): its secrets as ***."""
        return self.shown.get(value) or redact_text(value)

    def real(self, written: str) -> str:
        """The MLflow URI tracker.json names (written by show) as the job must use it."""
        return self.mlflow_uri if written == self.show(self.mlflow_uri) else written

    @property
    def name(self) -> str:
        """The tracker run's name: `<run id>/<task>`."""
        return f"{self.run_id}/{self.task}"

    @property
    def tensorboard_dir(self) -> Path:
        return self.dir / "tensorboard" / self.run_id / self.task


# ---- the sink the EventWriter feeds ---------------------------------------------------------------------------
class TrackerSink:
    """A task's open trackers. log(row) for every row written (only step and eval rows are logged, each (kind,
    step) once: `earlier` are the rows earlier attempts wrote, whose trackers have them); close() when the events
    file closes. A tracker that fails mid-run is dropped with one warning: the events file keeps every row (replay
    later with `python -m slurm_router.analysis RUN_DIR --to KIND`)."""

    def __init__(self, loggers: list, earlier: list | None = None, replay: bool = False):
        self.loggers, self.replay = loggers, replay
        self.seen = {(row.KIND, row.step) for row in earlier or ()}
        self.state: str | None = None
        self.logged = {"step": 0, "eval": 0}
        trailing = [r for r in earlier or () if r.KIND == "eval" and ("step", r.step) not in self.seen]
        if trailing:  # the last attempt stopped after an evaluation, before the step that follows it
            last = max(trailing, key=lambda r: r.step)
            for logger in loggers:
                logger.carry(metrics_of(last), last.step)

    def log(self, row) -> None:
        if row.KIND not in METRICS:
            if row.KIND == "end":
                self.state = row.exit_state
            return
        if (row.KIND, row.step) in self.seen:
            return
        self.seen.add((row.KIND, row.step))
        for logger in list(self.loggers):
            try:
                logger.log(metrics_of(row), row.step, row.time, row.KIND)
            except Exception as e:  # a tracker's trouble never stops training
                self.loggers.remove(logger)
                print(
                    f"warning: tracker {logger.kind}: logging failed at the {row.KIND} row of step {row.step} "
                    f"({one_line(e)}); dropped, training goes on; it gets no more rows this attempt; the events "
                    f"file has them all",
                    file=sys.stderr,
                    flush=True,
                )
        self.logged[row.KIND] += 1

    def close(self) -> None:
        """The end of an attempt (a replay's rows are all the run has: its last eval is the last)."""
        last = self.replay or self.state in ENDED_WELL
        for logger in self.loggers:
            try:
                logger.close(self.state, last)
            except Exception as e:
                print(f"warning: tracker {logger.kind}: closing failed ({one_line(e)})", file=sys.stderr, flush=True)
        self.loggers = []


def metrics_of(row) -> dict[str, float]:
    """A step or eval row's metrics, named for the trackers (METRICS), plus a step's tokens/s."""
    metrics = {name: float(getattr(row, f)) for f, name in METRICS[row.KIND].items()}
    if row.KIND == "step" and row.t_step_s > 0:
        metrics["train/tokens_per_s"] = row.n_tokens / row.t_step_s
    scored = getattr(row, "metrics", None) if row.KIND == "eval" else None
    for name, m in scored.items() if isinstance(scored, dict) else ():  # eval.metrics: eval/<name>, the mean score
        metrics[f"eval/{name}"] = sum(m["scores"]) / max(1, len(m["scores"]))
    return metrics


def tracker_file(task_dir: str | os.PathLike) -> Path:
    return Path(task_dir) / TRACKER_FILE


def read_records(task_dir: str | os.PathLike) -> dict:
    try:
        data = json.loads(tracker_file(task_dir).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as `Type: message` on one line (a library's message may span many)."""
    return f"{type(e).__name__}: {redact_text(' '.join(str(e).split()))[:limit]}"  # a server's URI: no password


def open_trackers(
    target: Target, task_dir: Path, earlier: list | None = None, replay: bool = False, drop_failed: bool = False
) -> TrackerSink:
    """Open each of target's trackers, continuing the runs tracker.json names; record new ones there. A tracker
    that cannot open raises RuntimeError (one line), or with drop_failed (a training task: a tracker's trouble
    never stops training) is left out with one warning line."""
    records = read_records(task_dir)
    loggers = []
    for kind in target.kinds:
        try:
            loggers.append(LOGGERS[kind](target, records.get(kind)))
        except Exception as e:
            if drop_failed:
                print(
                    f"warning: tracker {kind}: cannot open its run for task {target.task} ({one_line(e)}): "
                    f"dropped, training goes on; the events file has every row (python -m slurm_router.analysis "
                    f"{shlex.quote(target.run_dir)} --to {kind} replays them)",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            for logger in loggers:
                logger.close(None, False)
            raise RuntimeError(
                f"tracker {kind}: cannot open its run for task {target.task} ({one_line(e, 300)})"
            ) from e
    new = {logger.kind: logger.record for logger in loggers if records.get(logger.kind) != logger.record}
    if new:
        from slurm_router.fileio import atomic_write_text

        records.update({"run_id": target.run_id, "task": target.task, **new})
        atomic_write_text(tracker_file(task_dir), json.dumps(records, indent=1))
    return TrackerSink(loggers, earlier, replay)


def logged_before(events_path: Path) -> list:
    """The step and eval rows earlier attempts wrote (typed): their trackers have them already."""
    if not events_path.is_file():
        return []
    return tracked_rows(events_path, ())


def tracked_rows(events_path: Path, also: tuple[str, ...] = ("end",)) -> list:
    """An events file's step and eval rows (and `also` kinds), typed, in the order written; a row that does not fit
    the schema (an older version's) is left out."""
    from slurm_router.rundir.events import parse_row, scan_events

    rows, out = scan_events(events_path)[0], []
    for r in rows:
        if r.get("event") in METRICS or r.get("event") in also:
            try:
                out.append(parse_row(r))
            except (TypeError, ValueError):
                pass
    return out


def task_sink(spec, events_path: Path) -> TrackerSink | None:
    """The worker's hook (rank 0): the task's trackers, or None when the config turns none on. The submission
    checked them (check_tracker); what fails here (a package the node lacks, a store gone or unwritable, a server
    down) drops that tracker with one warning line: the README promises a tracker never fails the task."""
    target = Target.of(spec)
    if not target.kinds:
        return None
    for kind in list(target.kinds):  # a node without the package, or uninstalled since the submission
        error = missing_package(kind)
        if error:
            target.kinds.remove(kind)
            print(f"warning: {error}: dropped, training goes on without it", file=sys.stderr, flush=True)
    return open_trackers(target, spec.task_dir, logged_before(events_path), drop_failed=True)
