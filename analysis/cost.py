"""What each verdict cost (issue 38, 4): device-hours in all, per variant and per task (seed), split into
training, evaluation and the rest; to the decision (up to the evaluation at which the winner was first decided);
and what the fixed design (every seed of every variant trained to the end) would have cost. Pure pandas over the
loaded events (load.py) and each task's device-hours as the report counts them (report.py; a fused task's shared
among its variants by fused.py, so the run counts it once).

- Training: the rank-0 step rows' t_step_s (every attempt: a requeued step cost twice). Evaluation: the eval rows'
  t_eval_s (older rows: the time since the row before them); a fused group's evaluation is the longest of its
  variants' rows at that step (they count from the group's start), shared like its device-hours. Waiting: the
  `wait` rows' waited_s (a seeds=auto reserve that held its devices until its round's call). Other: the rest
  (start-up, checkpoints, waiting between steps). Each is seconds x devices x the task's share.
- Fixed design, priced from the planned design: every planned task's spending without its waiting (the fixed
  design waits for no call), plus, for each pruned task or reserve not run, the steps it did not train at its own
  pace (its steps / its summed step time) and the evaluations it skipped at its mean evaluation time (a fused
  variant: its part of the group's tokens at the steps it trained, of each). A run that waited more than it saved
  reports a negative saving.
- To the decision: the evaluation step from which on the verdict's own code (winner.winner on every task's
  evaluations up to that step, the tasks pruned by then left out) names the final winner as decided at every
  later evaluation; each task counts what it spent up to its evaluation at that step (all of it when it ended
  before). Under seeds=auto a later round starts once the rounds before it ended, so a task of a round before the
  latest one with evaluations by that step counts all it spent; a round after it, nothing.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import pandas as pd

from slurm_router.analysis import abtest
from slurm_router.analysis import winner as winners
from slurm_router.analysis.load import Task, of_kind
from slurm_router.analysis.render import fmt, pct
from slurm_router.config.metrics import LOSS
from slurm_router.rundir.events import EvalRow, StepRow, WaitRow

PARTS = ("train", "eval", "wait", "other")


def _rank0(task: Task) -> pd.DataFrame:
    ev = task.events
    return ev[ev["device"] == ev["device"].min()] if task.has_events else ev


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def eval_seconds(task: Task) -> pd.DataFrame:
    """Every rank-0 eval row of every attempt: attempt, step, time, eval_s (t_eval_s, else the gap since the row
    before it in that attempt: the step, start or checkpoint row that precedes an evaluation)."""
    cols = ["attempt", "step", "time", "eval_s"]
    r0 = _rank0(task)
    if r0.empty:
        return pd.DataFrame(columns=cols)
    r0 = r0.sort_values(["attempt", "time"], kind="stable")
    prev = r0.groupby("attempt")["time"].shift(1)
    evals = of_kind(r0, EvalRow)
    if evals.empty:
        return pd.DataFrame(columns=cols)
    given = [_num(v) for v in evals["t_eval_s"]] if "t_eval_s" in evals else [None] * len(evals)
    gap = (evals["time"] - prev[evals.index]).clip(lower=0).fillna(0.0)
    out = evals[["attempt", "step", "time"]].astype({"attempt": int, "step": int})
    out["eval_s"] = [g if g is not None else float(x) for g, x in zip(given, gap)]
    return out.reset_index(drop=True)


def _spans(task: Task, until: float | None = None) -> float:
    """Seconds the task's attempts ran (each attempt: first to last row), cut at `until` (unix time)."""
    if not task.has_events:
        return 0.0
    ev = task.events if until is None else task.events[task.events["time"] <= until]
    return float(ev.groupby("attempt")["time"].agg(lambda t: t.max() - t.min()).sum()) if len(ev) else 0.0


def _group(task: Task) -> str:
    return str(task.meta.get("fused_into") or task.name)


def _per_group(frames: dict[str, pd.DataFrame], column: str) -> dict[str, float]:
    """Per group (a fused task, else a task alone): the sum over its (attempt, step) of the longest row's
    `column` (a fused group's variants each write the group's step time; their eval rows count from its start)."""
    rows = pd.concat([f for f in frames.values() if len(f)] or [pd.DataFrame(columns=["group", column])])
    if rows.empty:
        return {}
    return rows.groupby(["group", "attempt", "step"])[column].max().groupby(level="group").sum().to_dict()


