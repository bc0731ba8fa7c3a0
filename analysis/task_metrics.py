"""The report's task-metric views (eval.metrics, docs/metrics.md) beside the verdict (abtest.py): each metric's
curve over steps (report/metrics.csv and metric_curves.png) and the examples on which the leader and the
runner-up differ most."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from slurm_router.analysis import abtest
from slurm_router.analysis.load import Task
from slurm_router.config.metrics import LOSS
from slurm_router.verdict import stats

COLUMNS = ["task", "variant", "step", "metric", "mean", "n_examples"]


def curves(tasks: list[Task]) -> pd.DataFrame:
    """One row per task, evaluation and task metric: its mean score over the examples (the trackers' eval/NAME)."""
    rows = []
    for t in tasks:
        if t.evals.empty or "metrics" not in t.evals:
            continue
        for step, metrics in zip(t.evals["step"], t.evals["metrics"]):
            for name, m in (metrics if isinstance(metrics, dict) else {}).items():
                s = m.get("scores") or []
                rows.append([t.name, t.variant, int(step), name, float(np.mean(s)) if s else None, len(s)])
    return pd.DataFrame(rows, columns=COLUMNS)


def disagreements(tasks: list[Task], metric: str, winner: dict | None, k: int = 5) -> dict | None:
    """The k examples on which the leader (the winner row's variant) and the runner-up (the next best mean score)
    differ most, their scores averaged over each one's trained seeds: {metric, leader, runner_up, examples:
    [{example, leader, runner_up}]}; None without a task metric or two variants scored."""
    if not winner or metric == "loss":
        return None
    groups = abtest.replicates(tasks, metric)
    means = {}
    for variant, reps in groups.items():
        side = abtest.trained(reps)
        if side:  # metric_side's signed scores: lower is better; the example's mean over seeds
            means[variant] = np.mean([np.asarray(r["loss_sums"], float) for r in side.values()], axis=0)
    if winner["variant"] not in means or len(means) < 2:
        return None
    lead = winner["variant"]
    runner = min((v for v in means if v != lead), key=lambda v: float(means[v].mean()))
    a, b = means[lead], means[runner]
    if a.shape != b.shape:
        return None
    sign = -1.0 if metric_directions(tasks).get(metric, True) else 1.0  # back to the metric's own scores
    order = np.argsort(-np.abs(a - b), kind="stable")[:k]
    best = {
        v: min(abtest.trained(groups[v]).items(), key=lambda kv: float(np.sum(kv[1]["loss_sums"])))
        for v in (lead, runner)
    }
    seen = {
        v: _last_entry(tasks, metric, next(r.task for r in groups[v] if r.key == best[v][0])) for v in (lead, runner)
    }
    examples = []
    for i in order:
        if a[i] == b[i]:
            continue
        e: dict[str, Any] = {
            "example": int(i),
            "leader": float(sign * a[i]) + 0.0,
            "runner_up": float(sign * b[i]) + 0.0,
        }
        prompts = seen[lead].get("prompts") or []
        e.update(prompt=prompts[i] if i < len(prompts) else None)
        for who, v in (("leader_output", lead), ("runner_up_output", runner)):
            outputs = seen[v].get("outputs") or []
            e[who] = outputs[i] if i < len(outputs) else None
        examples.append(e)
    return {"metric": metric, "leader": lead, "runner_up": runner, "examples": examples}


def _last_entry(tasks: list[Task], metric: str, task: str) -> dict:
    """The task's last eval row's entry of `metric` (scores, prompts, outputs), or {}."""
    t = next((t for t in tasks if t.name == task), None)
    if t is None or t.evals.empty or "metrics" not in t.evals:
        return {}
    entries = [m[metric] for m in t.evals["metrics"] if isinstance(m, dict) and metric in m]
    return entries[-1] if entries else {}


def disagreement_lines(d: dict | None) -> list[str]:
    """The report's lines for disagreements(): one per example."""
    if not d or not d["examples"]:
        return []
    lines = []
    for e in d["examples"]:
        said = (
            f": prompt {e['prompt']!r}, {d['leader']} answered {e.get('leader_output')!r}, {d['runner_up']} "
            f"{e.get('runner_up_output')!r} (their best seeds)"
            if e.get("prompt") is not None or e.get("leader_output") is not None
            else ""
        )
        lines.append(
            f"example {e['example']}: {d['leader']} {e['leader']:.3g}, {d['runner_up']} {e['runner_up']:.3g} "
            f"({d['metric']}, mean over seeds){said}"
        )
    return lines


def plot_curves(table: pd.DataFrame, out: Path) -> str | None:
    """metric_curves.png: each task metric's mean score over steps, one line per task; None without metrics."""
    if table.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(table["metric"]))
    fig, axes = plt.subplots(1, len(names), figsize=(6.4 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for task, rows in table[table["metric"] == name].groupby("task", sort=False):
            rows = rows.sort_values("step")
            ax.plot(rows["step"], rows["mean"], marker="o", label=str(task))
        ax.set_title(f"{name} (mean over examples)")
        ax.set_xlabel("step")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "metric_curves.png", dpi=100)
    plt.close(fig)
    return "metric_curves.png"


def metric_directions(tasks: list[Task]) -> dict[str, bool]:
    """The task metrics (eval.metrics) the run's eval rows hold: name -> higher_is_better, in first-seen order."""
    out: dict[str, bool] = {}
    for t in tasks:
        if t.evals.empty or "metrics" not in t.evals:
            continue
        for m in t.evals["metrics"]:
            for name, entry in (m if isinstance(m, dict) else {}).items():
                out.setdefault(name, bool(entry.get("higher_is_better", True)))
    return out


def metric_table(tasks: list[Task]) -> dict[str, dict[str, dict]]:
    """Per variant, per metric (held-out loss and each task metric): the mean over its trained seeds (and eval
    batches or examples) and its 95% interval, training noise and example noise in it, examples that share a
    source as one cluster (stats.mean_interval)."""
    out: dict[str, dict[str, dict]] = {}
    for metric, higher in {LOSS: False, **metric_directions(tasks)}.items():
        for variant, reps in abtest.replicates(tasks, metric).items():
            side = abtest.trained(reps)
            if not side:
                continue
            try:
                mean, lo, hi = stats.mean_interval(side)
            except ValueError:  # one seed of one eval batch: no spread to measure
                continue
            if higher:  # back to the metric's own direction (metric_side negated it; no -0.0)
                mean, lo, hi = -mean + 0.0, -hi + 0.0, -lo + 0.0
            n = len(next(iter(side.values()))["loss_sums"])
            row = {"mean": mean, "ci_low": lo, "ci_high": hi, "n_seeds": len(side), "n": n, "higher_is_better": higher}
            out.setdefault(variant, {})[metric] = row
    return out
