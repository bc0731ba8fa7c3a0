"""The verdict over seed replicates: its statistics against scipy's textbook tests, its calibration on simulated
loss tables (hundreds of A/A and A/B experiments, no training: benchmarks/verdict_calibration.py has the
simulation and writes the figures), its sentences and report on a synthetic run directory, and one real A/A
run (two identical variants, several seeds) on this machine."""

import json
import re
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import run_cli, run_dir_of
from scipy import stats as sps
from verdict_calibration import REGIMES, Noise, band, holm_fwer, old_rejects, rate, simulate

from slurm_router.analysis import abtest
from slurm_router.analysis import winner as winners
from slurm_router.analysis.load import Task, load_run
from slurm_router.analysis.report import write_report
from slurm_router.verdict import stats

B = 32


def rep(sums, tokens):
    return {"loss_sums": np.asarray(sums, float), "tokens": np.asarray(tokens, float)}


def held_out(r) -> float:
    return r["loss_sums"].sum() / r["tokens"].sum()


# ---- the statistics against scipy's textbook tests ---------------------------------------------------------------


def test_one_seed_is_a_paired_t_test_over_eval_batches():
    a, b = simulate(np.random.default_rng(0), n_seeds=1, effects=(0.0, 0.004))
    r = stats.compare(a, b)
    per_batch = stats.contributions(**a[0]) - stats.contributions(**b[0])  # exact: their mean is the diff
    t = sps.ttest_1samp(per_batch, 0.0)
    assert r.diff == pytest.approx(held_out(a[0]) - held_out(b[0]), abs=1e-12)
    assert r.p == pytest.approx(t.pvalue, rel=1e-6) and (r.ci_low, r.ci_high) == pytest.approx(
        tuple(t.confidence_interval(0.95)), rel=1e-6
    )
    assert r.method == "batches" and not r.training_noise and r.n_batches == B


def test_seeds_alone_is_a_paired_t_test_over_seeds():
    """No eval-batch spread in the difference (every batch moves alike): the test is scipy's ttest_rel over the
    seeds' held-out losses, with S - 1 df."""
    tokens = np.full(B, 100.0)
    hardness = np.linspace(2, 3, B)
    shift_a, shift_b = [0.01, -0.02, 0.015, 0.0], [0.0, -0.01, 0.0, 0.002]
    a = {s: rep((hardness + d) * tokens, tokens) for s, d in enumerate(shift_a)}
    b = {s: rep((hardness + d) * tokens, tokens) for s, d in enumerate(shift_b)}
    r = stats.compare(a, b)
    t = sps.ttest_rel([held_out(a[s]) for s in a], [held_out(b[s]) for s in b])
    assert r.method == "crossed" and r.n_seeds_paired == 4 and r.training_noise
    assert r.diff == pytest.approx(np.mean(shift_a) - np.mean(shift_b))
    assert r.p == pytest.approx(t.pvalue, rel=1e-6)


def test_pairing_the_base_unshared_seeds_and_eval_batches_that_differ():
    rng = np.random.default_rng(3)
    a, b, base = simulate(rng, n_seeds=3, effects=(0.0, 0.0, 0.05))
    r = stats.compare(a, {"base": base[0]}, b_fixed=True)  # one fixed model: pairs with every seed
    assert r.method == "crossed" and (r.n_seeds_a, r.n_seeds_b) == (3, 1)
    assert r.diff == pytest.approx(np.mean([held_out(x) for x in a.values()]) - held_out(base[0]))
    shifted = {s + 10: x for s, x in b.items()}  # other seeds: paired by eval batch only
    assert stats.compare(a, shifted).method == "welch"
    assert stats.compare({0: a[0]}, shifted).method == "batches"  # one seed on one side: no training noise
    other = {0: rep(b[0]["loss_sums"], b[0]["tokens"] + 1)}
    with pytest.raises(ValueError, match="different eval batches .*token counts differ"):
        stats.compare({0: a[0]}, other)
    with pytest.raises(ValueError, match="cannot be paired"):
        stats.compare({0: a[0]}, {0: rep([1.0], [1])})


