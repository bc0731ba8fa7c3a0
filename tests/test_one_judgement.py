"""The one judgement (issue 48): one rule for the looks and the final verdict that holds for many variants, a run's
looks fixed by its plan and taken from half of training on, and the edge cases that broke the guarantee (a failed
or diverged replicate, NaN, a difference with no spread). Through the production functions (verdict/judge.py,
verdict/pruning.look_at, verdict/contest.py, worker/prune.py on a run directory)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from verdict_calibration import Noise, simulate

from slurm_router.rundir.spec import TaskSpec
from slurm_router.verdict import contest, judge, pruning, stats
from slurm_router.verdict.contest import RUN, SKIP, Replicate, Schedule
from slurm_router.verdict.sentences import decide_rows
from slurm_router.worker import prune

SEED_NOISE = Noise(train=0.004, seed_corr=0.0, variant_batch=0.0, replicate_batch=0.0005)  # the seeds dominate


def _tables(rng, k: int, seeds: int = 3, batches: int = 16, effects=None) -> dict[str, dict[int, dict]]:
    sides = simulate(rng, seeds, batches, effects=effects or (0.0,) * k, noise=SEED_NOISE)
    return {f"v{i}": side for i, side in enumerate(sides)}


def test_eight_equal_variants_are_declared_different_at_most_at_the_level():
    """A/A with 8 variants at one look at 5%: comparing each with the sample best and correcting over the 7 others
    declared one worse in ~7% of runs (the best is chosen by the data); Holm over every ordered pair stays under
    5% (~2%), at the look and in the final verdict alike."""
    rng = np.random.default_rng(1)
    runs, pruned_any, verdict_any = 600, 0, 0
    for _ in range(runs):
        groups = _tables(rng, 8)
        pruned_any += bool(pruning.look_at(groups, 10, 0.05, 1))
        names = list(groups)
        rows = [
            {"a": a, "b": b, **stats.compare(groups[a], groups[b]).as_dict()}
            for i, a in enumerate(names)
            for b in names[i + 1 :]
        ]
        decide_rows(rows)
        verdict_any += any(r["significant"] and r["training_noise"] for r in rows)
    assert pruned_any / runs <= 0.045 and verdict_any / runs <= 0.045, (pruned_any, verdict_any)
    assert pruned_any == verdict_any  # one rule: a look at 5% and the verdict say the same thing of one table


def test_the_adjusted_p_of_one_pair_is_its_own_and_a_claim_s_interval_agrees_with_it():
    rng = np.random.default_rng(2)
    groups = _tables(rng, 3, effects=(0.0, 0.0, 0.02))
    a, b = groups["v2"], groups["v0"]
    d = stats.compare(a, b)
    assert judge.adjust([d.p]) == ([pytest.approx(d.p)], 2)
    adjusted, family = judge.adjust([d.p, 0.5, 0.9])
    assert family == 6 and adjusted[0] >= d.p
    low, high, coverage = judge.adjusted_interval(a, b, d.p, adjusted[0])
    assert coverage > 0.95 and low < d.ci_low and high > d.ci_high  # wider: the level Holm gave the claim
    assert (low > 0 or high < 0) == judge.decided(adjusted[0], d.diff)  # the bar excludes 0 iff it is decided


def test_a_look_names_the_strongest_claim_and_never_prunes_the_best():
    rng = np.random.default_rng(3)
    groups = _tables(rng, 4, effects=(0.0, 0.0, 0.0, 0.05))
    out = pruning.look_at(groups, 10, 0.05, 1)
    assert set(out) == {"v3"} and out["v3"].diff > 0.04 and out["v3"].family == 12
    assert out["v3"].best in {"v0", "v1", "v2"} and out["v3"].p_adjusted < 0.05


def test_nan_never_reaches_a_test_and_a_nan_variant_is_never_the_best():
    rng = np.random.default_rng(4)
    groups = _tables(rng, 3, effects=(0.0, 0.05, 0.05))
    for r in groups["v0"].values():
        r["loss_sums"] = np.full_like(r["loss_sums"], np.nan)
    out = pruning.look_at(groups, 10, 0.05, 1)
    assert "v0" not in out and all(d.best != "v0" for d in out.values())
    with pytest.raises(ValueError, match="not finite"):
        stats.compare(groups["v0"], groups["v1"])


def test_a_difference_with_no_spread_is_not_judged():
    """Every example scores 1 for one variant and 0 for the other, on every seed: nothing measures the noise, so
    the p-value is 1 (it was 0: a 'win' on no evidence) and the sentence says why."""
    side = {s: {"loss_sums": np.ones(8), "tokens": np.ones(8)} for s in (0, 1)}
    other = {s: {"loss_sums": np.zeros(8), "tokens": np.ones(8)} for s in (0, 1)}
    d = stats.compare(side, other)
    assert d.se == 0 and d.p == 1.0
    rows = [{"a": "a", "b": "b", **d.as_dict()}]
    decide_rows(rows)
    assert not rows[0]["significant"] and "no noise to measure it against" in rows[0]["sentence"]


def test_the_run_s_looks_are_fixed_by_its_plan_whatever_task_asks():
    """Two variants at 100 steps and one at 50, an evaluation every 10: every task's looks are the same L (the
    run's eval steps from half of the longest training on), so a short variant's task cannot spend 5% / 4 where
    the others spend 5% / 5."""
    s = Schedule.of([(100, 10), (100, 10), (50, 10)])
    assert s.look_steps == (50, 60, 70, 80, 90) and s.n_looks == 5
    # only the steps every task still training evaluates at can hold a look: L counts those alone
    assert Schedule.of([(100, 10), (100, 15)]).look_steps == (60, 90)
    assert Schedule.of([(100, 10), (100, 20), (60, 15)]).look_steps == (60, 80)
    assert Schedule.of([(10, 5)]).look_steps == (5,) and Schedule.of([(10, 0)]).n_looks == 1


def _task(run, variant: str, seed: int, steps: int, every: int) -> TaskSpec:
    config = {"seed": 0, "train": {"eval_every": every}}
    spec = TaskSpec(
        run_id="r", run_dir=str(run), experiment="e", name=f"{variant}-s{seed}", stage="variants", variant=variant,
        index=0, devices=1, config=config, steps=steps, lr=1e-3, global_batch_size=8, lora=True, seed=seed,
    )  # fmt: skip
    spec.task_dir.mkdir(parents=True, exist_ok=True)
    spec.task_dir.joinpath("task.json").write_text(spec.to_json())
    return spec


def _rows(side: dict) -> dict:
    return {s: {k: [float(x) for x in v] for k, v in r.items()} for s, r in side.items()}


def test_through_the_run_directory_no_look_before_half_of_training_and_one_l_for_every_task(tmp_path):
    """worker/prune.after_eval with the schedule read from the plan's task.json files (good trains 40 steps, bad 30,
    an evaluation every 10): a clear loser's evaluation at step 10 takes no look (the grace period, half of 40);
    at step 20 the look is taken at 5% / 2, L being the run's eval steps from 20 on (20 and 30), for either task."""
    rng = np.random.default_rng(5)
    sides = dict(zip(("good", "bad"), (_rows(s) for s in simulate(rng, 2, 16, effects=(0.0, 0.3)))))
    specs = {(v, s): _task(tmp_path, v, s, 40 if v == "good" else 30, 10) for v in sides for s in (0, 1)}
    for step in (10, 20):
        out = [prune.after_eval(specs[v, s], step, *sides[v][s].values()) for v in sides for s in (0, 1)]
        looks = prune.read_looks(tmp_path)
        if step == 10:
            assert looks == [] and out == [None] * 4
    assert [(line["step"], line["looks"], line["pruned"]) for line in looks] == [(20, 2, ["bad"])]
    assert looks[0]["threshold"] == pytest.approx(0.05 / 2)


