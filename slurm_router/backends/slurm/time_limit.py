"""launcher.time_limit=auto: each stage's array tasks get a --time from the run's forecast (RUN_DIR/forecast.json,
launch/forecast.py): the stage's longest task forecast x MARGIN + SLACK_S, so a task neither waits in the queue for
an hour it does not need nor dies at its limit (a task near its limit still checkpoints and requeues). Without a
forecast (no throughput measured for this shape on the cluster's devices yet) launcher.timeout_min holds."""

from __future__ import annotations

import math

from slurm_router.errors import UserError

AUTO = "auto"
MARGIN = 1.5  # the forecast's noise here is within 30%; half again covers it and a slower node
SLACK_S = 300.0  # plus five minutes: the job's own start (the setup lines, a container) and the report of a task
FLOOR_MIN = 5


def check(cfg) -> None:
    """launcher.time_limit: auto or unset; anything else is one line saying what to set."""
    value = cfg.launcher.get("time_limit")
    if value is None or str(value) == AUTO:
        return
    raise UserError(
        f"launcher.time_limit={value}: set launcher.time_limit=auto (each array task's --time from the run's forecast, "
        f"with a margin) or leave it unset; a fixed limit is launcher.timeout_min=MINUTES "
        f"(now {cfg.launcher.get('timeout_min')})"
    )


def stage_minutes(cfg, stage: str, run_dir: str | None) -> int:
    """The --time (minutes) of one stage's array tasks: launcher.timeout_min, or with time_limit=auto the forecast's
    longest task of the stage with the margin (launcher.timeout_min when there is no forecast)."""
    fixed = int(cfg.launcher.timeout_min)
    if str(cfg.launcher.get("time_limit")) != AUTO or not run_dir:
        return fixed
    from slurm_router.analysis.forecast import load

    fc = load(run_dir) or {}
    longest = [float(t["total_s"]) for t in (fc.get("tasks") or {}).values() if t.get("stage") == stage]
    if "unknown" in fc or not longest:
        return fixed
    return max(FLOOR_MIN, math.ceil((max(longest) * MARGIN + SLACK_S) / 60))
