"""The forecast beside what happened: RUN_DIR/forecast.json (written at plan time, launch/forecast.py) against the
run's measured wall time and device-hours (the report's own figures), for the run and each stage, with the ratio
actual / forecast; the run's rates go back into the calibration cache (artifacts/calibration.py), so the next
forecast of this shape starts from them."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pandas as pd

from slurm_router.analysis.render import fmt

FILE = "forecast.json"


def duration(s: float | None) -> str:
    """'42s', '3m05s', '1h02m'; '-' when not known."""
    if s is None:
        return "-"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def load(run_dir: str | os.PathLike) -> dict | None:
    try:
        data = json.loads((Path(run_dir) / FILE).read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _ratio(actual: float | None, forecast: float | None) -> float | None:
    return actual / forecast if actual and forecast else None


def compare(run_dir: Path, summary: dict, manifest: dict) -> dict | None:
    """summary.json's `forecast`: the forecast, the actual figures and their ratios (None: no forecast.json). A
    forecast.json it cannot read is said in the section, never a report not written."""
    fc = load(run_dir)
    if fc is None:
        return None
    try:
        if manifest.get("state") == "completed":
            remember(fc, summary)
        return _compare(fc, summary, manifest)
    except (KeyError, TypeError, ValueError, AttributeError, OSError) as e:
        return {"unknown": f"forecast.json could not be read ({type(e).__name__}: {e})"}


def _compare(fc: dict, summary: dict, manifest: dict) -> dict:
    if "unknown" in fc:
        return {"unknown": fc["unknown"]}
    header, cost = summary.get("header") or {}, summary.get("cost") or {}
    tasks = manifest.get("tasks") or {}
    stage_walls: dict[str, list[float]] = {}
    for t in tasks.values():
        if t.get("started_at") and t.get("ended_at"):
            stage_walls.setdefault(str(t.get("stage")), []).extend([float(t["started_at"]), float(t["ended_at"])])
    forecast_wall = float(fc["wall_s"]) - float(fc.get("report_s") or 0.0)
    actual_wall = header.get("wall_s")
    rows = [
        ("wall time (s)", forecast_wall, actual_wall),
        ("device-hours", fc["device_hours"], header.get("device_hours")),
        ("training device-hours", fc["split_device_hours"]["train"], cost.get("train_device_hours")),
        ("evaluation device-hours", fc["split_device_hours"]["eval"], cost.get("eval_device_hours")),
    ]
    by_stage: dict[str, dict] = {}
    for s in fc.get("stages") or []:
        stage = str(s["name"]).split(" ")[0]
        by_stage.setdefault(stage, {"forecast_wall_s": 0.0, "forecast_device_hours": 0.0})
        by_stage[stage]["forecast_wall_s"] += s["wall_s"]
        by_stage[stage]["forecast_device_hours"] += s["device_hours"]
    for stage, b in by_stage.items():
        ends = stage_walls.get(stage)
        b["actual_wall_s"] = max(ends) - min(ends) if ends else None
        b["wall_ratio"] = _ratio(b["actual_wall_s"], b["forecast_wall_s"])
    low = fc.get("low") or {}
    return {
        "source": fc.get("source"),
        "rows": [
            {"what": what, "forecast": f, "actual": a, "ratio": _ratio(a, f)} for what, f, a in rows if f is not None
        ],
        "stages": by_stage,
        "low_wall_s": (low.get("wall_s") or 0.0) - float(fc.get("report_s") or 0.0) if low else None,
        "low_device_hours": low.get("device_hours") if low else None,
        "ranged": bool(fc.get("reserves") or fc.get("prune")),
    }


def section(summary: dict) -> list[tuple]:
    """The report's 'Forecast and what happened' section; [] without a forecast."""
    f = summary.get("forecast")
    if not f:
        return []
    if "unknown" in f:
        return [("h", 2, "Forecast and what happened"), ("p", f"No forecast was made: {f['unknown']}.")]
    table = pd.DataFrame(
        [
            {
                "": r["what"],
                "forecast": duration(r["forecast"]) if r["what"].startswith("wall") else fmt(r["forecast"], ".4f"),
                "actual": duration(r["actual"]) if r["what"].startswith("wall") else fmt(r["actual"], ".4f"),
                "actual / forecast": fmt(r["ratio"], ".2f"),
            }
            for r in f["rows"]
        ]
    )
    notes = [
        f"Forecast at plan time from throughput measured on this machine ({f['source']}), saved in forecast.json; "
        "wall time: from the run's start to its last task's end (the report after it is not counted)."
    ]
    if f.get("ranged") and f.get("low_wall_s") is not None:
        notes.append(
            f"The forecast above is the upper end (every reserve, every step); its lower end (seeds=auto's first round "
            f"only, prune=true's best case) was {duration(f['low_wall_s'])}, {fmt(f['low_device_hours'], '.4f')} "
            "device-hours."
        )
    return [("h", 2, "Forecast and what happened"), ("table", table), ("p", " ".join(notes))]


def measured_rates(summary: dict, fc: dict) -> dict[str, dict]:
    """Per stage, what the run measured in the calibration's units, from the report's cost rows of the tasks that
    trained alone and to the end: the forecast's rate x (measured / forecast) for a step and for one evaluation, and
    a task's start-up (its time outside training and evaluation)."""
    cost = (summary.get("cost") or {}).get("tasks") or {}
    rates = fc.get("rates") or {}
    out: dict[str, dict] = {}
    for stage, threads in (fc.get("threads") or {}).items():
        ratios, starts, evals = [], [], []
        for name, c in cost.items():
            f = (fc.get("tasks") or {}).get(name)
            if not f or f["stage"] != stage or c.get("share", 1.0) != 1.0 or not c.get("steps_per_s"):
                continue
            if c.get("state") != "completed" or not f.get("steps") or not f.get("train_s"):
                continue
            ratios.append((1.0 / float(c["steps_per_s"])) / (float(f["train_s"]) / int(f["steps"])))
            per_device = 3600 / max(1, int(c.get("devices") or 1))
            parts = sum(float(c.get(k) or 0.0) for k in ("train_device_hours", "eval_device_hours"))
            starts.append(max(0.0, (float(c.get("device_hours") or 0.0) - parts) * per_device))
            if c.get("evaluations") and f.get("evals") and f.get("eval_s"):  # one evaluation, measured / forecast
                one = float(c.get("eval_device_hours") or 0.0) * per_device / int(c["evaluations"])
                evals.append(one / (float(f["eval_s"]) / int(f["evals"])))
        old = rates.get(str(threads)) or {}
        key = "step_s" if stage == "base" else "lora_step_s"
        if ratios and old.get(key):
            out[stage] = {key: float(old[key]) * statistics.median(ratios)}
            if starts:
                out[stage]["startup_s"] = statistics.median(starts)
            if evals and old.get("eval_batch_s"):
                out[stage]["eval_batch_s"] = float(old["eval_batch_s"]) * statistics.median(evals)
    return out


def remember(fc: dict, summary: dict) -> None:
    """The run's own rates into the calibration cache (artifacts/calibration.py) under forecast.json's key."""
    from slurm_router.artifacts.calibration import record_measured

    threads, path, k = fc.get("threads") or {}, fc.get("cache_file"), fc.get("calibration_key")
    if not path or not k:
        return
    for stage, rates in measured_rates(summary, fc).items():
        if stage in threads:
            record_measured(path, k, int(threads[stage]), rates)
