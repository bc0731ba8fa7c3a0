"""prune=true (slurm_router/verdict/pruning.py, worker/prune.py): a clear loser stops at an in-training
evaluation, decided by the verdict's statistics; an equally good variant is rarely stopped; a variant that is not
pruned trains exactly as alone."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import run_cli, run_dir_of, step_losses
from verdict_calibration import band, prune_rates, simulate

from slurm_router.verdict import contest, pruning
from slurm_router.verdict.contest import Schedule
from slurm_router.worker import prune
from slurm_router.worker.cpu import available_cores

EVERY_5 = Schedule((5, 10, 15, 20), 25, grace=0)  # 4 looks: these tests drive the protocol, not the grace period


def groups(rng, effects, n_seeds=3, names=("a", "b", "c")) -> dict:
    return dict(zip(names, simulate(rng, n_seeds, effects=effects)))


def test_a_clear_loser_is_pruned_and_says_why_the_best_never_is():
    g = groups(np.random.default_rng(0), (0.0, 0.0, 0.1))
    assert pruning.decide(g, "a", 10, 4) is None and pruning.decide(g, "b", 10, 4) is None
    d = pruning.decide(g, "c", 10, 4, task="c-s1")
    assert d is not None and d.best in ("a", "b") and d.diff > 0.09 and d.ci_low > 0
    assert d.family == 6 and abs(d.threshold - 0.05 / 4) < 1e-12 and d.p_adjusted < d.threshold and d.training_noise
    assert d.reason.startswith(f"c-s1: pruned at step 10: worse than {d.best} by 0.1")
    assert (
        "Holm-adjusted over the 6 ordered pairs of 3 variants" in d.reason and "below 0.0125 = 5% / 4 looks" in d.reason
    )
    assert "c 3 seeds, " in d.reason and "x 32 eval batches" in d.reason


def test_one_seed_on_a_side_never_prunes_a_second_decides():
    """Eval-sample noise alone would stop equal variants (the benchmark: nearly always): wait for a 2nd seed."""
    rng = np.random.default_rng(1)
    a, c = simulate(rng, 3, effects=(0.0, 0.3))  # 2 seeds paired: 1 df, so a large effect
    assert pruning.decide({"a": a, "c": {0: c[0]}}, "c", 4, 4) is None
    assert pruning.decide({"a": a, "c": {0: c[0], 1: c[1]}}, "c", 4, 4) is not None
    assert pruning.decide({"a": a, "c": {0: c[0]}}, "c", 4, 4, single_seed_ok=True) is not None
    assert pruning.decide({"c": c}, "c", 4, 4) is None  # nobody to compare with


def test_equally_good_variants_are_rarely_pruned_and_worse_ones_are():
    """Simulated runs of 3 variants x 4 evaluations: the chance that any equally good variant is ever pruned is
    at most 5% (Bonferroni over the looks, Holm over the variants); a variant worse by 0.02 is usually caught. The
    bound is the README's: 8.3%, the top of the 99% binomial band at 5% over 300 runs. Measured on this simulation
    only (each look decides every variant once, on complete tables), not on the tasks' asynchronous protocol."""
    n = 300
    aa, _ = prune_rates(n, 11, n_seeds=3)
    assert round(band(n)[1], 3) == 0.083 and aa <= band(n)[1], aa
    false, caught = prune_rates(n, 12, effects=(0.0, 0.0, 0.02), n_seeds=3)
    assert false <= band(n)[1] and caught > 0.6, (false, caught)
    assert prune_rates(100, 11, n_seeds=1, single_seed_ok=True)[0] > 0.5  # why one seed is refused


def test_under_the_real_protocol_equal_variants_are_rarely_pruned_and_a_clear_loser_is(tmp_path):
    """The production code (worker/prune.after_eval, its files and lock) driven by 9 simulated tasks arriving at
    their own paces (benchmarks/prune_protocol.py, which measures 2,000 runs): over 120 A/A runs an equally good
    variant is pruned at most at the top of the 99% binomial band at 5% (10.8%); a loser 0.05 nats worse is caught
    in most runs and the winner is never the loser."""
    from prune_protocol import one_setting

    n = 120
    aa = one_setting(n, 0.0, 11, tmp_path, rules=("contest",))["contest"]
    assert aa["false_rate"] <= band(n)[1], aa
    loser = one_setting(30, 0.05, 12, tmp_path, rules=("contest",))["contest"]
    assert loser["caught_rate"] >= 0.8 and loser["winner_rate"] == 1.0 and loser["device_steps_share"] < 1, loser


