"""benchmarks/verdict_sim.py, small (its results file has 2,000 A/A runs per k): the simulated eval tables keep a
seed's effect from one evaluation to the next, as a real run's do (the old model drew each afresh); over a few
hundred A/A runs the production looks and the final verdict each declare a difference between equally good
variants rarely; and a late bloomer is pruned when the looks start early, not when they start late."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from verdict_sim import aa, aa_design, contested, crossing_design  # noqa: E402
from verdict_sim_model import FRESH, Noise, draw_losses  # noqa: E402


def seed_offsets_correlation(noise: Noise, runs: int = 200) -> float:
    """The correlation, over runs, of a replicate's offset from its variant's mean over seeds (its held-out loss,
    read from the tables) at two evaluations 10 steps apart."""
    design, rng = aa_design(4, noise), np.random.default_rng(0)
    j = design.grid.index(50)
    pairs = []
    for _ in range(runs):
        loss = draw_losses(rng, design).mean(axis=3)  # (steps, variants, seeds): each replicate's held-out loss
        offset = loss - loss.mean(axis=2, keepdims=True)
        pairs.append(np.stack([offset[j].ravel(), offset[j + 1].ravel()]))
    now, then = np.concatenate(pairs, axis=1)
    return float(np.corrcoef(now, then)[0, 1])


def test_a_seeds_effect_persists_over_steps_and_the_old_model_forgot_it():
    assert seed_offsets_correlation(Noise()) > 0.8
    assert abs(seed_offsets_correlation(FRESH)) < 0.15


def test_equally_good_variants_are_rarely_declared_different_by_the_looks_or_the_verdict():
    r = aa(4, 300, 7)
    assert r["looks_taken"] > 3, r  # the looks happen: tasks arrive at their own paces, the 80-step ones end
    assert r["a_looks"]["rate"] <= 0.10 and r["b_final"]["rate"] <= 0.10, r


def test_a_late_bloomer_is_pruned_when_looks_start_early_and_spared_when_they_start_late():
    early = contested(crossing_design(20.0, 0.0), 30, 1)
    late = contested(crossing_design(20.0, 0.75), 30, 1)
    assert early["pruned_true_best"]["rate"] > 0.5 and early["device_steps_share"] < 0.9, early
    assert late["pruned_true_best"]["count"] == 0 and late["pick_true_best"]["rate"] > 0.8, late