def test_pieces_of_one_file_are_one_cluster_and_widen_the_interval():
    """8 held-out files of 4 pieces each, the pieces of a file spread over 32 eval units, and a file-level effect
    (the variants differ more on some files than on others): treating the 32 pieces as independent understates
    the noise; with their sources, the pieces of a file count once (8 units) and the interval is wider."""
    rng = np.random.default_rng(2)
    files = np.repeat(np.arange(8), 4)
    rng.shuffle(files)
    tokens = np.full(32, 100.0)
    file_effect = rng.normal(0, 0.05, 8)

    def side(shift):
        return {
            s: {
                "loss_sums": (2.5 + shift + file_effect[files] * (shift > 0) + rng.normal(0, 0.01, 32)) * tokens,
                "tokens": tokens,
            }
            for s in range(3)
        }

    a, b = side(0.02), side(0.0)
    independent = stats.compare(a, b)
    with_sources = {s: {**r, "sources": [[int(f)] for f in files]} for s, r in a.items()}
    clustered = stats.compare(with_sources, b)
    assert (independent.n_batches, clustered.n_batches) == (32, 8)
    assert clustered.diff == pytest.approx(independent.diff)
    width = lambda r: r.ci_high - r.ci_low
    assert width(clustered) > 1.5 * width(independent), (width(clustered), width(independent))
    # batches that share no source are independent already: the same interval
    own = {s: {**r, "sources": [[k] for k in range(32)]} for s, r in a.items()}
    assert stats.compare(own, b).as_dict() == independent.as_dict()


def test_holm_adjusts_step_down():
    assert stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert stats.holm([0.5, 0.001]) == pytest.approx([0.5, 0.002]) and stats.holm([0.9]) == [0.9]


# ---- calibration on simulated loss tables -------------------------------------------------------------------------

DRAWS = 1000
LO, HI = band(DRAWS)  # binomial 99% band of an observed rate over 1000 draws when the true rate is 5%


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("n_seeds", [3, 5])
def test_a_over_a_says_no_difference_at_most_at_the_stated_rate(regime, n_seeds):
    """Two equally good variants: 'a difference' in at most 5% of experiments (the upper end of the binomial
    99% band over 1000 draws, 6.9%), and not a test that never fires (at least 1.5%: it is conservative, down to
    ~2-3%, where the seeds and the eval batches both matter; benchmarks/results/verdict_calibration.md)."""
    fpr = rate(
        lambda a, b: stats.compare(a, b).p < 0.05, DRAWS, seed=11 + n_seeds, n_seeds=n_seeds, noise=REGIMES[regime]
    )
    assert 0.015 <= fpr <= HI, f"{regime}, {n_seeds} seeds: false-positive rate {fpr:.1%}"


def test_a_over_a_is_exact_when_training_noise_dominates():
    """The seeds' part alone: the interval is Student's t over the seeds, false positives at 5% +- sampling."""
    fpr = rate(
        lambda a, b: stats.compare(a, b).p < 0.05,
        DRAWS,
        seed=4,
        n_seeds=3,
        noise=Noise(variant_batch=0.0, replicate_batch=0.0003),
    )
    assert LO <= fpr <= HI, f"{fpr:.1%} outside the 99% band [{LO:.1%}, {HI:.1%}]"


def test_holm_keeps_the_family_wise_rate_with_four_variants():
    with_holm, without = holm_fwer(DRAWS, seed=9)
    assert with_holm <= HI and without > 2 * HI, (with_holm, without)


def test_one_seed_verdicts_are_fooled_by_training_noise():
    """Why seeds: with training noise, the one-seed bootstrap claims a difference between equally good variants
    in most experiments (the sentence of a one-seed verdict says its interval leaves training noise out)."""
    assert rate(old_rejects, 200, seed=1, n_seeds=1) > 0.3


def test_a_real_effect_is_found_with_seeds():
    rng = np.random.default_rng(6)
    found = sum(stats.compare(*simulate(rng, 5, effects=(0.0, 0.02))).p < 0.05 for _ in range(100))
    assert found >= 90


# ---- sentences and the report on a synthetic run directory -------------------------------------------------------