def _step_share(task: Task, tasks: list[Task]) -> float:
    """A fused variant's part of its group's tokens at the steps it trained (1 for a task alone): what one more
    of its steps adds to the group's step."""
    group = [t for t in tasks if _group(t) == _group(task) and len(t.steps)]
    if len(group) < 2 or not len(task.steps):
        return 1.0
    mine = set(task.steps["step"])
    total = sum(float(t.steps.loc[t.steps["step"].isin(mine), "n_tokens"].sum()) for t in group)
    return float(task.steps["n_tokens"].sum()) / total if total > 0 else 1.0 / len(group)


def _step_times(task: Task) -> pd.DataFrame:
    """Rank 0's step rows (attempt, step, t_step_s) with the task's group; none for a task that never stepped (a
    stage that failed at start-up: its rows are start and end)."""
    cols = ["attempt", "step", "t_step_s"]
    rows = of_kind(_rank0(task), StepRow)
    return (rows[cols] if all(c in rows for c in cols) else pd.DataFrame(columns=cols)).assign(group=_group(task))


def task_costs(tasks: list[Task], hours: dict[str, float | None], shares: dict[str, float] | None = None) -> dict:
    """Per task: its device-hours (as given: the report's, a fused variant's share of its task) split into train,
    eval and other (a fused group's own step and evaluation times, shared like its device-hours), its pace, and
    for a pruned task what the rest of its steps and evaluations would have cost."""
    shares = shares or {}
    evals = {t.name: eval_seconds(t).assign(group=_group(t)) for t in tasks}
    steps = {t.name: _step_times(t) for t in tasks if t.has_events}
    group_eval, group_train = _per_group(evals, "eval_s"), _per_group(steps, "t_step_s")
    n_evals = pd.concat([e for e in evals.values() if len(e)] or [pd.DataFrame(columns=["group"])])
    n_evals = (
        n_evals.drop_duplicates(["group", "attempt", "step"])["group"].value_counts().to_dict() if len(n_evals) else {}
    )
    eval_steps = sorted({int(s) for t in tasks if t.stage != "base" and len(t.evals) for s in t.evals["step"]})
    paces = _paces(tasks)
    out: dict[str, dict] = {}
    for t in tasks:
        share, devices, g = shares.get(t.name, 1.0), t.n_devices or 1, _group(t)
        dh = hours.get(t.name) or 0.0
        scale = devices * share / 3600
        train, ev = min(dh, group_train.get(g, 0.0) * scale), min(dh, group_eval.get(g, 0.0) * scale)
        wait = min(max(0.0, dh - train - ev), waited_s(t) * scale)
        pace_s = float(t.steps["t_step_s"].sum()) if len(t.steps) else 0.0
        row: dict[str, Any] = {
            "variant": None if t.stage == "base" else t.variant,
            "stage": t.stage,
            "seed": t.seed,
            "state": "pruned"
            if t.pruned
            else "not_needed"
            if t.not_needed
            else "diverged"
            if t.diverged
            else t.meta.get("state"),
            "devices": devices,
            "share": share,
            "device_hours": dh,
            "train_device_hours": train,
            "eval_device_hours": ev,
            "wait_device_hours": wait,
            "other_device_hours": max(0.0, dh - train - ev - wait),
            "steps": int(len(t.steps)),
            "expected_steps": t.expected_steps,
            "steps_per_s": len(t.steps) / pace_s if pace_s > 0 else None,
            "evaluations": int(len(evals[t.name])),
            "remaining_steps": 0,
            "remaining_evaluations": 0,
            "remaining_device_hours": 0.0,
        }
        pace = row["steps_per_s"] or paces.get(t.variant) or paces.get(None)  # pruned before its first step: its
        ended = t.pruned or t.not_needed  # a seeds=auto reserve never run: the fixed design trains it whole
        if ended and t.expected_steps and pace:  # variant's other replicates' pace, else every task's
            stopped = ended["step"] if ended["step"] is not None else len(t.steps)
            rest = max(0, t.expected_steps - stopped)
            skipped = len([s for s in eval_steps if stopped < s < t.expected_steps]) + 1  # + the final one
            mean_eval = group_eval.get(g, 0.0) / n_evals[g] if n_evals.get(g) else 0.0
            per_step = devices * _step_share(t, tasks) / 3600
            row.update(remaining_steps=rest, remaining_evaluations=skipped)
            row["remaining_device_hours"] = (rest / pace + skipped * mean_eval) * per_step
        row["fixed_design_device_hours"] = dh - wait + row["remaining_device_hours"]
        out[t.name] = row
    return out


