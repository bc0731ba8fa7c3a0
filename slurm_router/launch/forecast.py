"""A run's forecast, before it runs (docs/forecast.md): wall time and device-hours per stage and for the run, split
into start-up, training and evaluation, from throughput measured here for this model shape (artifacts/
calibration.py: a short probe, cached) and the plan's stages over the launcher's slots (launch/eta.py). seeds=auto:
the range from the first round only to every reserve; prune=true: its best case (every loser stopped at its first
look). Printed by the dry run and the run, saved as RUN_DIR/forecast.json (analysis/forecast.py sets it beside
what happened)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from slurm_router.analysis.forecast import FILE, duration
from slurm_router.launch import eta
from slurm_router.rundir.spec import Stage, TaskSpec
from slurm_router.verdict import GRACE
from slurm_router.worker.auto_seeds import reserve_index

# tests only: no forecast (no probe, no line, no forecast.json), so the suite does not pay a probe per model shape;
# tests/conftest.py sets it for the suite, tests/test_forecast.py clears it
OFF_ENV = "SLURM_ROUTER_TEST_NO_FORECAST"
REPORT_S = 15.0  # writing the report after the last task (imports, plots): wall time, no device
# a fused task's step and evaluation: this x K variants' alone (per_variant layout on CPU: 0.76x the tokens/s of
# separate processes at K=2, benchmarks/results/fused-cpu.md)
FUSED_PER_VARIANT = 1.3


def slots_and_device(cfg: DictConfig) -> tuple[int, str, bool]:
    """(tasks' device slots, the device kind, whether this machine can measure it): the local queue's slots, a
    Slurm array's parallelism (its GPUs are not here)."""
    kind = str(cfg.launcher.kind)
    if kind != "local":
        return int(cfg.launcher.get("array_parallelism") or 64), "cuda", False
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count() * max(1, int(cfg.resources.tasks_per_gpu or 1)), "cuda", True
    return int(cfg.launcher.get("cpu_slots") or os.cpu_count() or 1), "cpu", True


def _stage_threads(stage: Stage, slots: int, device: str) -> int:
    """A CPU worker's threads in this stage (the local queue's choice, backends/local/launcher.py)."""
    from slurm_router.worker.cpu import threads_per_worker

    return 1 if device != "cpu" else threads_per_worker(min(slots, sum(int(t.devices) for t in stage.tasks)))


def _batch(t: TaskSpec) -> int:
    return -(-int(t.global_batch_size) // max(1, int(t.devices)))


def plan_forecast(cfg: DictConfig, stages: list[Stage]) -> dict | None:
    """The forecast as forecast.json holds it; {"unknown": why} when nothing can be measured (a Slurm run's GPUs
    that no earlier run of this shape recorded; a probe that failed). A forecast never stops a run."""
    if os.environ.get(OFF_ENV):
        return None
    try:
        return _plan_forecast(cfg, stages)
    except Exception as e:  # noqa: BLE001 (the forecast says why it has none; the run goes on)
        return {"unknown": f"the forecast failed ({type(e).__name__}: {e})"}


def _plan_forecast(cfg: DictConfig, stages: list[Stage]) -> dict:
    from slurm_router.artifacts import calibration

    slots, device, here = slots_and_device(cfg)
    todo = [s for s in stages if not s.cached and s.tasks]
    if not todo:
        return {"unknown": "every stage is cached: nothing runs"}
    first = todo[-1].tasks[0]
    threads = {s.name: _stage_threads(s, slots, device) for s in todo}
    request = calibration.probe_request(first.config, _batch(first), list(threads.values()), device)
    # where the run's report records the rates it measured (analysis/forecast.py): the next forecast starts there
    record = {
        "calibration_key": calibration.key(request),
        "cache_file": str(calibration.cache_file(cfg)),
        "threads": threads,
        "request": {k: request[k] for k in ("batch", "eval_batch", "device")},
    }
    started = time.perf_counter()
    try:
        r = calibration.rates(cfg, request) if here else calibration.cached(cfg, request)
    except (RuntimeError, OSError, ValueError) as e:
        return {"unknown": f"the calibration probe failed ({e})", **record}
    if r is None or any(str(t) not in r["by_threads"] for t in threads.values()):
        why = f"no throughput measured on {device} for this model shape yet (a run of it records its own)"
        return {"unknown": why, **record}
    stage_tasks = [(s.name, task_times(s, r, threads[s.name], request["batch"], slots)) for s in todo]
    best = [
        (n, pruned_best(ts, s, r, threads[s.name], request["batch"], slots)) for (n, ts), s in zip(stage_tasks, todo)
    ]
    low = eta.low_part(best, slots)
    fc = eta.forecast(stage_tasks, slots, REPORT_S if cfg.launcher.kind == "local" else 0.0, low)
    out = fc.to_dict()
    out.update(
        version=1,
        created=time.time(),
        device=device,
        slots=slots,
        **record,
        source=r.get("source", "calibration") + (" (cached)" if r.get("cached") else ""),
        rates={"startup_s": r.get("startup_s"), "mean_len": r.get("mean_len"), **r["by_threads"]},
        calibration_s=round(time.perf_counter() - started, 2),
        model={k: v for k, v in request["model"].items() if k not in ("name_or_path", "lora")},
        reserves=any(t.group != "first" for _, ts in stage_tasks for t in ts),
        prune=bool(cfg.get("prune")),
        tasks={t.name: {"stage": n, **_task_row(t, stages)} for n, ts in stage_tasks for t in ts},
    )
    return out


def _task_row(t: eta.TaskTime, stages: list[Stage]) -> dict:
    spec = next(s for st in stages for s in st.tasks if s.name == t.name)
    every = int(((spec.config or {}).get("train") or {}).get("eval_every") or 0)
    return {
        "total_s": t.total_s,
        "startup_s": t.startup_s,
        "train_s": t.train_s,
        "steps": int(spec.steps),
        "eval_s": t.eval_s,
        "evals": eta.n_evaluations(int(spec.steps), every),
        "group": t.group,
    }


def task_times(stage: Stage, r: dict, threads: int, probe_batch: int, slots: int, stop_at=None) -> list[eta.TaskTime]:
    """Each task of the stage (a fused task: its K variants in one pass) at the measured rates."""
    rates = r["by_threads"][str(threads)]
    # tasks that start side by side share the cores while they import and load (2 at once took 2x one's start-up
    # here, on 2 cores): the probe started alone
    together = max(1, min(len(stage.tasks), slots)) if r.get("source") == "calibration" else 1
    out = []
    for t in stage.tasks:
        k = len(t.group) * FUSED_PER_VARIANT if t.members else 1.0
        per_step = rates["lora_step_s" if t.lora else "step_s"] * _batch(t) / max(1, probe_batch) * k
        train = (t.config or {}).get("train") or {}
        per_eval = rates["eval_batch_s"] * int(train.get("eval_batches", 8)) * k
        index = reserve_index(t)
        group = "first" if index is None else f"reserve-{index - 1}"  # seeds=auto's round of this replicate
        stop = None if stop_at is None else stop_at(t)
        out.append(
            eta.task_time(
                t.name,
                stage.name,
                int(t.devices),
                float(r.get("startup_s") or 0.0) * together,
                per_step,
                per_eval,
                int(t.steps),
                int(train.get("eval_every", 0) or 0),
                group,
                stop,
            )
        )
    return out


def pruned_best(
    tasks: list[eta.TaskTime], stage: Stage, r: dict, threads: int, probe_batch: int, slots: int
) -> list[eta.TaskTime]:
    """prune=true's best case: every replicate of every variant but the first stopped at its first look (a fused
    task as a whole: its group keeps training the first variant's replicates, so it is not shortened here)."""
    cfg = (stage.tasks[0].config or {}) if stage.tasks else {}
    if not cfg.get("prune") or stage.name == "base":
        return tasks
    keep = stage.tasks[0].variant

    def stop_at(t: TaskSpec) -> int | None:
        if t.variant == keep or t.members:
            return None
        every = int(((t.config or {}).get("train") or {}).get("eval_every") or 0)
        return eta.first_look(int(t.steps), every, GRACE)

    return task_times(stage, r, threads, probe_batch, slots, stop_at)


def lines(fc: dict | None) -> list[str]:
    """None of them without a forecast (OFF_ENV); else one or two lines: the run's wall time and device-hours (and the range), and each stage's."""
    if fc is None:
        return []
    if "unknown" in fc:
        return [f"forecast: unknown: {fc['unknown']}"]
    split = fc["split_device_hours"]
    head = (
        f"forecast: {duration(fc['wall_s'])} wall, {fc['device_hours']:.4f} device-hours on {fc['slots']} "
        f"{fc['device']} slot(s) (start-up {split['startup']:.4f}, training {split['train']:.4f}, evaluation "
        f"{split['eval']:.4f}); measured here: {fc['source']}"
    )
    low = fc.get("low")
    if low and (fc["reserves"] or fc["prune"]) and low["wall_s"] < fc["wall_s"]:
        what = "the first round only" if fc["reserves"] else "every loser pruned at its first look"
        if fc["reserves"] and fc["prune"]:
            what += ", losers pruned at their first look"
        head += (
            f"; from {duration(low['wall_s'])}, {low['device_hours']:.4f} device-hours ({what}) to that (every "
            f"{'reserve' if fc['reserves'] else 'step'})"
        )
    stages = "; ".join(
        f"{s['name']}: {s['tasks']} task(s), {duration(s['wall_s'])}, {s['device_hours']:.4f} device-h"
        for s in fc["stages"]
    )
    return [head, f"  by stage: {stages}"]


def save(fc: dict | None, run_dir: str | os.PathLike) -> None:
    """RUN_DIR/forecast.json (the plan-time forecast: rates, stages, tasks; nothing secret: no config values but
    the model's shape and data settings the probe used)."""
    if fc is None:
        return
    from slurm_router.fileio import atomic_write_text

    atomic_write_text(Path(run_dir) / FILE, json.dumps(_jsonable(fc), indent=1))


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def run_eta(run_dir: str | os.PathLike, tasks: list[Any]) -> tuple[float, float] | None:
    """(the run's remaining seconds, the forecast's whole wall time), refreshed from what was measured: a running
    task's remaining steps at its own pace (rundir/progress.py), a waiting task's forecast scaled by how the ended
    tasks' elapsed times compared with theirs. tasks: the status rows (scheduler/task_view.py TaskView), by
    name. None: no forecast, or nothing left to run."""
    from slurm_router.analysis.forecast import load

    fc = load(run_dir)
    if not fc or "unknown" in fc or not fc.get("tasks"):
        return None
    rows = {t.variant: t for t in tasks}
    order = list(dict.fromkeys(str(s["name"]).split(" ")[0] for s in fc.get("stages") or []))
    seen = [order.index(f["stage"]) for n, f in fc["tasks"].items() if n in rows and f["stage"] in order]
    current = max(seen, default=0)  # the progress view knows its own stage's tasks: the stages before it ended
    ended = [
        (rows[n].elapsed_s, f["total_s"])
        for n, f in fc["tasks"].items()
        if n in rows and rows[n].terminal and rows[n].elapsed_s and f["total_s"] > 0
    ]
    scale = sorted(a / f for a, f in ended)[len(ended) // 2] if ended else 1.0
    startup = float((fc.get("rates") or {}).get("startup_s") or 0.0)
    stages: dict[str, list[tuple[float, bool]]] = {}
    for name, f in fc["tasks"].items():
        row = rows.get(name)
        if (row is not None and row.terminal) or (row is None and order.index(f["stage"]) < current):
            continue
        running = row is not None and row.state == "RUNNING"
        p = row.progress if row is not None else None
        left = eta.remaining_s(
            f["total_s"] * scale, startup, p.step if p else None, int(p.steps or 0) if p else 0, p.eta_s if p else None
        )
        stages.setdefault(f["stage"], []).append((left, running))
    if not stages:
        return None
    return eta.run_eta(list(stages.values()), int(fc.get("slots") or 1), float(fc.get("report_s") or 0.0)), fc["wall_s"]


def eta_line(run_dir: str | os.PathLike, tasks: list[Any]) -> str | None:
    """'run ETA 3m05s (forecast 9m47s in all; refreshed from the tasks' measured pace)', or None."""
    try:
        got = run_eta(run_dir, tasks)
    except (KeyError, TypeError, ValueError, AttributeError):  # a forecast.json of another version: no ETA
        return None
    if got is None:
        return None
    left, whole = got
    return f"run ETA {duration(left)} (forecast {duration(whole)} in all at plan time; refreshed from the tasks' pace)"