def fake_run(
    root: Path, effects: dict, seeds: list[int], steps: int = 20, eval_every: int = 5, seed_in_manifest: bool = True
) -> Path:
    """A run dir as slurm_router writes it (manifest, config.yaml, task.json, rank-0 events) with simulated
    eval tables: variants x seeds replicates (task <variant>-s<seed>; <variant> with one seed) and a base."""
    rng = np.random.default_rng(0)
    *tables, base = simulate(rng, len(seeds), B, (*effects.values(), 0.08))
    tokens, base_sums = base[0]["tokens"], base[0]["loss_sums"]
    root.mkdir(parents=True)
    (root / "config.yaml").write_text("experiment: lora_ab\nseed: 0\n")
    tasks = {}

    def write(name, variant, stage, seed, final_sums):
        d = root / "tasks" / name
        d.mkdir(parents=True)
        (d / "task.json").write_text(json.dumps({"name": name, "variant": variant, "stage": stage, "seed": seed}))
        ident = {
            "host": "h",
            "run_id": "r",
            "task": name,
            "variant": variant,
            "stage": stage,
            "attempt": 0,
            "device": 0,
            "policy": "balanced",
        }
        rows = [{"event": "start", **ident, "time": 0.0, "steps": steps, "world": 1, "device_type": "cpu"}]
        for step in range(steps + 1):
            if step % eval_every == 0 or step == steps:
                sums = base_sums + (final_sums - base_sums) * step / steps
                rows.append(
                    {
                        "event": "eval",
                        **ident,
                        "time": step + 0.5,
                        "step": step,
                        "val_loss": sums.sum() / tokens.sum(),
                        "val_tokens": int(tokens.sum()),
                        "batch_loss_sums": sums.tolist(),
                        "batch_tokens": tokens.tolist(),
                    }
                )
            if step < steps:
                rows.append(
                    {
                        "event": "step",
                        **ident,
                        "time": step + 1.0,
                        "step": step,
                        "loss": 2.7 - 0.01 * step,
                        "n_tokens": 4000,
                        "n_samples": 16,
                        "t_step_s": 0.1,
                        "busy_s_all": [0.09],
                    }
                )
        rows.append({"event": "end", **ident, "time": steps + 2.0, "exit_state": "completed"})
        (d / "events-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        tasks[name] = {
            "stage": stage,
            "variant": variant,
            "index": len(tasks),
            "devices": 1,
            "state": "completed",
            "task_dir": str(d),
            "elapsed_s": 3.0,
            **({"seed": seed} if seed_in_manifest else {}),
        }

    write("base", "base", "base", 0, base_sums)
    for (variant, _), table in zip(effects.items(), tables):
        for j, seed in enumerate(seeds):
            write(
                variant if len(seeds) == 1 else f"{variant}-s{seed}",
                variant,
                "variants",
                seed,
                list(table.values())[j]["loss_sums"],
            )
    (root / "manifest.json").write_text(
        json.dumps(
            {
                "run_id": "r",
                "experiment": "lora_ab",
                "run_dir": str(root),
                "launcher": "local",
                "host": "h",
                "state": "completed",
                "stages": [{"name": "variants", "tasks": list(tasks)}],
                "tasks": tasks,
                "jobs": [],
            }
        )
    )
    return root


def test_a_one_seed_verdict_says_what_its_interval_leaves_out(tmp_path):
    s = write_report(fake_run(tmp_path / "run", {"r8": 0.0, "r32": -0.02}, [0]))
    pair = next(r for r in s["ab"] if r["b"] == "r32")
    assert pair["sentence"].startswith("r32 leads r8 by 0.0"), "one seed: it leads, it does not beat"
    assert "paired t-test over 32 eval batches of 1 seed: eval-sample noise only" in pair["sentence"]
    assert s["winner"]["sentence"].startswith("leads: r32 (") and "ahead of r8 on 1 seed" in s["winner"]["sentence"]
    loss = float(s["winner"]["sentence"].split("held-out loss ")[1].split(";")[0])
    assert loss == pytest.approx(s["winner"]["val_loss"], abs=1e-4) and loss > 0, s["winner"]  # the loss, not negated
    # what the interval leaves out is said once, in the report's banner, not in every sentence
    assert "not training noise" in s["caveat"] and "seeds=3" in s["caveat"]
    assert "not training noise" not in pair["sentence"]
    assert set(s["variants"]) == {"r8", "r32"} and s["by_variant"]["r8"]["n_seeds"] == 1
    assert s["variants"]["r8"]["vs_base"]["diff"] == pytest.approx(s["by_variant"]["r8"]["vs_base"]["diff"])
    md = (tmp_path / "run" / "report" / "report.md").read_text()
    assert "## Variants over seeds" not in md and pair["sentence"] in md
    assert s["plots"][:2] == ["loss.png", "forest.png"]


