"""The tracker libraries behind trackers.py, one class each: open a task's run (new, or continued from the record
kept in tracker.json), log(metrics, step, time, kind), close(end state). Each imports its library only when
used (pip install -e '.[tracking]'); trackers.py decides what reaches them (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

# an attempt's end row -> the tracker run's state (MLflow's statuses; W&B: exit code 0 for the first group)
ENDED_WELL = ("completed", "diverged", "pruned")


def flat_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1e-3}} -> {'train.lr': 1e-3}; lists and None as text (what MLflow params hold)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
    return out


# ---- the trackers: open (new or continued), log(metrics, step, time), close(end state) -------------------------
class TensorBoardLogger:
    """torch.utils.tensorboard's SummaryWriter into the task's log dir; float64 scalars (new-style summaries),
    so a reader gets the events file's value exactly. Flushed every row: a crash loses nothing logged."""

    kind = "tensorboard"

    def __init__(self, target: Any, record: dict | None):  # target: trackers.Target
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(record["log_dir"]) if record else target.tensorboard_dir
        self.writer = SummaryWriter(str(self.log_dir))
        if not record:
            import yaml

            self.writer.add_text("config", "```\n" + yaml.safe_dump(target.config, sort_keys=False) + "```", 0)
        self.record = {"log_dir": str(self.log_dir)}

    def log(self, metrics: dict[str, float], step: int, when: float, kind: str) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step, walltime=when, new_style=True, double_precision=True)
        self.writer.flush()

    def carry(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self, state: str | None, last: bool) -> None:
        self.writer.close()


class MlflowLogger:
    """One MLflow run per task through MlflowClient: created on the first attempt (tags, the config as params),
    continued by id on later ones. The default store is a file store under the run dir (no server needed)."""

    kind = "mlflow"

    def __init__(self, target: Any, record: dict | None):  # target: trackers.Target
        uri = target.real(record["tracking_uri"]) if record else target.mlflow_uri
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store in maintenance mode behind this opt-in; it needs no server or database,
            # and each run is its own folder (many tasks write at once, also over NFS)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        if record:
            self.run_id = record["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment_id = self._experiment(uri, target.mlflow_experiment)
            run = self.client.create_run(
                experiment_id, run_name=target.name, tags={f"slurm_router.{k}": str(v) for k, v in target.tags.items()}
            )
            self.run_id = run.info.run_id
            from mlflow.entities import Param

            params = [Param(k, str(v)[:6000]) for k, v in flat_config(target.config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.record = {"tracking_uri": target.show(uri), "run_id": self.run_id}  # tracker.json: no password

    def _experiment(self, uri: str, name: str) -> str:
        """The experiment's id, made once: every task of a run starts at about the same time, so a file store's
        get-or-create runs under a lock (a server refuses the second create instead)."""
        import contextlib

        lock: contextlib.AbstractContextManager = contextlib.nullcontext()
        if uri.startswith("file:"):
            from urllib.parse import urlparse
            from urllib.request import url2pathname

            from slurm_router.rundir.lock import short_lock

            root = Path(url2pathname(urlparse(uri).path))
            root.mkdir(parents=True, exist_ok=True)
            lock = short_lock(root / ".experiments.lock")
        with lock:
            found = self.client.get_experiment_by_name(name)
            if found is not None:
                return found.experiment_id
            try:
                return self.client.create_experiment(name)
            except Exception:
                found = self.client.get_experiment_by_name(name)
                if found is None:
                    raise
                return found.experiment_id

    def log(self, metrics: dict[str, float], step: int, when: float, kind: str) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self.run_id, metrics=[Metric(k, v, int(when * 1000), step) for k, v in metrics.items()])

    def carry(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self, state: str | None, last: bool) -> None:
        status = "FINISHED" if state in ENDED_WELL else "FAILED" if state == "failed" else "KILLED"
        import contextlib
        import io
        import sys

        from slurm_router.config.secrets import redact_text

        printed = io.StringIO()  # MLflow prints "View run ... at: <the server's URI>", password and all
        try:
            with contextlib.redirect_stdout(printed):
                self.client.set_terminated(self.run_id, status)
        finally:
            sys.stdout.write(redact_text(printed.getvalue()))


class WandbLogger:
    """One W&B run per task (id kept in tracker.json, resume="allow"), grouped by the run id. Offline by default:
    compute nodes seldom reach the internet; each attempt then leaves an offline-run-* folder, and `wandb sync`
    of them all (in start order, the same id) uploads one run."""

    kind = "wandb"

    def __init__(self, target: Any, record: dict | None):  # target: trackers.Target
        import wandb

        self.dir = Path(record["dir"]) if record else target.dir
        self.dir.mkdir(parents=True, exist_ok=True)
        run_id = record["id"] if record else new_wandb_id()
        project = record["project"] if record else target.wandb_project
        entity = record.get("entity") if record else target.wandb_entity
        settings: dict[str, Any] = {"console": "off", "silent": True}
        if "x_transaction_log_flush_interval" in getattr(wandb.Settings, "model_fields", {}):
            # the offline log is flushed every 15 s by default: a worker killed before that loses those rows
            settings["x_transaction_log_flush_interval"] = 1.0
        self.run = wandb.init(
            id=run_id,
            resume="allow",
            project=project,
            entity=entity,
            name=target.name,
            group=target.run_id,
            dir=str(self.dir),
            mode=cast(Any, target.wandb_mode),
            config=flat_config(target.config),
            tags=[target.task],
            settings=wandb.Settings(**settings),
        )
        self.record = {"id": run_id, "project": project, "entity": entity, "dir": str(self.dir)}

    # W&B's history takes each step once, in increasing order (a resumed run starts after its last step): an eval
    # row (it comes after step N-1's row) is held until step N's row and logged with it, one committed row a step.
    # An attempt that stops between the two leaves the eval to the next one (carry), which logs it with step N.
    held: tuple[int, dict] | None = None

    def log(self, metrics: dict[str, float], step: int, when: float, kind: str) -> None:
        if kind == "eval":
            self._flush_held()
            self.held = (step, metrics)
            return
        if self.held is not None and self.held[0] == step:
            metrics = {**self.held[1], **metrics}
            self.held = None
        self._flush_held()
        self.run.log(metrics, step=step, commit=True)

    def carry(self, metrics: dict[str, float], step: int) -> None:
        self.held = (step, metrics)

    def _flush_held(self) -> None:
        if self.held is not None:
            self.run.log(self.held[1], step=self.held[0], commit=True)
            self.held = None

    def close(self, state: str | None, last: bool) -> None:
        if last:  # the final evaluation: no step row follows it
            self._flush_held()
        elif state != "failed":
            self.run.mark_preempting()  # stopped after a checkpoint: a later attempt continues it
        self.run.finish(exit_code=0 if state in ENDED_WELL else 1)


def new_wandb_id() -> str:
    """8 characters of [a-z0-9], as W&B makes its own run ids."""
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


LOGGERS = {cls.kind: cls for cls in (TensorBoardLogger, MlflowLogger, WandbLogger)}
