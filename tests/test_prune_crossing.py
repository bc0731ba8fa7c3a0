"""benchmarks/prune_crossing.py replays the pruning rules on recorded real curves that cross. On one recorded run of
its learning-rate sweep (tests/golden/prune_crossing_run.json: see its "about"), whose leader changes during training
and whose highest learning rate ends last: the contest at the default grace period (half of training) prunes the
variant far behind, never the final winner, saves device-steps against the fixed design, and looks no earlier than
half of training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prune_crossing import CONTESTS, GRACES, SEEDS_PER_RUN, crossing, loss_at, replay_run, split
from prune_protocol import device_steps
from prune_replay import replay_input

from slurm_router.verdict import GRACE

RUN = json.loads((Path(__file__).parent / "golden" / "prune_crossing_run.json").read_text())
DEFAULT = CONTESTS[GRACES.index(GRACE)]


def test_a_recording_splits_into_runs_of_consecutive_seeds_and_the_curves_cross():
    (run,) = split(RUN, "lr")
    design, events, tabs, _ = replay_input(run)
    assert (design.seeds, design.steps, design.eval_steps) == (SEEDS_PER_RUN, 30, (5, 10, 15, 20, 25))
    assert len(events) == 4 * SEEDS_PER_RUN * len(design.eval_steps)
    cross = crossing(tabs, design)
    assert cross["steps"][15]["leader"] != cross["winner"] == "lr1e-2", "the leader at step 15 is not the final one"
    early, final = loss_at(tabs, 5), cross["final"]
    assert early["lr3e-2"] < early["lr1e-3"] and final["lr3e-2"] > final["lr1e-3"], "lr3e-2 and lr1e-3 cross"
    assert cross["loser"] == "lr3e-2" and cross["steps"][5]["pairs_as_at_end"] < 1


def test_the_default_grace_prunes_the_far_loser_never_the_final_winner_and_saves_steps(tmp_path):
    pytest.importorskip("optuna")
    (run,) = split(RUN, "lr")
    design, tabs, got = replay_run(run, tmp_path)
    assert not list(tmp_path.iterdir()), "the contests' run directories are removed"
    winner = crossing(tabs, design)["winner"]
    pruned, stopped = got[DEFAULT]
    assert pruned and winner not in pruned, (winner, pruned)
    assert device_steps(stopped, design) < design.fixed_steps == device_steps(got["fixed"][1], design)
    assert min(stopped.values()) >= GRACE * design.steps, "no look before half of training"
    assert pruned == {"lr1e-3"} and all(winner not in got[r][0] for r in CONTESTS), got
    assert winner in got["ASHA"][0], "ASHA stops a replicate of the final winner at its first rung"