def test_one_seed_a_over_a_tables_never_decide_a_winner():
    """Simulated A/A tables of one seed: the paired t-test over eval batches calls many of them significant (the
    sentence says 'leads'), but the winner is never `decided` on eval-sample noise alone (issue 36, 7)."""

    def task(name, variant, table):
        t = Task(name, {"stage": "variants", "variant": variant}, seed=0)
        t.evals = pd.DataFrame(
            [
                {
                    "step": 5,
                    "val_loss": 3.0,
                    "batch_loss_sums": list(table["loss_sums"]),
                    "batch_tokens": list(table["tokens"]),
                }
            ]
        )
        return t

    rng, leads, decided = np.random.default_rng(7), 0, 0
    for _ in range(200):
        a, b = simulate(rng, n_seeds=1, effects=(0.0, 0.0))
        tasks = [task("a", "a", a[0]), task("b", "b", b[0])]
        w = winners.winner(tasks, abtest.compare_all(tasks))
        leads += w["sentence"].startswith("leads: ")
        decided += w["decided"]
    assert leads > 0.3 * 200 and decided == 0, (leads, decided)


def test_three_seeds_three_variants_verdict_and_report(tmp_path):
    run = fake_run(tmp_path / "run", {"r8": 0.0, "r32": -0.03, "r4": 0.0}, [0, 1, 2], seed_in_manifest=False)
    s = write_report(run)  # seeds from task.json (the manifest entries have none here)
    assert sorted(s["variants"]) == sorted(f"{v}-s{i}" for v in ("r8", "r32", "r4") for i in range(3))
    v = s["by_variant"]["r32"]
    losses = [s["variants"][f"r32-s{i}"]["val_loss"] for i in range(3)]
    assert v["n_seeds"] == 3 and v["seeds"] == [0, 1, 2] and v["val_loss_per_seed"] == pytest.approx(losses)
    assert v["val_loss_mean"] == pytest.approx(np.mean(losses)) and v["val_loss_std"] == pytest.approx(
        np.std(losses, ddof=1)
    )
    pairs = {(r["a"], r["b"]): r for r in s["ab"]}
    assert set(pairs) == {("r8", "r32"), ("r8", "r4"), ("r32", "r4"), ("r8", "base"), ("r32", "base"), ("r4", "base")}
    for (a, b), r in pairs.items():
        assert "3 seeds x 32 eval batches" in r["sentence"], r["sentence"]
        assert ("Holm-adjusted over the 6 ordered pairs of 3 variants" in r["sentence"]) == (b != "base")
        assert r["diff"] == pytest.approx(
            s["by_variant"][a]["val_loss_mean"]
            - (s["base"]["val_loss"] if b == "base" else s["by_variant"][b]["val_loss_mean"]),
            abs=1e-9,
        )
    assert pairs[("r8", "r32")]["significant"] and pairs[("r8", "r32")]["sentence"].startswith("r32 beats r8")
    w = s["winner"]
    best = min(range(3), key=lambda i: losses[i])
    assert (w["variant"], w["n_seeds"], w["seed"], w["task"]) == ("r32", 3, best, f"r32-s{best}")
    assert (
        "mean of 3 seeds" in w["sentence"]
        and f"(seed {best}: the lowest held-out loss of its 3 seeds)" in w["sentence"]
    )
    report = run / "report"
    md = (report / "report.md").read_text()
    assert "## Variants over seeds" in md and re.search(r"\| r32 \| 3 \| 2\.\d{4} \| 0\.\d{4} \|", md), md
    assert s["plots"][:2] == ["loss.png", "forest.png"] and (report / "forest.png").stat().st_size > 0


