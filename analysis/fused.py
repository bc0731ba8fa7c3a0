"""Fused groups in the report and comparisons (issue 41, 2; resources.fuse_variants): the variants that trained as
one task over one shared base. A group's step time, memory, CPU and device-hours belong to the task, which the
manifest lists under its leader (its `members` fused_into it); each variant's own step rows hold its own samples
and tokens. So each variant gets its share of the task by tokens (its device-hours, its memory), its own tokens/s
beside the group's, and the group's time split and job facts, said to be the group's; the run's device-hours count
the task once (the shares add up to it)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from slurm_router.analysis.load import Task
from slurm_router.analysis.render import fmt, gib, pct


def groups(tasks: list[Task]) -> dict[str, list[str]]:
    """leader -> [leader, *members] for each fused task of the run (the manifest's members / fused_into)."""
    names = {t.name for t in tasks}
    out: dict[str, list[str]] = {}
    for t in tasks:
        members = [m for m in t.meta.get("members") or [] if m in names]
        if members and not t.meta.get("fused_into"):
            out[t.name] = [t.name, *members]
    return out


def _total(task: Task, column: str) -> float:
    return float(task.steps[column].sum()) if len(task.steps) and column in task.steps else 0.0


def apply(per_task: dict[str, dict], tasks: list[Task]) -> None:
    """Each fused variant's summary gets `fused` (its group, its share, the group's figures); a member takes the
    group's time split, memory and job facts (its own events hold none: the micro and telemetry rows are the
    leader's); device-hours become each variant's share of the task's, so the run counts the task once."""
    by_name = {t.name: t for t in tasks}
    for leader, names in groups(tasks).items():
        lead = per_task[leader]
        tokens = {n: _total(by_name[n], "n_tokens") for n in names}
        samples = {n: _total(by_name[n], "n_samples") for n in names}
        all_tokens = sum(tokens.values())
        rates = [per_task[n].get("tokens_per_s") for n in names]
        group_rate = sum(r for r in rates if r) or None
        hours = max((per_task[n].get("device_hours") or 0.0 for n in names), default=0.0) or None
        peak = (lead.get("memory") or {}).get("peak_bytes")
        for n in names:
            s = per_task[n]
            share = tokens[n] / all_tokens if all_tokens else 1 / len(names)
            s["fused"] = {
                "task": leader,
                "variants": names,
                "samples": int(samples[n]),
                "tokens": int(tokens[n]),
                "token_share": share,
                "memory_share_bytes": peak * share if peak else None,
                "group_tokens_per_s": group_rate,
                "group_device_hours": hours,
            }
            s["device_hours"] = hours * share if hours else None
            start, end = s.get("val_loss_start"), s.get("val_loss")
            if start is not None and end is not None and s["device_hours"]:
                s["loss_improvement_per_device_hour"] = (start - end) / s["device_hours"]
            if n != leader:  # the task's facts, said once: under its leader's advice
                s["time_split"], s["memory"] = lead.get("time_split"), lead.get("memory")
                s["job"], s["advice"] = {**lead.get("job", {}), "fused_into": leader}, []


def members(tasks: list[Task]) -> set[str]:
    """The tasks that ran inside another's (their per-device rows are the leader's)."""
    return {n for names in groups(tasks).values() for n in names[1:]}


def label(name: str, s: dict) -> str:
    """'r32 (fused in r8's task)' for a member, 'r8 (fused task: r8, r32)' for a leader, else the name."""
    f = s.get("fused")
    if not f:
        return name
    return (
        f"{name} (fused task: {', '.join(f['variants'])})" if f["task"] == name else f"{name} (in {f['task']}'s task)"
    )


def section(variants: dict[str, dict]) -> list[tuple]:
    """The report's 'Fused groups' section: which variants shared a task, each one's share; [] without groups."""
    fused = {n: s for n, s in variants.items() if s.get("fused")}
    if not fused:
        return []
    rows: list[dict[str, Any]] = []
    for n, s in fused.items():
        f = s["fused"]
        rows.append(
            {
                "task": f["task"],
                "variant": n,
                "samples": f"{f['samples']:,}",
                "tokens": f"{f['tokens']:,}",
                "share": pct(f["token_share"]),
                "tokens/s (variant)": fmt(s.get("tokens_per_s"), ",.0f"),
                "tokens/s (task)": fmt(f["group_tokens_per_s"], ",.0f"),
                "memory share": gib(f["memory_share_bytes"]) if f["memory_share_bytes"] else "-",
                "device-hours (share)": fmt(s.get("device_hours"), ".4f"),
                "device-hours (task)": fmt(f["group_device_hours"], ".4f"),
            }
        )
    tasks = sorted({s["fused"]["task"]: s["fused"]["variants"] for s in fused.values()}.items())
    said = "; ".join(f"{', '.join(names)} in task {t}" for t, names in tasks)
    return [
        ("h", 2, "Fused groups"),
        ("p", f"These variants trained together, one task each group over one shared base: {said}."),
        ("table", pd.DataFrame(rows)),
        (
            "p",
            "Each variant's samples and tokens are its own; its share is its part of the task's tokens. The task's "
            "step time, memory peak, CPU and device-hours are the group's: a variant's memory and device-hours are "
            "its share of them (by tokens), so the run's device-hours count the task once. A variant's tokens/s is "
            "its own tokens over the task's step time; the task's is the group's, the figure to compare with a "
            "variant trained alone.",
        ),
    ]