def test_a_failed_replicate_counts_as_ended_so_later_looks_do_not_wait_for_it(tmp_path):
    """A replicate that failed after its first evaluation writes no result.json: the look at the next step used to
    wait for it forever (pruning silently off); its end row says failed, so the look goes on without it."""
    rng = np.random.default_rng(6)
    sides = dict(zip(("good", "bad"), (_rows(s) for s in simulate(rng, 3, 16, effects=(0.0, 0.3)))))
    specs = {(v, s): _task(tmp_path, v, s, 10, 5) for v in sides for s in (0, 1, 2)}
    schedule = Schedule((3, 5, 7), 10, grace=0.5)  # looks at 5 and 7 only
    for v in sides:
        for s in (0, 1, 2):
            prune.record(specs[v, s].task_dir, 3, v, s, *sides[v][s].values())
    failed = specs["good", 2].task_dir / "events-rank0.jsonl"
    failed.write_text(json.dumps({"event": "end", "exit_state": "failed", "step": 3}) + "\n")
    for v in sides:
        for s in (0, 1, 2) if v == "bad" else (0, 1):
            prune.after_eval(specs[v, s], 5, *sides[v][s].values(), schedule)
    looks = prune.read_looks(tmp_path)
    assert looks and looks[0]["step"] == 5 and looks[0]["rows"]["good"] == [0, 1], looks


def test_a_variant_whose_every_replicate_diverged_is_out_of_seeds_auto_s_contest():
    reps = [Replicate("r8", i, True, diverged=True) for i in (0, 1)]
    reps += [Replicate("r32", i, True) for i in (0, 1)] + [Replicate("r8", 2, False), Replicate("r32", 2, False)]
    assert contest.diverged_out(reps) == {"r8"}
    call, why = contest.reserve_call("r8", 2, reps, [])
    assert call == SKIP and "diverged" in str(why)
    call, why = contest.reserve_call("r32", 2, reps, [])
    assert call == SKIP and "only variant left" in str(why)
    line = contest.auto_line([], {"r8": 2, "r32": 2}, [str(why)], 3, diverged={"r8"})
    assert "the contest is decided: r32 is left (r8 diverged" in line and "undecided" not in line
    alive = [Replicate("r8", 0, True, diverged=True), Replicate("r8", 1, False)] + reps[2:4]
    assert contest.diverged_out(alive) == set() and contest.reserve_call("r32", 2, alive + reps[4:], [])[0] != RUN


def test_a_seeds_auto_depth_that_can_never_prune_is_named():
    """seeds=auto, 2 variants, 4 eval batches, looks at steps 50 and 75: the first round's looks (half of 5% / 2)
    can prune (the floor 4 batches reach, 0.011, is below 0.0125); the reserves' (another half over 4 depths) never
    can, and the submission says so instead of paying for rounds that can only reach the cap."""
    assert pruning.reach_note(3, 4, 100, 25, 2) is None and pruning.reach_note(3, 8, 100, 25, 2, auto_cap=6) is None
    note = pruning.reach_note(3, 4, 100, 25, 2, auto_cap=6)
    assert note is not None and note.startswith("prune=true with seeds=auto: the looks after the first round (3-6 ")
    assert "raise train.eval_batches to 5" in note and math.isclose(pruning.lowest_p(4), 0.0106, rel_tol=0.01)
