"""The one event schema: JSONL, one file per worker (TaskPaths.events(rank)), append-only, one line per event.

The dataclasses below are the schema; the writer refuses anything outside it, readers take kinds and
field names from here (parse_row turns a read dict back into its typed row). A crash leaves at most one
partial last line, which readers skip. Units are in the names (_s, _bytes). The table of kinds and fields
that follows is generated from the dataclasses, so it cannot drift from what is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator, cast


class _Omit:
    """Default of an optional field: the key is left out of the row (None is a value, written as null)."""

    def __repr__(self) -> str:
        return "OMIT"


OMIT: Any = _Omit()
EVENT = "event"  # the key that holds a row's kind


def _opt(doc: str = "") -> Any:
    return field(default=OMIT, metadata={"doc": doc, "optional": True})


def _req(doc: str = "") -> Any:
    return field(default=OMIT, metadata={"doc": doc})


@dataclass(kw_only=True)
class Row:
    """Identity fields every row carries; the writer fills them (and `time`) from its own identity."""

    KIND: ClassVar[str] = ""
    time: float = _req("unix time the row was written")
    host: str = _req()
    run_id: str = _req()
    task: str = _req()
    variant: str | None = _req()
    stage: str = _req()
    attempt: int = _req("requeue count")
    device: int = _req("the worker's rank")
    policy: str | None = _req("router policy")

    def to_dict(self) -> dict:
        """The row as written: `event` first, then identity, then the kind's fields; optional ones left out
        when not given."""
        out = {EVENT: self.KIND}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is OMIT:
                if f.metadata.get("optional"):
                    continue
                raise ValueError(f"{self.KIND} row without its field {f.name!r}")
            out[f.name] = value
        return out


IDENTITY = tuple(f.name for f in dataclasses.fields(Row) if f.name != "time")


@dataclass(kw_only=True)
class StartRow(Row):
    """a worker started (every attempt)"""

    KIND: ClassVar[str] = "start"
    steps: int = _req()
    world: int = _req("workers of the task")
    device_type: str = _req("cuda | cpu")
    n_params: int = _req()
    n_trainable_params: int = _req()
    global_batch_size: int = _req()
    lr: float = _req("peak learning rate")
    n_train_samples: int = _req()
    n_val_samples: int = _req()
    mem_total_bytes: int = _req()
    mem_budget_bytes: list = _req("the router's budget, every device")
    torch: str = _req("torch version")
    pid: int = _req()
    cuda_visible_devices: str | None = _req()
    resume_from: str | None = _req("checkpoint path")
    device_name: str = _req("the GPU model, for MFU")
    threads: int = _opt("a CPU worker's torch threads, for MFU against this machine's measured matmul peak")
    n_layer: int = _opt("transformer blocks, for attention's FLOPs in MFU")
    d_model: int = _opt("hidden width, for attention's FLOPs in MFU")


@dataclass(kw_only=True)
class MicroRow(Row):
    """one per (step, device, micro-batch)"""

    KIND: ClassVar[str] = "micro"
    step: int = _req()
    micro: int = _req("index within the device's step")
    sample_ids: list = _req()
    n_samples: int = _req()
    n_tokens: int = _req()
    n_pad_tokens: int = _req()
    cost: float = _req("the router's cost")
    t_start: float = _req()
    t_data_s: float = _req()
    t_compute_s: float = _req()
    mem_peak_bytes: int = _req()
    mem_predicted_bytes: int | None = _req()
    loss: float = _req("this micro-batch's mean token loss")
    lr: float = _req()
    oom_retries: int = _req("this device's OOM halvings so far this step")


@dataclass(kw_only=True)
class StepRow(Row):
    """one per optimizer step and device; rank 0's is the global view"""

    KIND: ClassVar[str] = "step"
    step: int = _req()
    loss: float = _req("global, token-weighted")
    n_tokens: int = _req()
    n_target_tokens: int = _req()
    n_samples: int = _req()
    t_step_s: float = _req()
    t_sync_wait_s: float = _req()
    lr: float = _req()
    busy_s: float = _req("this device")
    busy_s_all: list = _req("every device")
    planned_cost: list = _req("every device")
    n_micro: list = _req("every device")
    speed: list = _req("the router's estimate, every device")
    cost_balance_ratio: float = _req()
    oom_retries: int = _req()
    n_pad_tokens: int = _req()
    mem_peak_bytes: int = _req()
    mem_total_bytes: int = _req()
    util: float = _req("GPU % (NVML) or process CPU %")


