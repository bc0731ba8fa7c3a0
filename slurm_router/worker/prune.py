"""prune=true's files and calls: rank 0 of a variant's task appends each in-training evaluation to
tasks/<name>/evals.jsonl; then, holding RUN_DIR/decisions.lock, reads every task's lines and the run's looks
(RUN_DIR/decisions.jsonl), takes the run's next look when one is due and appends it, and learns whether its variant
was pruned (verdict/contest.py: when the run looks and what each look spends; verdict/pruning.py: the rule at a
look; docs/design/pruning.md)."""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from slurm_router.config.metrics import LOSS
from slurm_router.rundir.layout import EVALS_FILE, RunLayout, TaskPaths
from slurm_router.rundir.lock import short_lock
from slurm_router.rundir.spec import TaskSpec
from slurm_router.verdict import AUTO_FIRST, contest
from slurm_router.verdict.pruning import Decision

TAIL_BYTES = 65536  # where a task's last end row is


@dataclass
class Pruned:
    """A task that prune=true ended after the evaluation at `step`; `result` is rank 0's (None on other ranks)."""

    step: int
    result: dict | None = None


def record(
    task_dir: str | os.PathLike,
    step: int,
    variant: str,
    seed: int,
    loss_sums: list[float],
    tokens: list[int],
    sources: list | None = None,
    metrics: dict | None = None,
) -> None:
    """Append one evaluation as one line (one write to an O_APPEND file: readers never see half of it locally;
    a torn line elsewhere is skipped by read_step). sources: per eval batch, its samples' files (the clusters);
    metrics: eval.metrics' per-example scores (worker/metrics.py)."""
    row = {"step": step, "variant": variant, "seed": seed, "loss_sums": loss_sums, "tokens": tokens}
    row.update({"sources": sources} if sources is not None else {})
    _append(Path(task_dir) / EVALS_FILE, json.dumps({**row, **({"metrics": metrics} if metrics else {})}) + "\n")


def read_steps(run_dir: str | os.PathLike, metric: str = LOSS) -> dict[int, dict[str, dict[int, dict]]]:
    """{step: {variant: {seed: {loss_sums, tokens}}}} of every task's evaluations (a task evaluated twice at a
    step, after a requeue, gives the same numbers: the last line counts); of held-out loss, or of the task
    metric `metric` (its per-example scores as verdict/stats.metric_side gives them)."""
    return read_run(run_dir, metric)[0]


def read_run(run_dir: str | os.PathLike, metric: str = LOSS) -> tuple[dict, dict[tuple[str, int], int]]:
    """(read_steps' tables, {(variant, seed): last step recorded} of the replicates whose task has ended)."""
    from slurm_router.verdict.stats import metric_side  # scipy: only where a prune decision is made

    out: dict[int, dict[str, dict[int, dict]]] = {}
    finished: dict[tuple[str, int], int] = {}
    for path in sorted(RunLayout(run_dir).tasks.glob(f"*/{EVALS_FILE}")):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        done = ended(TaskPaths(path.parent))  # its result written, or it failed: no look waits for it
        for line in lines:
            try:
                row = json.loads(line)
                step, variant, seed = int(row["step"]), str(row["variant"]), int(row["seed"])
                entry = {"loss_sums": row["loss_sums"], "tokens": row["tokens"], "sources": row.get("sources")}
                if metric != LOSS:
                    entry = metric_side(row["metrics"][metric])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):  # a torn line being written
                continue
            out.setdefault(step, {}).setdefault(variant, {})[seed] = entry
            if done:
                finished[variant, seed] = max(step, finished.get((variant, seed), step))
    return out, finished


def read_looks(run_dir: str | os.PathLike) -> list[dict]:
    """The run's looks so far, in order (decisions.jsonl; a torn last line is one being written)."""
    try:
        text = RunLayout(run_dir).decisions.read_text()
    except FileNotFoundError:
        return []
    looks = []
    for line in text.splitlines():
        try:
            looks.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return looks


def read_step(run_dir: str | os.PathLike, step: int) -> dict[str, dict[int, dict]]:
    """{variant: {seed: {loss_sums, tokens}}} of every task's evaluation at `step`."""
    return read_steps(run_dir).get(step, {})


def after_eval(
    spec,
    step: int,
    loss_sums: list[float],
    tokens: list[int],
    schedule: contest.Schedule | None = None,
    sources: list | None = None,
    metrics: dict | None = None,
) -> Decision | None:
    """Rank 0 of a variant's task after an in-training evaluation: record it, then learn the run's decision."""
    record(spec.task_dir, step, spec.variant, spec.seed, loss_sums, tokens, sources, metrics)
    return decide_after(spec, step, schedule)


def decide_after(spec, step: int, schedule: contest.Schedule | None = None) -> Decision | None:
    """The run's decision about this task's variant once its evaluation at `step` is recorded (a fused task
    records all its members' first): the run's next look is taken here when this evaluation
    made one due, and recorded once for every replicate. schedule: the run's looks (run_schedule, from the plan's
    task.json files when not given)."""
    config = getattr(spec, "config", None) or {}
    metric = str((config.get("eval") or {}).get("primary") or LOSS)  # eval.primary decides
    auto = auto_contest(config)
    layout = RunLayout(spec.run_dir)
    with short_lock(layout.decisions_lock):
        looks = read_looks(spec.run_dir)
        if spec.variant not in contest.pruned_in(looks):
            tables, done = read_run(spec.run_dir, metric)
            if auto is not None:
                auto = first_round(auto, spec.run_dir, int(config.get("seed", 0)), tables, done)
            schedule = schedule or run_schedule(spec.run_dir)
            at = contest.next_look(tables, done, looks, auto, schedule)
            if at is not None:
                line = {**contest.take(tables, at, looks, schedule.n_looks, metric, auto), "time": time.time()}
                _append(layout.decisions, json.dumps(line) + "\n")
                looks.append(line)
    return contest.decision_for(looks, spec.variant, step, task=spec.name)


