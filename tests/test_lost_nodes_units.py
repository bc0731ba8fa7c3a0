"""The report's lost node (backends/slurm/lost_nodes.py) from captured sacct and sacctmgr output."""

from __future__ import annotations

from slurm_router.backends.slurm.job import node_fail_attempts
from slurm_router.backends.slurm.lost_nodes import lost_nodes, parse_events

SACCT = """44_1|NODE_FAIL|mn[1-2]|2026-11-28T08:40:12|2026-11-28T08:40:35
44_1|COMPLETED|mn[1-2]|2026-11-28T08:40:42|2026-11-28T08:41:07
45_0|REQUEUED|mn1|2026-11-28T08:40:12|2026-11-28T08:40:20
"""
EVENTS = """|2026-11-28T08:00:00|CLUSTER_CPU|
mn2|2026-11-28T08:40:30|DOWN|maintenance
mn3|2026-11-28T08:40:31|DOWN*|not ours
mn1|2026-11-28T08:40:31|IDLE|
"""


def test_node_fail_attempts_and_events():
    assert node_fail_attempts(SACCT) == [("44_1", "mn[1-2]", "2026-11-28T08:40:12", "2026-11-28T08:40:35")]
    assert node_fail_attempts("") == []
    assert parse_events(EVENTS) == [
        ("mn2", "2026-11-28T08:40:30", "DOWN", "maintenance"),
        ("mn3", "2026-11-28T08:40:31", "DOWN*", "not ours"),
    ]


def test_lost_nodes_names_the_node_of_the_attempt_and_asks_nothing_more_without_one():
    calls: list[list[str]] = []

    def runner(argv: list[str]) -> str:
        calls.append(argv)
        return {"sacct": SACCT, "scontrol": "mn1\nmn2\n", "sacctmgr": EVENTS}[argv[0]]

    assert lost_nodes(["44_1"], runner) == {"44_1": ["mn2 down at 2026-11-28T08:40:30 (reason: maintenance)"]}
    window = [a for a in calls[-1] if a.startswith(("Start=", "End=", "Nodes="))]
    assert window == ["Start=2026-11-28T08:40:12", "End=2026-11-28T08:45:35", "Nodes=mn1,mn2"]
    calls.clear()
    assert lost_nodes(["45_0"], lambda argv: calls.append(argv) or "45_0|COMPLETED|mn1|a|b") == {}
    assert [c[0] for c in calls] == ["sacct"]  # no NODE_FAIL attempt: no event query
    assert lost_nodes([], runner) == {}