@dataclass(kw_only=True)
class EvalRow(Row):
    """held-out loss"""

    KIND: ClassVar[str] = "eval"
    step: int = _req()
    val_loss: float = _req()
    val_tokens: int = _req()
    batch_loss_sums: list = _req("per eval batch")
    batch_tokens: list = _req("per eval batch")
    batch_sources: list = _opt("per eval batch, the sources (files) of its samples: the verdict's clusters")
    metrics: dict = _opt("eval.metrics: per metric, scores (one per example, in order), higher_is_better, sources")
    t_metrics_s: float = _opt("time in the metric functions at this evaluation")
    t_eval_s: float = _opt("wall time of this evaluation (loss and metrics); fused: since the group's began")


@dataclass(kw_only=True)
class CheckpointSavedRow(Row):
    """rank 0 wrote a checkpoint"""

    KIND: ClassVar[str] = "checkpoint_saved"
    step: int = _req("the next step to run")
    path: str = _req()
    bytes: int = _req()
    sha256: str = _req()
    reason: str = _req("periodic | signal | eval-failed")
    t_save_s: float = _req()


@dataclass(kw_only=True)
class CheckpointLoadedRow(Row):
    """a worker resumed from a checkpoint"""

    KIND: ClassVar[str] = "checkpoint_loaded"
    step: int = _req()
    path: str = _req()
    t_load_s: float = _req()


@dataclass(kw_only=True)
class RequeueRow(Row):
    """the job process requeued the task, or found that Slurm had"""

    KIND: ClassVar[str] = "requeue"
    reason: str = _req("timeout | preempted | interrupted | slurm")
    job_id: str = _req()
    detail: str = _opt()
    step: int | None = _opt()
    restart: int = _opt("the scheduler's restart count of the job it accounts for")
    time_requested: float = _opt()


@dataclass(kw_only=True)
class WaitRow(Row):
    """the job held its devices, training nothing, until its seeds=auto round's call was made (Slurm)"""

    KIND: ClassVar[str] = "wait"
    waited_s: float = _req()
    reason: str = _opt()


@dataclass(kw_only=True)
class EndRow(Row):
    """how an attempt ended"""

    KIND: ClassVar[str] = "end"
    exit_state: str = _req("completed | interrupted | failed | diverged | pruned | not_needed")
    error: str = _opt()
    detail: str | None = _opt("pruned (rank 0), not_needed (a seeds=auto reserve): why, in one sentence")
    step: int | None = _opt("diverged: the step whose loss was not finite; pruned: the evaluation it stopped at")
    val_loss: float = _opt("rank 0 of a completed task")
    train_loss: float = _opt("rank 0 of a completed task")
    steps: int = _opt("rank 0 of a completed task; a not_needed reserve: the steps it would have trained")


ROWS: dict[str, type[Row]] = {
    cls.KIND: cls
    for cls in (
        StartRow,
        MicroRow,
        StepRow,
        EvalRow,
        CheckpointSavedRow,
        CheckpointLoadedRow,
        RequeueRow,
        WaitRow,
        EndRow,
    )
}


def fields_of(kind: str | type[Row], *names: str) -> tuple[str, ...]:
    """A kind's own field names (identity left out); with names, those, checked to be in the schema."""
    cls = ROWS[kind] if isinstance(kind, str) else kind
    own = tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("time", *IDENTITY))
    if not names:
        return own
    unknown = [n for n in names if n not in own and n not in IDENTITY and n not in ("time", EVENT)]
    if unknown:
        raise KeyError(f"{cls.KIND} rows have no field {', '.join(unknown)}; they have {', '.join(own)}")
    return names


def row_class(kind: str) -> type[Row]:
    try:
        return ROWS[kind]
    except KeyError:
        raise ValueError(f"unknown event kind {kind!r}; the kinds are {', '.join(ROWS)}") from None


