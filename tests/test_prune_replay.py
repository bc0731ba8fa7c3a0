"""benchmarks/prune_replay.py replays every pruning rule on real runs' recorded curves: on two recordings of real
runs (tests/golden/prune_replay_runs.json: one of the fixed design, prune=false, and one with prune=true and the
looks the production code took), the replay of the production rule takes the very looks the run took, and the
fixed design trains every step while no rule trains more."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prune_protocol import contest_rule, device_steps, figures, tally
from prune_replay import LOSER, REPLAY_RULES, replay, replay_input

from slurm_router.worker import prune

RUNS = json.loads((Path(__file__).parent / "golden" / "prune_replay_runs.json").read_text())


def test_the_contest_replay_takes_the_looks_the_production_run_took(tmp_path):
    rec = RUNS["pruned"]
    design, events, tabs, where = replay_input(rec)
    assert (design.eval_steps, design.steps, design.seeds) == ((2, 4, 6), 8, 3)
    assert [step for _, _, _, step in events].count(2) == 8, "loser-s2 started after its variant was pruned"
    pruned, stopped = contest_rule(tmp_path, events, tabs, design)
    took = [(x["look"], x["step"], x["rows"], x["pruned"], x["threshold"]) for x in prune.read_looks(tmp_path)]
    recorded = [(x["look"], x["step"], x["rows"], x["pruned"], x["threshold"]) for x in rec["looks"]]
    assert took == recorded and pruned == {"loser"}, (took, recorded)
    for name, task in rec["tasks"].items():  # a replicate that evaluated before its end stops where the run stopped it
        if task["exit_state"] == "pruned" and len(task["evals"]) > 1:
            assert stopped[where[name]] == task["evals"][-1]["step"], name


def test_the_fixed_design_trains_every_step_and_no_rule_trains_more(tmp_path):
    pytest.importorskip("optuna")
    design, tabs, got = replay(RUNS["fixed"], tmp_path)
    assert set(got) == set(REPLAY_RULES) and not list(tmp_path.iterdir()), "the contest's run directory is removed"
    counts: dict[str, dict] = {}
    tally(counts, got, tabs, LOSER, design)
    rates = figures(counts, 1, design)
    assert rates["fixed"]["device_steps_share"] == 1.0 and rates["fixed"]["false_rate"] == 0.0
    assert device_steps({}, design) == design.fixed_steps == 3 * 3 * 8
    assert all(0 < x["device_steps_share"] <= 1.0 for x in rates.values()), rates
    # the final loss (step 8) names the winner: with every task to the end it is not the loser (lr 1e-6)
    assert rates["fixed"]["winner_rate"] == 1.0
    assert not got["contest"][0] - {LOSER}, "the production rule pruned neither of the A/A pair"