def test_seeds_of_a_run_made_before_replicates_come_from_its_config(tmp_path):
    run = fake_run(tmp_path / "run", {"r8": 0.0, "r32": -0.02}, [0], seed_in_manifest=False)
    for task in (run / "tasks").iterdir():  # an old task.json: no seed field
        spec = json.loads((task / "task.json").read_text())
        spec.pop("seed")
        (task / "task.json").write_text(json.dumps(spec))
    (run / "config.yaml").write_text("experiment: lora_ab\nseed: 7\n")
    s = write_report(run)
    assert s["by_variant"]["r8"]["seeds"] == [7] and s["winner"]["variant"] == "r32"


def test_a_replicate_not_trained_yet_is_left_out_and_the_count_says_so():
    def task(name, variant, seed, step, shift):
        t = Task(name, {"stage": "variants", "variant": variant}, seed=seed)
        t.evals = pd.DataFrame(
            [
                {"step": st, "val_loss": 3.0, "batch_loss_sums": [300 + sh, 310 + sh], "batch_tokens": [100, 100]}
                for st, sh in ((0, 0), (step, shift))
            ]
        )
        return t

    tasks = [
        task("r8-s0", "r8", 0, 5, -10),
        task("r8-s1", "r8", 1, 5, -12),
        task("r8-s2", "r8", 2, 0, 0),
        task("r32-s0", "r32", 0, 5, -11),
        task("r32-s1", "r32", 1, 5, -9),
    ]
    (row,) = [r for r in abtest.compare_all(tasks) if r["b"] == "r32"]
    assert row["n_seeds_a"] == 2 and row["n_seeds_paired"] == 2 and "2 seeds x 2 eval batches" in row["sentence"]


# ---- the report tells one story (issue 48, findings 13 and 14) ---------------------------------------------------


def add_metric(run: Path, metric: str, score_of, higher: bool = True) -> Path:
    """Give every eval row of a fake_run a task metric (score_of(task, step) -> per-example scores) and make it
    eval.primary (task.json's config), as a run with eval.metrics.NAME and eval.primary=NAME writes them."""
    for d in (run / "tasks").iterdir():
        spec = json.loads((d / "task.json").read_text())
        (d / "task.json").write_text(json.dumps({**spec, "config": {"eval": {"primary": metric}}}))
        path = d / "events-rank0.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for r in rows:
            if r["event"] == "eval":
                r["metrics"] = {metric: {"scores": score_of(d.name, r["step"]), "higher_is_better": higher}}
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def section(md: str, title: str) -> str:
    start = md.index(f"## {title}")
    return md[start : md.index("\n## ", start + 1)]


def test_the_forest_draws_the_interval_its_label_and_the_verdict_read(tmp_path):
    """Four variants: d is 0.027 worse than a, p 0.03 on its own but not after Holm over the 12 claims. Its bar is
    the interval at the level Holm gave the pair, so it includes 0 beside its adjusted p and hollow; c's excludes
    0 and is filled. Every bar excludes 0 exactly when the verdict calls the difference."""
    from slurm_router.analysis import plots

    s = write_report(fake_run(tmp_path / "run", {"a": 0.0, "b": 0.01, "c": 0.03, "d": 0.03}, [0, 1, 2]))
    pairs = {r["b"]: r for r in s["ab"] if r["a"] == "a" and r["b"] != "base"}
    assert pairs["d"]["ci_low"] > 0 or pairs["d"]["ci_high"] < 0, "unadjusted, d's interval excludes 0"
    assert not pairs["d"]["significant"] and pairs["c"]["significant"]
    drawn = plots.forest_rows(s)
    rows = {r["name"]: r for r in drawn["rows"]}
    assert set(rows) == {"b", "c", "d"} and drawn["best"] == "a"
    for name, r in rows.items():
        assert r["filled"] == pairs[name]["significant"] == (r["low"] > 0 or r["high"] < 0), (name, r)
        assert (r["low"], r["high"]) == pytest.approx(
            sorted((-pairs[name]["ci_adjusted_high"], -pairs[name]["ci_adjusted_low"]))
        )
        assert f"[{r['low']:+.4f}, {r['high']:+.4f}]" in r["label"]
        assert f"p={pairs[name]['p_adjusted']:.2g}" in r["label"]
    assert rows["d"]["low"] < 0 < rows["d"]["high"] and not rows["d"]["filled"]
    assert (
        "interval at the level Holm gave each pair" in drawn["xlabel"] and "hollow: none detectable" in drawn["title"]
    )
    assert "forest.png" in s["plots"]


