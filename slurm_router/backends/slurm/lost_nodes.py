"""Which node a task lost, for the report (jobfacts.py): sacct names each attempt of a task that ended NODE_FAIL
and the nodes it held; slurmdbd's node events (`sacctmgr show event`) say which of those nodes went down then, when
and why. sacct itself records no failed node (Slurm 22.05 has no FailedNode field)."""

from __future__ import annotations

from datetime import datetime, timedelta

from slurm_router.backends.slurm.job import node_fail_attempts
from slurm_router.scheduler.base import Runner

ATTEMPT_FIELDS = "--format=JobID,State,NodeList,Start,End"
# A node is marked down before the job it held is failed; the event can also come up to SlurmdTimeout (and a
# ping interval) after the attempt's recorded end: look that far past it
EVENT_SLACK_S = 300


def parse_events(text: str) -> list[tuple[str, str, str, str]]:
    """`sacctmgr -n -P show event format=NodeName,TimeStart,State,Reason` -> (node, time, state, reason) of each
    node that went down (DOWN, DOWN*, DRAIN...; cluster-wide rows, with no node, are not a node lost)."""
    out = []
    for line in text.splitlines():
        cols = [c.strip() for c in line.split("|")]
        if len(cols) >= 4 and cols[0] and cols[2].upper().startswith(("DOWN", "DRAIN", "FAIL")):
            out.append((cols[0], cols[1], cols[2], cols[3]))
    return out


def _after(stamp: str, seconds: int) -> str:
    try:
        return (datetime.fromisoformat(stamp) + timedelta(seconds=seconds)).isoformat(timespec="seconds")
    except ValueError:  # Unknown, None: up to now
        return "now"


def lost_nodes(task_ids: list[str], runner: Runner) -> dict[str, list[str]]:
    """task id -> one line per node lost under one of its attempts, e.g. 'mn2 down at 2026-11-28T08:47:15
    (reason: maintenance)'; tasks that lost none are absent. Runs no event query when no attempt ended NODE_FAIL."""
    if not task_ids:
        return {}
    attempts = node_fail_attempts(
        runner(["sacct", "-X", "-D", "-n", "--parsable2", "-j", ",".join(task_ids), ATTEMPT_FIELDS])
    )
    out: dict[str, list[str]] = {}
    for task, nodelist, start, end in attempts:
        if not nodelist:  # an attempt that never got a node lost none
            continue
        nodes = runner(["scontrol", "show", "hostnames", nodelist]).split() or [nodelist]
        query = ["sacctmgr", "-n", "-P", "show", "event", f"Start={start}", f"End={_after(end, EVENT_SLACK_S)}"]
        rows = runner([*query, f"Nodes={','.join(nodes)}", "format=NodeName,TimeStart,State,Reason"])
        lines = [
            f"{node} {state.lower().rstrip('*')} at {when}" + (f" (reason: {reason})" if reason else "")
            for node, when, state, reason in parse_events(rows)
            if node in nodes
        ]
        for line in lines or [f"one of {nodelist} (slurmdbd recorded no node event)"]:
            if line not in out.setdefault(task, []):
                out[task].append(line)
    return out