def run_schedule(run_dir: str | os.PathLike) -> contest.Schedule:
    """The run's looks as its plan fixed them (contest.Schedule): every variants-stage task.json's train.steps and
    train.eval_every, whichever task asks. Read once per process and run folder (a worker asks at each
    evaluation): the plan wrote every task.json before any task started, and nothing changes them; the tasks
    folder's change time is in the key, so a folder made again under the same path is read again."""
    try:
        changed = os.stat(RunLayout(run_dir).tasks).st_mtime_ns
    except OSError:
        changed = None
    return _schedule(os.fspath(run_dir), changed)


@functools.lru_cache(maxsize=16)
def _schedule(run_dir: str, changed: int | None) -> contest.Schedule:
    tasks = [
        (int(spec.steps), int(((spec.config or {}).get("train") or {}).get("eval_every") or 0))
        for spec, _ in variant_specs(run_dir)
    ]
    return contest.Schedule.of(tasks)


def auto_contest(config: dict) -> contest.Auto | None:
    """seeds=auto's contest (its cap), or None for a fixed number of seeds."""
    if config.get("seeds") != "auto":
        return None
    auto = config.get("auto_seeds") or {}
    effect = auto.get("min_effect")
    return contest.Auto(cap=int(auto.get("max", 6)), min_effect=float(effect) if effect else None)


def first_round(auto: contest.Auto, run_dir, seed: int, tables: dict, ended_at: dict) -> contest.Auto:
    """seeds=auto's contest with its first round: (variant, seed) of each planned variant's first AUTO_FIRST
    replicates (task.json), which a look waits for even before they record an evaluation (a queue with few slots
    starts some variants' second seeds late). One that ended without a row (failed) goes into `ended_at` at -1,
    so that no look waits for it."""
    with_rows = {(v, s) for here in tables.values() for v, side in here.items() for s in side}
    first = []
    for variant, index, paths in planned(run_dir):
        if index < AUTO_FIRST:
            first.append((variant, seed + index))
            if (variant, seed + index) not in with_rows and ended(paths):
                ended_at.setdefault((variant, seed + index), -1)
    return replace(auto, first_round=tuple(sorted(first)))


def decided(spec, step: int) -> Decision | None:
    """The run's decision about this task's variant so far, without an evaluation: a replicate that starts (or
    resumes) after its variant was pruned ends at once, its devices free for the survivors."""
    return contest.decision_for(read_looks(spec.run_dir), spec.variant, step, task=spec.name)


def _append(path: Path, text: str) -> None:
    """One write to an O_APPEND file: readers never see half of the line locally."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class LookWatch:
    """Whether the run took a look since this task last asked: one stat of RUN_DIR/decisions.jsonl per training
    step (rank 0). A replicate whose variant another task's look pruned learns it at its next step, not at its
    next evaluation, so its devices go to the survivors at once."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = RunLayout(run_dir).decisions
        self.size = self._size()

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def new_look(self) -> bool:
        size = self._size()
        grew, self.size = size != self.size, size
        return grew


def replicate_index(spec) -> int:
    """The replicate's place among its variant's seeds (seeds=auto's seeds run from the config's seed on)."""
    return int(spec.seed or 0) - int((spec.config or {}).get("seed", 0))


def planned(run_dir) -> list[tuple[str, int, TaskPaths]]:
    """(variant, replicate index, its folder) of every variants-stage task of the run (their task.json)."""
    return [(spec.variant, replicate_index(spec), TaskPaths(folder)) for spec, folder in variant_specs(run_dir)]


def variant_specs(run_dir) -> list[tuple[TaskSpec, Path]]:
    """(its TaskSpec, its folder) of every variants-stage task of the run, in folder order (a task.json that cannot
    be read, one being written, is left out)."""
    out = []
    for task_file in sorted(RunLayout(run_dir).tasks.glob("*/task.json")):
        try:
            spec = TaskSpec.load(str(task_file))
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if spec.stage == "variants":
            out.append((spec, task_file.parent))
    return out


def ended(paths: TaskPaths) -> bool:
    """Its result is written, or its last end row says it failed or diverged (such a replicate is never waited
    for: a look that waited would wait forever, pruning silently off)."""
    return paths.result.is_file() or exit_state(paths) in ("failed", "diverged")


def diverged(paths: TaskPaths) -> bool:
    """It ended with a non-finite loss (its result, or its last end row, says so)."""
    return exit_state(paths) == "diverged"


def exit_state(paths: TaskPaths) -> str | None:
    """How the task ended: its result's exit_state, else its last end row's (None: not ended)."""
    try:
        state = json.loads(paths.result.read_text()).get("exit_state")
        if state:
            return str(state)
    except (OSError, json.JSONDecodeError, AttributeError):
        pass
    last = None
    for row in read_rows(paths.events(0), tail_bytes=TAIL_BYTES):  # a long task's events: only their end is read
        if row.get("event") == "end":
            last = row.get("exit_state")
    return last


def read_rows(path: Path, tail_bytes: int | None = None) -> list[dict]:
    """The file's JSON lines (its last tail_bytes only: a cut first line is skipped like a torn one)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - tail_bytes) if tail_bytes is not None else 0)
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