def test_a_metric_every_variant_scores_the_same_names_no_winner_and_no_disagreement(tmp_path):
    """em 0 for every example of every variant: no winner, the score they share, and no line saying held-out loss
    and em name different winners (r8 has the lower held-out loss here, r32 the first name in order)."""
    run = add_metric(fake_run(tmp_path / "run", {"r8": -0.03, "r32": 0.0}, [0, 1, 2]), "em", lambda t, s: [0.0] * 20)
    s = write_report(run)
    w = s["winner"]
    assert w["variant"] is None and w["tied"] == ["r8", "r32"] and w["score"] == 0.0 and not w["decided"]
    assert w["sentence"] == "no winner: every variant has em 0.0000 (r8, r32)", w["sentence"]
    assert s["disagreement"] is None and s["disagree_examples"] is None
    md = (run / "report" / "report.md").read_text()
    assert "name different winners" not in md and "best em:" not in md and "no winner: every variant" in md
    assert "-0.0000" not in section(md, "Metrics")  # the shared score, not a signed zero
    proc = run_cli(str(run), module="slurm_router.export", cwd=tmp_path)
    assert proc.returncode == 2 and "the report names no winner (no winner: every variant has em" in proc.stderr


def test_a_tie_on_held_out_loss_too_is_no_winner():
    def task(name, variant, seed):
        t = Task(name, {"stage": "variants", "variant": variant}, seed=seed)
        sums = [300.0 + seed, 310.0 - seed, 290.0]
        t.evals = pd.DataFrame([{"step": 5, "val_loss": 3.0, "batch_loss_sums": sums, "batch_tokens": [100] * 3}])
        return t

    tasks = [task(f"{v}-s{s}", v, s) for v in ("a", "b") for s in range(2)]
    w = winners.winner(tasks, abtest.compare_all(tasks))
    assert w["variant"] is None and w["sentence"].startswith("no winner: every variant has held-out loss 3.0000")
    assert winners.disagreement(w, {"variant": "a", "score": 1.0}, "acc") is None


