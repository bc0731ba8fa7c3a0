"""The forecast's arithmetic (pure: no torch, no files): a task's time from its parts, a queue of tasks over the
launcher's slots, a stage's and a run's wall time and device-hours, seeds=auto's range and pruning's best case, and
the run's ETA from what has been measured so far. launch/forecast.py feeds it the plan and the measured rates."""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field

PARTS = ("startup", "train", "eval")


@dataclass(frozen=True)
class TaskTime:
    """One task's forecast, in seconds of its own process: start-up (interpreter, imports, data, model), training
    (steps x step time) and evaluation (evaluations x one evaluation's time). devices: what it holds meanwhile."""

    name: str
    stage: str
    devices: int
    startup_s: float
    train_s: float
    eval_s: float
    group: str = "first"  # first: runs in any case; reserve-N: a seeds=auto reserve of round N (may not run)

    @property
    def total_s(self) -> float:
        return self.startup_s + self.train_s + self.eval_s


def n_evaluations(steps: int, eval_every: int) -> int:
    """The evaluations a task makes: at step 0, every eval_every-th step before its last, and at its end."""
    return 2 + (len(range(eval_every, steps, eval_every)) if eval_every > 0 else 0)


def first_look(steps: int, eval_every: int, grace: float) -> int | None:
    """The first step prune=true may stop a task at (its first evaluation from grace x steps on), None: none."""
    if eval_every <= 0:
        return None
    return next((s for s in range(eval_every, steps, eval_every) if s >= grace * steps), None)


def task_time(
    name: str,
    stage: str,
    devices: int,
    startup_s: float,
    step_s: float,
    eval_s: float,
    steps: int,
    eval_every: int,
    group: str = "first",
    stop_at: int | None = None,
) -> TaskTime:
    """A task of `steps` steps at step_s each, evaluated as n_evaluations says at eval_s each; stop_at: the
    step it stops at (pruned: its evaluation there is its last)."""
    ran = steps if stop_at is None else min(steps, stop_at)
    evals = n_evaluations(steps, eval_every)
    if stop_at is not None and stop_at < steps:
        evals = 1 + len(range(eval_every, stop_at + 1, eval_every)) if eval_every > 0 else 1
    return TaskTime(name, stage, devices, startup_s, ran * step_s, evals * eval_s, group)


def makespan(durations: list[float], slots: int) -> float:
    """Wall time of tasks started in queue order, each on the first free slot (the local queue; a Slurm array
    with `slots` tasks at a time)."""
    if not durations:
        return 0.0
    free = [0.0] * max(1, min(slots, len(durations)))
    end = 0.0
    for d in durations:
        start = heapq.heappop(free)
        end = max(end, start + d)
        heapq.heappush(free, start + d)
    return end


@dataclass
class Part:
    """A stage (or a round of reserves): its wall time and device-hours, split by part."""

    name: str
    tasks: int
    wall_s: float
    device_hours: float
    split: dict = field(default_factory=dict)  # startup/train/eval device-hours

    def to_dict(self) -> dict:
        return asdict(self)


def part(name: str, tasks: list[TaskTime], slots: int) -> Part:
    """Tasks run side by side over `slots` devices (a task of D devices takes D of them)."""
    width = max((t.devices for t in tasks), default=1)
    wall = makespan([t.total_s for t in tasks], max(1, slots // width))
    split = {p: sum(getattr(t, f"{p}_s") * t.devices for t in tasks) / 3600 for p in PARTS}
    return Part(name, len(tasks), wall, sum(split.values()), split)


@dataclass
class Forecast:
    """The run's forecast: each stage (reserves: each round), the run in all when every reserve runs (high) and
    when none does, with pruning's best case where prune=true (low)."""

    parts: list[Part]
    low: Part | None = None  # seeds=auto: the first round only; prune=true: and every loser stopped at its first look
    report_s: float = 0.0  # writing the report, after the last task (wall time only)

    @property
    def wall_s(self) -> float:
        return sum(p.wall_s for p in self.parts) + self.report_s

    @property
    def device_hours(self) -> float:
        return sum(p.device_hours for p in self.parts)

    def split(self) -> dict:
        return {k: sum(p.split.get(k, 0.0) for p in self.parts) for k in PARTS}

    def to_dict(self) -> dict:
        return {
            "wall_s": self.wall_s,
            "device_hours": self.device_hours,
            "split_device_hours": self.split(),
            "report_s": self.report_s,
            "stages": [p.to_dict() for p in self.parts],
            "low": None if self.low is None else {**self.low.to_dict(), "wall_s": self.low.wall_s + self.report_s},
        }


def forecast(stages: list[tuple[str, list[TaskTime]]], slots: int, report_s: float = 0.0, low=None) -> Forecast:
    """stages: (name, tasks) in order; a stage's reserves (group reserve-N) run after its first round, round by
    round (the local queue starts a reserve once its round is called; a Slurm array's reserves wait for it)."""
    parts = []
    for name, tasks in stages:
        groups = list(dict.fromkeys(t.group for t in tasks))
        for g in groups:
            label = name if g == "first" else f"{name} {g}"
            parts.append(part(label, [t for t in tasks if t.group == g], slots))
    return Forecast(parts, low, report_s)


def low_part(stages: list[tuple[str, list[TaskTime]]], slots: int) -> Part:
    """The run when no reserve runs (stages given with pruning's best case applied): one Part summed over stages."""
    parts = [part(n, [t for t in ts if t.group == "first"], slots) for n, ts in stages]
    split = {k: sum(p.split[k] for p in parts) for k in PARTS}
    return Part("low", sum(p.tasks for p in parts), sum(p.wall_s for p in parts), sum(split.values()), split)


def remaining_s(total_s: float, startup_s: float, done_steps: int | None, steps: int, eta_s: float | None) -> float:
    """A task's remaining seconds: its own ETA at its measured pace while it steps, else its forecast less the
    share of steps done (not started: its whole forecast)."""
    if eta_s is not None:
        return max(0.0, eta_s)
    if not done_steps:
        return total_s
    return max(0.0, (total_s - startup_s) * (1 - done_steps / max(1, steps)))


def run_eta(stages: list[list[tuple[float, bool]]], slots: int, report_s: float = 0.0) -> float:
    """The run's remaining wall time: per stage, (remaining seconds, running now) of each task not ended; the
    running ones hold their slots first, the rest queue behind them. Stages follow one another."""
    total = 0.0
    for tasks in stages:
        running = sorted(s for s, now in tasks if now)
        queued = [s for s, now in tasks if not now]
        free = [0.0] * max(1, slots)
        for i, s in enumerate(running[: len(free)]):
            free[i] = s
        heapq.heapify(free)
        end = max(running, default=0.0)
        for d in queued:
            start = heapq.heappop(free)
            end = max(end, start + d)
            heapq.heappush(free, start + d)
        total += end
    return total + (report_s if any(stages) else 0.0)
