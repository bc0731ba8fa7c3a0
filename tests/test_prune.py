"""prune=true (slurm_router/worker/prune.py): a clear loser stops at an in-training evaluation, decided by the verdict's
statistics; an equally good variant is rarely stopped; a variant that is not pruned trains exactly as alone."""

from __future__ import annotations

import json

import numpy as np
from conftest import run_cli, run_dir_of, step_losses
from verdict_calibration import band, prune_rates, simulate

from slurm_router.worker import prune


def groups(rng, effects, n_seeds=3, names=("a", "b", "c")) -> dict:
    return dict(zip(names, simulate(rng, n_seeds, effects=effects)))


def test_a_clear_loser_is_pruned_and_says_why_the_best_never_is():
    g = groups(np.random.default_rng(0), (0.0, 0.0, 0.1))
    assert prune.decide(g, "a", 10, 4) is None and prune.decide(g, "b", 10, 4) is None
    d = prune.decide(g, "c", 10, 4, task="c-s1")
    assert d is not None and d.best in ("a", "b") and d.diff > 0.09 and d.ci_low > 0
    assert d.n_compared == 2 and abs(d.threshold - 0.05 / 4) < 1e-12 and d.p_holm < d.threshold and d.training_noise
    assert d.reason.startswith(f"c-s1: pruned at step 10: worse than {d.best} by 0.1")
    assert "Holm-adjusted over 2 variants" in d.reason and "below 0.0125 = 5% / 4 evaluations" in d.reason
    assert "c 3 seeds, " in d.reason and "x 32 eval batches" in d.reason


def test_one_seed_on_a_side_never_prunes_a_second_decides():
    """Eval-sample noise alone would stop equal variants (the benchmark: nearly always): wait for a 2nd seed."""
    rng = np.random.default_rng(1)
    a, c = simulate(rng, 3, effects=(0.0, 0.3))  # 2 seeds paired: 1 df, so a large effect
    assert prune.decide({"a": a, "c": {0: c[0]}}, "c", 4, 4) is None
    assert prune.decide({"a": a, "c": {0: c[0], 1: c[1]}}, "c", 4, 4) is not None
    assert prune.decide({"a": a, "c": {0: c[0]}}, "c", 4, 4, single_seed_ok=True) is not None
    assert prune.decide({"c": c}, "c", 4, 4) is None  # nobody to compare with


def test_equally_good_variants_are_rarely_pruned_and_worse_ones_are():
    """Simulated runs of 3 variants x 4 evaluations: the chance that any equally good variant is ever pruned is
    at most 5% (Bonferroni over the looks, Holm over the variants); a variant worse by 0.02 is usually caught."""
    n = 300
    aa, _ = prune_rates(n, 11, n_seeds=3)
    assert aa <= band(n)[1], aa
    false, caught = prune_rates(n, 12, effects=(0.0, 0.0, 0.02), n_seeds=3)
    assert false <= band(n)[1] and caught > 0.6, (false, caught)
    assert prune_rates(100, 11, n_seeds=1, single_seed_ok=True)[0] > 0.5  # why one seed is refused


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
    assert prune.mean_loss(got["a"]) == (0.15 + 0.2) / 2


GOOD = "good: {train: {lr: 5e-3}}"
# full fine-tuning on the whole training set each step (110 samples): no LoRA init, no data order, so its seeds
# agree, and a learning rate that sets it far above the base for the first steps: a clear loser
BAD = "bad: {model: {lora: {enabled: false}}, train: {lr: 1e-2, global_batch_size: 110}}"
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
        assert r["best"] == "good" and r["step"] == 2 and r["n_seeds"] >= 2 and r["training_noise"]
        assert len(step_losses(run_dir / "tasks" / t)) == r["step"]  # it stopped at that evaluation
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert sorted(line.split(":")[0] for line in summary["pruned"]) == sorted(pruned)
    assert all(
        f"pruned at step {pruned[line.split(':')[0]]['step']}: worse than good by" in line for line in summary["pruned"]
    )
    assert summary["by_variant"]["bad"]["pruned"] and summary["winner"]["variant"] == "good"
    assert "pruned at step" in (run_dir / "report" / "report.md").read_text()
    assert not summary["missing"], summary["missing"]

    alone = run_cli(*common, f"+variants={{{GOOD}}}", "seeds=[2]", cwd=tmp_path)
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    assert step_losses(run_dir / "tasks" / "good-s2") == step_losses(run_dir_of(alone) / "tasks" / "good")


def test_the_decision_compares_the_evaluation_with_the_most_rows_whoever_ran_ahead(tmp_path):
    """A loser that runs ahead finds the others' rows for its current step missing: it decides at the earlier
    evaluation they have all reached (and says so), so which task ran ahead no longer decides what is compared."""
    rng = np.random.default_rng(3)
    sim = simulate(rng, 3, effects=(0.0, 0.3))
    good, bad = ({s: {k: [float(x) for x in v] for k, v in r.items()} for s, r in side.items()} for side in sim)
    for variant, side in (("good", good), ("bad", bad)):
        for seed, row in side.items():
            (tmp_path / "tasks" / f"{variant}-s{seed}").mkdir(parents=True)
            for step in (2, 4) if variant == "bad" else (2,):  # good has not reached step 4 yet
                prune.record(tmp_path / "tasks" / f"{variant}-s{seed}", step, variant, seed, *row.values())
    tables = prune.read_steps(tmp_path)
    assert prune.decide(tables[4], "bad", 4, 3) is None  # the old decision: step 4 alone, nobody to compare with
    assert prune.fullest_step(tables, "bad", 4) == 2 and prune.fullest_step(tables, "bad", 2) == 2
    spec = type("Spec", (), {"task_dir": tmp_path / "tasks" / "bad-s0", "run_dir": tmp_path, "variant": "bad"})
    spec.seed, spec.name = 0, "bad-s0"
    d = prune.after_eval(spec, 4, *bad[0].values(), n_looks=3)
    assert d is not None and d.step == 4 and d.compared_step == 2 and d.best == "good"
    assert (
        d.reason.startswith("bad-s0: pruned at step 4: worse than good by") and "at step 2, the evaluation" in d.reason
    )


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


def test_a_planted_loser_is_pruned_with_the_default_cpu_slots(tmp_path):
    """The issue's run (r8 with lr 1e-6 against r32, 3 seeds) with this machine's default launcher.cpu_slots: the
    queue interleaves the variants' replicates, and a later r8 replicate compares with the rows already there."""
    proc = run_cli(
        "+experiment=lora_ab",
        "base.enabled=false",
        "data=stdlib",
        "train.steps=6",
        "train.eval_every=2",
        "train.eval_batches=4",
        "seeds=3",
        "prune=true",
        "variants.r8.train.lr=1e-6",
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
        "train.eval_batches=2",
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
