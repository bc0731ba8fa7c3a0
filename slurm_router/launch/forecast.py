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

REPORT_S = 15.0  # writing the report after the last task (imports, plots): wall time, no device
FUSED_PER_VARIANT = 1.0  # a fused task's step and evaluation: this x K variants' (per_variant layout: one row each)


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
    """The forecast as forecast.json holds it, or None when nothing can be measured (a Slurm run's GPUs that no
    earlier run of this shape recorded; a probe that failed): {"unknown": why} then."""
    from slurm_router.artifacts import calibration

    slots, device, here = slots_and_device(cfg)
    todo = [s for s in stages if not s.cached and s.tasks]
    if not todo:
        return {"unknown": "every stage is cached: nothing runs"}
    first = todo[-1].tasks[0]
    threads = {s.name: _stage_threads(s, slots, device) for s in todo}
    request = calibration.probe_request(first.config, _batch(first), list(threads.values()), device)
    started = time.perf_counter()
    try:
        r = calibration.rates(cfg, request) if here else calibration.cached(cfg, request)
    except (RuntimeError, OSError, ValueError) as e:
        return {"unknown": f"the calibration probe failed ({e})"}
    if r is None:
        return {"unknown": f"no throughput measured on {device} for this model shape yet (the first run records it)"}
    stage_tasks = [(s.name, task_times(s, r, threads[s.name], request["batch"])) for s in todo]
    best = [(n, pruned_best(ts, s, r, threads[s.name], request["batch"])) for (n, ts), s in zip(stage_tasks, todo)]
    low = eta.low_part(best, slots)
    fc = eta.forecast(stage_tasks, slots, REPORT_S if cfg.launcher.kind == "local" else 0.0, low)
    out = fc.to_dict()
    out.update(
        version=1,
        created=time.time(),
        device=device,
        slots=slots,
        threads=threads,
        source=r.get("source", "calibration") + (" (cached)" if r.get("cached") else ""),
        rates={"startup_s": r.get("startup_s"), "mean_len": r.get("mean_len"), **r["by_threads"]},
        calibration_s=round(time.perf_counter() - started, 2),
        request={k: request[k] for k in ("batch", "eval_batch", "threads", "device")}
        | {"model": {k: v for k, v in request["model"].items() if k != "name_or_path"}},
        reserves=any(t.group != "first" for _, ts in stage_tasks for t in ts),
        prune=bool(cfg.get("prune")),
        tasks={t.name: {"stage": n, "total_s": t.total_s, "group": t.group} for n, ts in stage_tasks for t in ts},
    )
    return out


def task_times(stage: Stage, r: dict, threads: int, probe_batch: int, stop_at=None) -> list[eta.TaskTime]:
    """Each task of the stage (a fused task: its K variants in one pass) at the measured rates."""
    rates = r["by_threads"][str(threads)]
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
                float(r.get("startup_s") or 0.0),
                per_step,
                per_eval,
                int(t.steps),
                int(train.get("eval_every", 0) or 0),
                group,
                stop,
            )
        )
    return out


def pruned_best(tasks: list[eta.TaskTime], stage: Stage, r: dict, threads: int, probe_batch: int) -> list[eta.TaskTime]:
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

    return task_times(stage, r, threads, probe_batch, stop_at)


def lines(fc: dict | None) -> list[str]:
    """One or two lines: the run's wall time and device-hours (and the range), and each stage's."""
    if not fc or "unknown" in fc:
        why = (fc or {}).get("unknown", "nothing measured")
        return [f"forecast: unknown: {why}"]
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