def waited_s(task: Task) -> float:
    """Seconds the task's job held its devices before its workers started (its `wait` rows, every attempt)."""
    rows = of_kind(task.events, WaitRow) if task.has_events else task.events
    return float(rows["waited_s"].fillna(0).sum()) if "waited_s" in rows else 0.0


def _paces(tasks: list[Task]) -> dict[str | None, float]:
    """Steps per second: the median over each variant's replicates that trained, and over all of them (None)."""
    own = {t.name: (t.variant, len(t.steps) / float(t.steps["t_step_s"].sum())) for t in tasks if _trained(t)}
    out: dict[str | None, float] = {}
    for variant in {v for v, _ in own.values()}:
        out[variant] = statistics.median(p for v, p in own.values() if v == variant)
    if own:
        out[None] = statistics.median(p for _, p in own.values())
    return out


def _trained(t: Task) -> bool:
    return t.stage != "base" and len(t.steps) > 0 and float(t.steps["t_step_s"].sum()) > 0


def at_step(task: Task, step: int) -> Task:
    """The task as it stood at evaluation `step`: its evaluations up to it; pruned or diverged only if by then."""
    evals = task.evals[task.evals["step"] <= step] if len(task.evals) else task.evals
    ended = task.end if task.end and task.end.get("step") is not None and task.end["step"] <= step else None
    return dataclasses.replace(task, evals=evals.reset_index(drop=True), end=ended)


def _judge(view: list[Task], metric: str) -> dict | None:
    """The verdict's winner on these tasks (abtest), on held-out loss or the primary task metric."""
    if metric == LOSS:
        return winners.winner(view, abtest.compare_all(view))
    return winners.winner(view, abtest.compare_all(view, None, metric), None, metric)


def decision(tasks: list[Task], final: dict | None) -> int | None:
    """The evaluation step from which on the verdict (abtest, on the final winner's metric, over every task's
    evaluations up to that step) names the final winner as decided at every later evaluation; None when the
    final verdict is not decided."""
    if not final or not final.get("decided"):
        return None
    steps = sorted({int(s) for t in tasks if t.stage != "base" and len(t.evals) for s in t.evals["step"] if s > 0})
    first = None
    for step in reversed(steps):
        w = _judge([at_step(t, step) for t in tasks], str(final.get("metric") or LOSS))
        if not (w and w["decided"] and w["variant"] == final["variant"]):
            break
        first = step
    return first


def to_decision(
    tasks: list[Task], costs: dict[str, dict], step: int, rounds: dict[str, int] | None = None
) -> dict[str, float]:
    """Per task, the device-hours it spent up to its evaluation at `step` (all it spent when it ended before).
    rounds (seeds=auto: each replicate's round): a round before the latest with evaluations by `step` counts in
    full (that round could start only once they had ended), a later one not at all."""
    rounds = rounds or {}
    by_then = [rounds[t.name] for t in tasks if t.name in rounds and len(t.evals) and (t.evals["step"] <= step).any()]
    latest = max(by_then, default=0)
    out = {}
    for t in tasks:
        dh = costs[t.name]["device_hours"]
        if t.name in rounds and rounds[t.name] != latest:
            out[t.name] = dh if rounds[t.name] < latest else 0.0
            continue
        at = t.evals[t.evals["step"] == step]["time"] if len(t.evals) and "time" in t.evals else pd.Series()
        whole = _spans(t)
        if t.stage == "base" or at.empty or whole <= 0:
            out[t.name] = dh
            continue
        out[t.name] = dh * min(1.0, _spans(t, float(at.iloc[-1])) / whole)
    return out


def _sum(rows: list[dict], key: str) -> float:
    return float(sum(r[key] or 0.0 for r in rows))