def test_read_step_pairs_seeds_and_skips_a_torn_line(tmp_path):
    for name, variant, seed in (("a-s0", "a", 0), ("a-s1", "a", 1), ("b-s0", "b", 0)):
        (tmp_path / "tasks" / name).mkdir(parents=True)
        prune.record(tmp_path / "tasks" / name, 5, variant, seed, [1.0, 2.0], [10, 10])
    prune.record(tmp_path / "tasks" / "a-s1", 5, "a", 1, [1.5, 2.5], [10, 10])  # re-evaluated after a requeue
    prune.record(tmp_path / "tasks" / "a-s1", 10, "a", 1, [0.5, 0.5], [10, 10])
    with open(tmp_path / "tasks" / "b-s0" / "evals.jsonl", "a") as f:
        f.write('{"step": 5, "variant": "b", "se')
    got = prune.read_step(tmp_path, 5)
    assert set(got) == {"a", "b"} and set(got["a"]) == {0, 1} and set(got["b"]) == {0}
    assert got["a"][1]["loss_sums"] == [1.5, 2.5]
    assert pruning.mean_loss(got["a"]) == (0.15 + 0.2) / 2


GOOD = "good: {train: {lr: 5e-3}}"
# full fine-tuning on the whole training set each step (287 samples: the first halves of 8 files, their second
# halves held out): no LoRA init, no data order, so its seeds agree, and a learning rate that sets it far above the
# base for the first steps: a clear loser
BAD = "bad: {model: {lora: {enabled: false}}, train: {lr: 1e-2, global_batch_size: 287}}"
FAST = [
    "+experiment=lora_ab",
    "base.steps=30",
    "train.steps=4",
    "train.warmup_steps=1",
    "train.eval_every=2",
    "train.eval_batches=16",
    "train.eval_batch_size=8",
    "data.max_documents=8",
    "data.val_fraction=0.5",
    "data.max_len=128",
    "~variants",
]