def parse_row(d: dict) -> Row:
    """A read row (a dict from read_events) as its typed row; ValueError for a kind or field not in the schema."""
    cls = row_class(cast(str, d.get(EVENT)))
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names - {EVENT})
    if unknown:
        raise ValueError(f"{cls.KIND} row with field(s) not in the schema: {', '.join(unknown)}")
    row = cls(**{k: v for k, v in d.items() if k != EVENT})
    row.to_dict()  # every required field present
    return row


class EventWriter:
    """Appends rows to one events file, filling in the identity fields and the time."""

    def __init__(self, path: str | os.PathLike, sink: Any = None, **identity: Any):
        self.path = Path(path)
        self.sink = sink  # rank 0's experiment trackers (trackers.TrackerSink): each row, once it is written
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.identity = {"host": socket.gethostname(), **identity}
        unknown = sorted(set(self.identity) - set(IDENTITY))
        if unknown:
            raise ValueError(f"not identity fields: {', '.join(unknown)}; they are {', '.join(IDENTITY)}")
        self._f = open(self.path, "a", encoding="utf-8", buffering=1)  # line-buffered: a crash loses <= 1 line

    def write(self, row: Row | str, **fields: Any) -> None:
        """write(StepRow(step=..., ...)), or write("requeue", reason=..., ...): either way validated against
        the schema (an unknown kind or field, or a missing one, raises before anything is written)."""
        order = None
        if isinstance(row, str):
            cls = row_class(row)
            names = fields_of(cls)
            unknown = [k for k in fields if k not in names]
            if unknown:
                raise ValueError(f"{cls.KIND} rows have no field {', '.join(unknown)}; they have {', '.join(names)}")
            row, order = cls(**fields), list(fields)  # the caller's key order, as before the schema
        elif fields:
            raise TypeError("write(row) takes a typed row alone, or write(kind, **fields)")
        given = {"time": time.time(), **self.identity}
        row = dataclasses.replace(row, **{k: v for k, v in given.items() if getattr(row, k) is OMIT})
        out = row.to_dict()
        if order is not None:
            out = {k: out[k] for k in (EVENT, "time", *self.identity, *order)}
        self._f.write(json.dumps(out, separators=(",", ":"), default=_jsonable) + "\n")
        if self.sink is not None:
            self.sink.log(row)

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        if self.sink is not None:
            self.sink.close()


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"cannot write {type(x).__name__} to an event")


def scan_events(path: str | os.PathLike) -> tuple[list[dict], list[int]]:
    """(every event row of one file, the numbers of the lines that are not one). A torn last line (a crash
    mid-write) is neither: it is skipped. Raises OSError if the file cannot be read."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    rows, bad = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) and not line.endswith("\n"):
                break
            row = None
        if isinstance(row, dict) and row.get(EVENT):
            rows.append(row)
        else:
            bad.append(n)
    return rows, bad


def read_events(path: str | os.PathLike) -> Iterator[dict]:
    """Rows of one events file; a torn last line (crash mid-write) is skipped, garbage elsewhere raises."""
    rows, bad = scan_events(path)
    if bad:
        raise ValueError(f"{path}:{bad[0]}: not an event row (not JSON, or no 'event' field)")
    yield from rows


def schema_text() -> str:
    """The schema as a table, from the dataclasses: the tail of this module's docstring."""

    def names(cls) -> str:
        out = []
        for f in dataclasses.fields(cls):
            if f.name in ("time", *IDENTITY):
                continue
            doc = f.metadata.get("doc", "")
            tag = "optional" + (", " + doc if doc else "") if f.metadata.get("optional") else doc
            out.append(f"{f.name} ({tag})" if tag else f.name)
        return ", ".join(out)

    lines = [f"Every row: event (the kind), time, {', '.join(IDENTITY)}.", "Kinds and their own fields:"]
    for kind, cls in ROWS.items():
        lines.append(
            textwrap.fill(
                f"{kind:<17} {cls.__name__}, {cls.__doc__}: {names(cls)}",
                110,
                initial_indent="  ",
                subsequent_indent=" " * 20,
            )
        )
    return "\n".join(lines) + "\n"


__doc__ = (__doc__ or "") + "\n" + schema_text()
