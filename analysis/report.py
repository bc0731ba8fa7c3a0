"""The run report: summary.json, steps.csv and a terminal table, from events + manifest only.

balance_ratio = mean over steps of (slowest device busy time / mean device busy time): 1.0 means every
device finished its share together. Throughput leaves out warm-up steps (the first WARMUP_FRACTION, at
least one step) because they include start-up costs (allocator, caches) that later steps do not pay.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from slurm_router.checkpoint import atomic_write_text
from slurm_router.events import read_events

WARMUP_FRACTION = 0.1


class ReportError(Exception):
    """The run dir cannot be reported on (missing manifest, garbage events): one line for the user."""


def load_events(task_dir: Path) -> pd.DataFrame:
    rows = []
    for path in sorted(task_dir.glob("events-*.jsonl")):
        try:
            rows.extend(read_events(path))
        except (ValueError, OSError) as e:
            raise ReportError(f"{e}: the events file is damaged; remove it to report on the rest") from None
    return pd.DataFrame(rows)


def _warm(steps: pd.DataFrame) -> pd.DataFrame:
    n = int(steps["step"].max()) + 1 if len(steps) else 0
    skip = max(1, int(n * WARMUP_FRACTION)) if n > 1 else 0
    return steps[steps["step"] >= skip]


def task_summary(ev: pd.DataFrame, task_meta: dict) -> dict:
    out = {"steps": 0, "devices": task_meta.get("devices"), "policy": None, "state": task_meta.get("state")}
    if ev.empty:
        return out
    steps = ev[(ev["event"] == "step") & (ev["device"] == 0)].drop_duplicates("step", keep="last")
    steps = steps.sort_values("step")
    evals = ev[(ev["event"] == "eval") & (ev["device"] == 0)].sort_values("step")
    out["policy"] = ev["policy"].dropna().iloc[0] if "policy" in ev else None
    out["steps"] = int(len(steps))
    if len(evals):
        out["val_loss"] = float(evals["val_loss"].iloc[-1])
        out["val_loss_start"] = float(evals["val_loss"].iloc[0])
    if len(steps):
        tail = steps["loss"].iloc[-max(1, len(steps) // 10):]
        out["train_loss"] = float(tail.mean())
        warm = _warm(steps)
        out["tokens_per_s"] = float(warm["n_tokens"].sum() / warm["t_step_s"].sum()) if warm["t_step_s"].sum() else None
        busy = steps["busy_s_all"].apply(lambda b: max(b) / (sum(b) / len(b)) if sum(b) else 1.0)
        out["balance_ratio"] = float(busy.mean())
        if "cost_balance_ratio" in steps:
            out["cost_balance_ratio"] = float(steps["cost_balance_ratio"].mean())
        out["devices"] = int(len(steps["busy_s_all"].iloc[0]))
    return out


def write_report(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    manifest_path = run_dir / "manifest.json"
    if not manifest_path.is_file():
        raise ReportError(f"{run_dir} has no manifest.json: give a run directory made by python -m slurm_router")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        raise ReportError(f"{manifest_path} is not valid JSON: the run directory is damaged") from None
    summary = {"experiment": manifest.get("experiment"), "run_dir": str(run_dir), "state": manifest.get("state"),
               "base": {"val_loss": None}, "variants": {}}
    step_rows = []
    for name, meta in manifest.get("tasks", {}).items():
        task_dir = run_dir / "tasks" / name
        ev = load_events(task_dir)
        s = task_summary(ev, meta)
        if meta.get("stage") == "base":
            result = task_dir / "result.json"
            summary["base"] = {"val_loss": json.loads(result.read_text())["val_loss"] if result.is_file()
                               else s.get("val_loss"), "state": meta.get("state")}
            continue
        summary["variants"][name] = s
        if not ev.empty:
            st = ev[(ev["event"] == "step") & (ev["device"] == 0)].drop_duplicates("step", keep="last")
            for r in st.sort_values("step").itertuples():
                step_rows.append({"variant": name, "step": r.step, "loss": r.loss, "tokens": r.n_tokens,
                                  "step_time_s": r.t_step_s})
    if summary["base"]["val_loss"] is None:
        # No base stage (a local checkpoint): each variant's step-0 held-out loss is the base's.
        starts = [v["val_loss_start"] for v in summary["variants"].values() if "val_loss_start" in v]
        summary["base"]["val_loss"] = starts[0] if starts else None
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    atomic_write_text(out / "steps.csv", pd.DataFrame(step_rows, columns=["variant", "step", "loss", "tokens",
                                                                           "step_time_s"]).to_csv(index=False))
    return summary


def print_table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"{summary['experiment']}: held-out loss (nats/token) and routing")
    for col in ("variant", "val_loss", "train_loss", "tokens/s", "balance", "steps", "devices", "policy"):
        t.add_column(col, justify="left" if col in ("variant", "policy") else "right")
    fmt = lambda x, f: "-" if x is None else format(x, f)
    base = summary["base"].get("val_loss")
    t.add_row("base", fmt(base, ".4f"), "", "", "", "", "", "")
    for name, v in summary["variants"].items():
        t.add_row(name, fmt(v.get("val_loss"), ".4f"), fmt(v.get("train_loss"), ".4f"),
                  fmt(v.get("tokens_per_s"), ",.0f"), fmt(v.get("balance_ratio"), ".3f"), str(v.get("steps")),
                  str(v.get("devices")), str(v.get("policy")))
    Console(width=120).print(t)