def account(
    tasks: list[Task], per_task: dict[str, dict], winner: dict | None, rounds: dict[str, int] | None = None
) -> dict:
    """summary.json's `cost`: in all, per variant, per task, to the decision, the fixed design (rounds: seeds=auto's
    round of each replicate, analysis/contest.py rounds)."""
    hours = {n: s.get("device_hours") for n, s in per_task.items()}
    shares = {n: s["fused"]["token_share"] for n, s in per_task.items() if s.get("fused")}
    costs = task_costs(tasks, hours, shares)
    rows = list(costs.values())
    keys = ["device_hours", *(f"{p}_device_hours" for p in PARTS), "fixed_design_device_hours"]
    by_variant: dict[str, dict] = {}
    for name, c in costs.items():
        v = by_variant.setdefault(c["variant"] or "base", {k: 0.0 for k in keys} | {"tasks": [], "pruned": []})
        v["tasks"].append(name)
        v["pruned"] += [name] if c["state"] in ("pruned", "not_needed") else []  # stopped early, or never run
        for k in keys:
            v[k] += c[k] or 0.0
    step = decision([t for t in tasks if not t.not_needed], winner)  # the verdict's tasks (report.analyze)
    spent = _sum(rows, "device_hours")
    fixed = _sum(rows, "fixed_design_device_hours")
    decided: dict[str, Any] = {"decided": step is not None, "step": step, "device_hours": None, "winner": None}
    if step is not None and winner:
        upto = to_decision(tasks, costs, step, rounds)
        decided.update(device_hours=float(sum(upto.values())), winner=winner["variant"])
        for name, c in costs.items():
            c["to_decision_device_hours"] = upto[name]
    decided["text"] = f"decided at the evaluation at step {step}" if step is not None else "not decided"
    return {
        "device_hours": spent,
        **{f"{p}_device_hours": _sum(rows, f"{p}_device_hours") for p in PARTS},
        "fixed_design_device_hours": fixed,
        "saved_device_hours": fixed - spent,
        "to_decision": decided,
        "by_variant": by_variant,
        "tasks": costs,
    }


def section(summary: dict) -> list[tuple]:
    """The report's 'What the verdict cost' section; [] when the run spent nothing measurable yet."""
    c = summary.get("cost") or {}
    spent = c.get("device_hours")
    if not spent:
        return []
    d, fixed = c["to_decision"], c["fixed_design_device_hours"]
    split = ", ".join(
        f"{what} {c.get(f'{p}_device_hours') or 0.0:.4f}"
        for p, what in zip(PARTS, ("training", "evaluation", "waiting for a call", "other"))
    )
    lines = [f"device-hours in all: {spent:.4f} ({split}: start-up, checkpoints, gaps between steps)"]
    lines.append(
        f"to the decision: {d['device_hours']:.4f} device-hours ({pct(d['device_hours'] / spent)} of the run), "
        f"{d['text']} ({d['winner']} the winner)"
        if d["decided"]
        else "to the decision: not decided (the verdict names no decided winner), so the whole run was spent on it"
    )
    pruned = sum(len(v["pruned"]) for v in c["by_variant"].values())
    waited, saved = c.get("wait_device_hours") or 0.0, c["saved_device_hours"]
    how = (
        f"estimated from the {pruned} pruned (or seeds=auto not run) tasks' own pace (the steps each did not train, "
        "at its steps/s or its variant's; the evaluations it skipped, at its mean evaluation time)"
        if pruned
        else "no task was pruned: what the run spent"
    ) + (", less the time reserves waited for their call (the fixed design waits for none)" if waited else "")
    lines.append(
        f"the fixed design (every seed of every variant trained to the end): {fixed:.4f} device-hours ({how}); "
        + (
            f"the run saved {saved:.4f} ({pct(saved / fixed)})"
            if saved >= 0
            else f"the run cost {-saved:.4f} more ({pct(-saved / fixed)}): its reserves waited longer than pruning saved"
        )
        if pruned or waited
        else f"the fixed design (every seed of every variant trained to the end): {fixed:.4f} device-hours ({how})"
    )
    rows = [
        {
            "variant": v,
            "tasks": len(x["tasks"]),
            "pruned": len(x["pruned"]),
            "device-hours": fmt(x["device_hours"], ".4f"),
            "training": fmt(x["train_device_hours"], ".4f"),
            "evaluation": fmt(x["eval_device_hours"], ".4f"),
            "waiting": fmt(x.get("wait_device_hours"), ".4f"),
            "other": fmt(x["other_device_hours"], ".4f"),
            "fixed design": fmt(x["fixed_design_device_hours"], ".4f"),
        }
        for v, x in c["by_variant"].items()
    ]
    return [
        ("h", 2, "What the verdict cost"),
        ("ul", lines),
        ("table", pd.DataFrame(rows)),
        (
            "p",
            "Device-hours: devices x wall time, a fused task's shared among its variants by tokens (counted once). "
            "Training: the step times; evaluation: each evaluation's wall time (held-out loss and eval.metrics); "
            "waiting: a seeds=auto reserve holding its devices until its round's call (none locally: the queue starts a "
            "reserve once it is called); other: the rest. Per task (seed): summary.json's cost.tasks. What the figures mean: docs/decisions.md.",
        ),
    ]