def test_a_real_run_prunes_the_loser_and_the_survivor_trains_as_alone(tmp_path, base_cache):
    """good against bad, 3 seeds each: a bad replicate that sees two of its seeds at an evaluation is pruned
    there, the report says where and why, and good's loss curve is the one it has alone."""
    common = [*FAST, f"base.cache_dir={base_cache}", f"run_root={tmp_path}"]
    proc = run_cli(*common, f"+variants={{{GOOD}, {BAD}}}", "prune=true", "seeds=3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    results = {
        t: json.loads((run_dir / "tasks" / t / "result.json").read_text())
        for t in (f"{v}-s{s}" for v in ("good", "bad") for s in range(3))
    }
    pruned = {t: r for t, r in results.items() if r.get("exit_state") == "pruned"}
    assert pruned and all(t.startswith("bad-") for t in pruned), results
    for t, r in pruned.items():
        assert r["best"] == "good" and r["compared_step"] == 2 and r["n_seeds"] >= 2 and r["training_noise"]
        # it stopped at that evaluation, or before its first step when it started after the look
        assert r["step"] in (0, 2) and len(step_losses(run_dir / "tasks" / t)) == r["step"]
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert sorted(line.split(":")[0] for line in summary["pruned"]) == sorted(pruned)
    assert all(
        f"pruned at step {pruned[line.split(':')[0]]['step']}: worse than good by" in line for line in summary["pruned"]
    )
    assert summary["by_variant"]["bad"]["pruned"] and summary["winner"]["variant"] == "good"
    assert "pruned at step" in (run_dir / "report" / "report.md").read_text()
    assert not summary["missing"], summary["missing"]
    # one decision for the run: the look that pruned `bad` is recorded once, and every pruned replicate names it
    looks = summary["prune_looks"]
    decided = [line for line in looks if "bad" in line["pruned"]]
    assert len(decided) == 1 and all(f"the run's look {decided[0]['look']}" in r["reason"] for r in pruned.values())
    assert "prune=true looked" in (run_dir / "report" / "report.md").read_text()

    # alone, on 1 of the 2 cores: 1 torch thread, as each of the 6 tasks had with 2 of them side by side
    alone = run_cli(*common, f"+variants={{{GOOD}}}", "seeds=[2]", cwd=tmp_path, cores=max(1, available_cores() // 2))
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    assert step_losses(run_dir / "tasks" / "good-s2") == step_losses(run_dir_of(alone) / "tasks" / "good")


def _spec(run_dir, variant: str, seed: int):
    name = f"{variant}-s{seed}"
    (run_dir / "tasks" / name).mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(task_dir=run_dir / "tasks" / name, run_dir=run_dir, variant=variant, seed=seed, name=name)


def _sides(rng, n_seeds: int, effects: tuple[float, ...]) -> list[dict]:
    return [
        {s: {k: [float(x) for x in v] for k, v in r.items()} for s, r in side.items()}
        for side in simulate(rng, n_seeds, effects=effects)
    ]


def test_a_loser_that_ran_ahead_is_decided_at_the_step_everyone_reached(tmp_path):
    """A loser that runs ahead finds the others' rows for its current step missing: the run looks at the latest
    step every replicate has reached (and the reason says so), so which task ran ahead does not decide what is
    compared."""
    good, bad = _sides(np.random.default_rng(3), 3, (0.0, 0.3))
    for variant, side in (("good", good), ("bad", bad)):
        for seed, row in side.items():
            (tmp_path / "tasks" / f"{variant}-s{seed}").mkdir(parents=True)
            for step in (2, 4) if variant == "bad" else (2,):  # good has not reached step 4 yet
                prune.record(tmp_path / "tasks" / f"{variant}-s{seed}", step, variant, seed, *row.values())
    d = prune.after_eval(_spec(tmp_path, "bad", 0), 4, *bad[0].values(), schedule=Schedule((2, 4, 6), 8, grace=0))
    assert d is not None and d.step == 4 and d.compared_step == 2 and d.best == "good" and d.look == 1
    assert d.reason.startswith("bad-s0: pruned at step 4: worse than good by")
    assert "at step 2, the run's look 1" in d.reason and "5% / 3 looks" in d.reason


def test_a_look_is_taken_once_for_the_run_and_every_replicate_follows_it(tmp_path):
    """Two replicates of the loser and the best's, arriving one by one: no look until the table at the step holds
    every replicate seen so far (two seeds a side), then one line in decisions.jsonl; the loser's other replicate
    stops on that same look (no test of its own), and a requeued task recording the step again adds no look."""
    good, bad = _sides(np.random.default_rng(5), 2, (0.0, 0.3))
    order = [("good", 0), ("bad", 0), ("good", 1), ("bad", 1)]
    seen = []
    for variant, seed in order:
        row = (good if variant == "good" else bad)[seed]
        seen.append(prune.after_eval(_spec(tmp_path, variant, seed), 5, *row.values(), schedule=EVERY_5))
    assert seen[:3] == [None, None, None] and seen[3] is not None
    looks = prune.read_looks(tmp_path)
    assert [(line["look"], line["step"], line["pruned"]) for line in looks] == [(1, 5, ["bad"])]
    assert looks[0]["rows"] == {"bad": [0, 1], "good": [0, 1]} and looks[0]["threshold"] == pytest.approx(0.05 / 4)
    other = prune.decide_after(_spec(tmp_path, "bad", 0), 10, schedule=EVERY_5)  # its next evaluation
    assert other is not None and (other.step, other.compared_step, other.look) == (10, 5, 1)
    assert other.reason.startswith("bad-s0: pruned at step 10: worse than good")
    late = prune.decided(_spec(tmp_path, "bad", 2), 0)  # a replicate starting now ends before its first step
    assert late is not None and (late.step, late.compared_step) == (0, 5) and late.reason.startswith("bad-s2: pruned")
    again = prune.after_eval(_spec(tmp_path, "good", 1), 5, *good[1].values(), schedule=EVERY_5)  # after a requeue
    assert again is None and len(prune.read_looks(tmp_path)) == 1


def test_looks_go_forward_at_most_one_per_evaluation_whatever_the_arrival_order(tmp_path):
    """Four tasks at their own paces (random interleavings of their evaluations), equally good variants: the
    run's looks are at increasing steps, at most one per evaluation step, each spending 5% / L."""
    rng = np.random.default_rng(7)
    steps = [3, 6, 9, 12]
    for trial in range(6):
        run = tmp_path / str(trial)
        good, other = _sides(rng, 2, (0.0, 0.0))
        queues = {(v, s): list(steps) for v in ("good", "other") for s in (0, 1)}
        while queues:
            v, s = list(queues)[rng.integers(len(queues))]
            step = queues[v, s].pop(0)
            row = (good if v == "good" else other)[s]
            prune.after_eval(_spec(run, v, s), step, *row.values(), schedule=Schedule(tuple(steps), 15, grace=0))
            if not queues[v, s]:
                del queues[v, s]
        looks = prune.read_looks(run)
        assert looks and [line["look"] for line in looks] == list(range(1, len(looks) + 1))
        assert all(a["step"] < b["step"] for a, b in zip(looks, looks[1:])) and len(looks) <= len(steps)
        assert all(line["threshold"] == pytest.approx(0.05 / len(steps)) for line in looks)


def test_a_replicate_that_ended_is_not_waited_for():
    """bad-s1 ended (its result written) after step 2: the run looks at step 4 without it, once the others have
    their rows there; a replicate seen but still running is waited for."""
    row = {"loss_sums": [1.0, 1.0], "tokens": [10, 10]}
    tables = {2: {"a": {0: row, 1: row}, "b": {0: row, 1: row}}, 4: {"a": {0: row, 1: row}, "b": {0: row}}}
    looked = [{"step": 2, "pruned": []}]
    assert contest.next_look(tables, {}, []) == 2
    assert contest.next_look(tables, {}, looked) is None  # b-s1 still running: wait for its row at step 4
    assert contest.next_look(tables, {("b", 1): 2}, looked) is None  # b has one seed left at step 4: no test
    tables[4]["c"] = {0: row, 1: row}
    assert contest.next_look(tables, {("b", 1): 2}, looked) == 4
    assert contest.spend(1, 4) == contest.spend(4, 4) == pytest.approx(0.0125) and contest.spend(5, 4) == 0


def test_the_local_queue_runs_variants_side_by_side_and_names_a_layout_that_cannot_compare():
    from types import SimpleNamespace

    from slurm_router.launch.plan import prune_layout_note, queue_order

    tasks = [SimpleNamespace(variant=v, name=f"{v}-s{s}") for v in ("r8", "r32") for s in range(3)]
    order = queue_order(tasks)
    assert [t.name for t in order] == ["r8-s0", "r32-s0", "r8-s1", "r32-s1", "r8-s2", "r32-s2"]
    assert prune_layout_note(order, 1) is None and prune_layout_note(order, 2) is None
    assert "r8 can never be compared" in (prune_layout_note(tasks, 2) or "")  # variant after variant: r32 only
    two = queue_order([SimpleNamespace(variant=v, name=f"{v}-s{s}") for v in ("a", "b") for s in range(2)])
    note = prune_layout_note(two, 1)
    assert note and note.startswith("prune=true: with 1 task(s) at a time, a can never be compared")
    assert "launcher.cpu_slots=2" in note and prune_layout_note(two, 2) is None


# the run: r8 with lr 1e-6 against r32, 3 seeds each (tests/test_prune_frees_devices.py runs it too)
PLANTED = [
    "+experiment=lora_ab",
    "base.enabled=false",
    "data=stdlib",
    "train.steps=6",
    "train.eval_every=2",
    "train.eval_batches=4",
    "seeds=3",
    "prune=true",
    "variants.r8.train.lr=1e-6",
]


def test_a_planted_loser_is_pruned_with_the_default_cpu_slots(tmp_path):
    """The issue's run (r8 with lr 1e-6 against r32, 3 seeds) with this machine's default launcher.cpu_slots: the
    queue interleaves the variants' replicates, and a later r8 replicate compares with the rows already there."""
    proc = run_cli(
        *PLANTED,
        f"run_root={tmp_path}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "can never be compared" not in proc.stderr
    run_dir = run_dir_of(proc)
    results = {p.parent.name: json.loads(p.read_text()) for p in (run_dir / "tasks").glob("*/result.json")}
    pruned = sorted(t for t, r in results.items() if r.get("exit_state") == "pruned")
    assert pruned and all(t.startswith("r8-") for t in pruned), results
    assert all(results[t]["best"] == "r32" and results[t]["step"] < 6 for t in pruned)
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert sorted(line.split(":")[0] for line in summary["pruned"]) == pruned


def test_a_layout_that_cannot_compare_is_named_at_submission(tmp_path):
    """Two seeds and one task at a time: r8's replicates never meet two of r32's, and the run says so in one line
    with the slots that fix it (the run itself goes on)."""
    proc = run_cli(
        "+experiment=lora_ab",
        "base.enabled=false",
        "data=stdlib",
        "train.steps=4",
        "train.eval_every=2",
        "train.eval_batches=4",
        "seeds=2",
        "prune=true",
        "launcher.cpu_slots=1",
        f"run_root={tmp_path}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("prune=true: ")]
    assert lines == [
        "prune=true: with 1 task(s) at a time, r8 can never be compared with 2 seeds of another variant, so cannot "
        "be pruned: run 2 tasks at a time (launcher.cpu_slots=2 without GPUs), or more seeds"
    ], proc.stderr[-3000:]


def test_pruning_that_can_never_fire_is_named_at_submission(tmp_path):
    """The issue's setting (2 seeds x 4 eval batches, an evaluation every 2 of 60 steps: 15 from step 30 on, the
    looks): the lowest p-value 4 eval batches reach (~0.011) is above 5% / 15, so no variant can ever be pruned; the
    plan says so in
    one line with the smallest change that makes it possible. The default evaluations with 3 seeds say nothing."""
    common = ["+experiment=lora_ab", "base.enabled=false", "prune=true", "dry_run=true", f"run_root={tmp_path}"]
    proc = run_cli(*common, "seeds=2", "train.eval_batches=4", "train.steps=60", "train.eval_every=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "no variant can be pruned" in line]
    assert lines == [
        "prune=true: with 2 seeds x 4 eval batches and 15 looks (evaluations from half of training on) no variant "
        "can be pruned: the lowest p-value 4 eval batches reach (0.011) is not below the level each decision needs "
        "(0.0033 = 5% / 15 looks); raise train.eval_batches to 5 or train.eval_every to 7 (4 looks)"
    ], proc.stderr[-3000:]
    sensible = run_cli(*common, "seeds=3", cwd=tmp_path)
    assert sensible.returncode == 0, sensible.stdout[-3000:] + sensible.stderr[-3000:]
    assert "can be pruned" not in sensible.stdout + sensible.stderr


def test_the_lowest_p_value_is_what_tables_of_a_uniform_effect_reach():
    """lowest_p: a loser worse by d on average whose per-batch difference spreads by BATCH_SPREAD * d, the seeds
    agreeing exactly (no training noise to widen it): the verdict's p-value is the floor, whatever d."""
    from slurm_router.verdict import stats

    for n_batches in (4, 8):
        z = np.random.default_rng(0).standard_normal(n_batches)
        z = (z - z.mean()) / z.std(ddof=1)  # a spread of exactly 1 over the batches
        for d in (0.05, 0.7):
            tokens = np.full(n_batches, 100.0)
            best = {s: {"loss_sums": 2.0 * tokens, "tokens": tokens} for s in (0, 1)}
            loser = {
                s: {"loss_sums": (2.0 + d * (1 + pruning.BATCH_SPREAD * z)) * tokens, "tokens": tokens} for s in (0, 1)
            }
            p = stats.compare(loser, best).p
            assert abs(p - pruning.lowest_p(n_batches)) < 1e-6 * max(1.0, p / 1e-6), (n_batches, d, p)