def scores_by_seed(good: dict[str, list[int]]):
    """score_of for add_metric: the last evaluation's example scores, `good[task]` of 20 examples right."""
    return lambda task, step: [1.0 if i < good.get(task, 0) * step // 20 else 0.0 for i in range(20)]


def test_the_seeds_table_names_one_unit_per_column_and_the_best_seed_follows_the_primary_metric(tmp_path):
    """eval.primary=acc over 3 seeds. The seeds table keeps held-out loss and acc in their own, named columns; the
    comparison with the base is acc's (its own direction); the best seed is the one with the best acc (not the
    lowest held-out loss), in the table, by_variant, the winner and the adapter it names."""
    run = fake_run(tmp_path / "run", {"r8": 0.0, "r32": -0.03}, [0, 1, 2])
    good = {"r8-s0": 5, "r8-s1": 6, "r8-s2": 4, "r32-s0": 14, "r32-s1": 12, "r32-s2": 13, "base": 2}
    s = write_report(add_metric(run, "acc", scores_by_seed(good)))
    losses = {t: s["variants"][t]["val_loss"] for t in s["variants"]}
    by_loss = min(("r32-s0", "r32-s1", "r32-s2"), key=losses.get)
    assert by_loss != "r32-s0", "the test needs the best seeds by loss and by acc to differ"
    v = s["by_variant"]["r32"]
    assert (v["best_seed"], v["best_task"], v["best_by"]) == (0, "r32-s0", "acc")
    assert v["score_per_seed"] == pytest.approx([0.7, 0.6, 0.65]) and v["score_mean"] == pytest.approx(0.65)
    assert s["by_variant"]["r8"]["best_task"] == "r8-s1"
    w = s["winner"]
    assert (w["variant"], w["seed"], w["task"]) == ("r32", 0, "r32-s0") and "(seed 0: the best acc of its 3" in w[
        "sentence"
    ]
    md = (run / "report" / "report.md").read_text()
    table = section(md, "Variants over seeds")
    header = next(line for line in table.splitlines() if line.startswith("| variant"))
    assert header.split(" | ")[2:] == [
        "held-out loss: mean",
        "held-out loss: std over seeds",
        "held-out loss: range",
        "held-out loss per seed",
        "acc: mean",
        "acc per seed",
        "best seed (by acc)",
        "acc vs base (95% CI) |",
    ], header
    r32 = next(line for line in table.splitlines() if line.startswith("| r32 "))
    vs = s["by_variant"]["r32"]["vs_base"]
    assert vs["metric"] == "acc" and r32.split(" | ")[-1].startswith(f"{-vs['diff']:+.4f} (")  # acc's own way
    assert r32.split(" | ")[-1].startswith("+0.5500 (") and "| 0 |" in r32 and "s0 0.7000" in r32


def test_the_winner_holds_the_held_out_loss_and_the_primary_score_apart(tmp_path):
    """summary.json's winner: val_loss is the held-out loss (mean over its seeds) whatever eval.primary is; the
    primary metric's score is `score`, named by `metric`."""
    run = fake_run(tmp_path / "run", {"r8": 0.0, "r32": -0.03}, [0, 1, 2])
    good = {"r8-s0": 5, "r8-s1": 6, "r8-s2": 4, "r32-s0": 14, "r32-s1": 12, "r32-s2": 13}
    s = write_report(add_metric(run, "acc", scores_by_seed(good)))
    w = s["winner"]
    assert w["variant"] == "r32" and w["metric"] == "acc"
    assert w["val_loss"] == pytest.approx(s["by_variant"]["r32"]["val_loss_mean"]) and w["val_loss"] > 2
    assert w["score"] == pytest.approx(0.65) == pytest.approx(s["metrics"]["r32"]["acc"]["mean"])
    assert "acc 0.6500, mean of 3 seeds" in w["sentence"]


def test_a_variant_pruned_while_behind_is_stopped_not_beaten():
    """The contest pruned c at the look at step 10 (behind b, the best of that look). At the end a has the lowest
    loss and beats nobody significantly (b is as good): the line says c stopped while behind at step 10, and
    'beats' nowhere; with a significantly better than b too, it beats b only."""

    def task(name, variant, seed, shift, pruned=False):
        t = Task(name, {"stage": "variants", "variant": variant}, seed=seed)
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        sums = (3.0 + shift + rng.normal(0, 0.002, 16)) * 100
        t.evals = pd.DataFrame(
            [{"step": 20, "val_loss": 3.0, "batch_loss_sums": list(sums), "batch_tokens": [100] * 16}]
        )
        if pruned:
            t.end = {"event": "end", "exit_state": "pruned", "step": 12, "detail": f"{name}: pruned at step 12"}
        return t

    for b_shift, beats in ((0.0, False), (0.05, True)):
        tasks = [task(f"a-s{s}", "a", s, -0.0005 * s) for s in range(3)]
        tasks += [task(f"b-s{s}", "b", s, b_shift) for s in range(3)]
        tasks += [task(f"c-s{s}", "c", s, 0.3, pruned=True) for s in range(2)]
        w = winners.winner(tasks, abtest.compare_all(tasks))  # without the run's looks: where a replicate stopped
        assert w["variant"] == "a" and "c (stopped while behind at step 12)" in w["sentence"], w["sentence"]
        assert "(pruned)" not in w["sentence"] and "beats c" not in w["sentence"], w["sentence"]
        assert ("beats b;" in w["sentence"]) == beats, w["sentence"]
        assert w["decided"] == beats and w["beats"] == (["b"] if beats else [])
        w = winners.winner(tasks, abtest.compare_all(tasks), looks=[{"look": 1, "step": 10, "pruned": ["c"]}])
        assert w["stopped"] == {"c": 10} and "c (stopped while behind at step 10)" in w["sentence"]


# ---- one real A/A run ---------------------------------------------------------------------------------------------

AA = [
    "base.enabled=true",
    "base.steps=8",
    "seeds=4",
    "train.steps=12",
    "train.eval_every=6",
    "train.eval_batches=8",
    "data.max_documents=60",
]


@pytest.mark.integration
def test_a_real_a_over_a_run_says_no_difference(tmp_path, base_cache):
    """One configuration trained with 4 seeds, its replicates taken as two identical variants: a (seeds 0, 1) and
    b (seeds 2, 3). On this real training noise the verdict says 'no difference detectable'. (Two identical
    variants of one run share their seeds, and a replicate is a function of its seed: they would be the same
    computation, a difference of exactly 0.)"""
    proc = run_cli(*AA, f"base.cache_dir={base_cache}", f"run_root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    s = json.loads((run_dir / "report" / "summary.json").read_text())
    (main,) = s["by_variant"].values()
    assert main["n_seeds"] == 4 and main["val_loss_std"] > 0, "the seeds moved the held-out loss: training noise"
    tasks = load_run(run_dir)[1]
    for t in tasks:
        if t.stage != "base":
            assert len(t.evals) == 3, "evaluated during training (train.eval_every): a held-out curve per seed"
            t.meta = {**t.meta, "variant": "a" if t.seed < 2 else "b"}
    (pair,) = [r for r in abtest.compare_all(tasks) if r["b"] != "base"]
    assert pair["sentence"].startswith("a vs b: no difference detectable"), pair["sentence"]
    assert "a 2 seeds, b 2 seeds (not the same ones) x 8 eval batches" in pair["sentence"]
    assert pair["ci_low"] <= 0 <= pair["ci_high"] and pair["p"] >= 0.05


@pytest.mark.integration
def test_a_real_one_seed_win_leads_and_is_not_decided(tmp_path):
    """One seed (the default) and a planted loser (r8 at lr 1e-6): r32 is ahead on every eval batch, the verdict
    says it leads, and summary.json does not call it decided: training noise is not in a one-seed interval."""
    proc = run_cli(
        "+experiment=lora_ab",
        "base.enabled=false",
        "data=stdlib",
        "train.steps=6",
        "variants.r8.train.lr=1e-6",
        f"run_root={tmp_path}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((run_dir_of(proc) / "report" / "summary.json").read_text())
    (pair,) = [r for r in s["ab"] if r["b"] != "base"]
    assert pair["significant"] and pair["sentence"].startswith("r32 leads r8 by"), pair["sentence"]
    assert s["winner"]["variant"] == "r32" and s["winner"]["sentence"].startswith("leads: r32 (")
    assert s["winner"]["decided"] is False


def test_one_eval_batch_of_one_seed_gives_no_verdict_rather_than_an_exact_one():
    """No spread to measure the noise by: the pair says so instead of a zero-width interval and p < 1e-6."""
    from slurm_router.verdict import stats

    a = {0: {"loss_sums": [40.0], "tokens": [10.0]}}
    b = {0: {"loss_sums": [41.0], "tokens": [10.0]}}
    with pytest.raises(ValueError, match="1 eval batch of 1 seed.*seeds=3"):
        stats.compare(a, b)


def test_runs_side_by_side_compare_each_variant_over_its_seeds(tmp_path):
    """analysis RUN_A RUN_B: the same variant in two runs, over seeds and eval batches, paired by seed."""
    from slurm_router.analysis.compare import across_runs

    runs = [
        load_run(fake_run(tmp_path / name, {"r8": 0.0, "r32": effect}, [0, 1, 2]))[1]
        for name, effect in (("a", -0.03), ("b", -0.03), ("c", 0.0))
    ]
    lines = across_runs(["A", "B", "C"], runs)
    assert len(lines) == 4 and [line.split(":")[0] for line in lines] == ["r8", "r32", "r8", "r32"]
    assert all("no difference detectable" in line and "float rounding" in line for line in lines[:3]), lines
    assert lines[3].startswith("r32: A beats C by 0.030") and "3 seeds x 32 eval batches, paired by seed" in lines[3]
