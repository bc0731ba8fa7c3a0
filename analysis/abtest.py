"""The verdict: per pair of variants, the difference in held-out loss with its uncertainty, over training seeds
and eval batches together (verdict/ holds the statistics and the sentences; this module picks the data out of a
run's tasks).

Every eval event carries, per eval batch, the summed token loss and the token count, and every task of a run
evaluates the SAME batches (seeded by the run's `seed`), so batch i of any two tasks is a pair. A variant run
with `seeds=N` has N replicates (tasks r8-s0, r8-s1, ...: the variant and its training seed come from the
manifest or task.json, load.py); seed s of two variants is a pair too (the same data order). The point estimate
is the difference of the variants' mean held-out losses over their seeds; the interval and p-value include
training noise (how much another seed would move the loss) when a variant has at least 2 seeds, else eval-sample
noise only, and the sentence says which, and on how many seeds and eval batches it rests. More than two
variants: Holm's correction over the pairs.

The winner is the variant with the best mean score of eval.primary (the lowest mean held-out loss by default); the
verdict says which variants it beats (significant in the final verdict), which ones prune=true stopped while they
were behind, and names its adapter (tasks/<task>/adapter/, slurm_router/artifacts/adapters.py) so the user can load
it or `python -m slurm_router.export RUN_DIR --merge OUT`: with several seeds, the adapter of its best seed by the
same metric (best_replicate: the verdict is about the variant; the best replicate is the one to use), and the
report lists every replicate's adapter. When every variant scores the same there is no winner.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from slurm_router.analysis.load import Task
from slurm_router.config.metrics import LOSS
from slurm_router.rundir.layout import FULL_MODEL
from slurm_router.verdict import judge, sentences, stats


def eval_batches(task: Task, step: int | None = None, metric: str = LOSS) -> dict | None:
    """{loss_sums, tokens, step} of the task's last eval (or of `step`), or None if it has none; of held-out loss,
    or of the task metric `metric` (eval.metrics: its per-example scores as stats.metric_side gives them)."""
    ev = task.evals
    if ev.empty or "batch_loss_sums" not in ev:
        return None
    ev = ev[ev["batch_loss_sums"].map(lambda v: isinstance(v, list) and len(v) > 0)]
    if metric != LOSS:
        if "metrics" not in ev:
            return None
        ev = ev[ev["metrics"].map(lambda m: isinstance(m, dict) and metric in m)]
    if step is not None:
        ev = ev[ev["step"] == step]
    if ev.empty:
        return None
    row = ev.iloc[-1]
    if metric != LOSS:
        return {**stats.metric_side(row["metrics"][metric]), "step": int(row["step"])}
    return {
        "loss_sums": np.asarray(row["batch_loss_sums"], float),
        "tokens": np.asarray(row["batch_tokens"], float),
        "step": int(row["step"]),
        # per eval batch, the files of its samples (verdict/stats.by_cluster); runs before it have none
        "sources": row["batch_sources"] if isinstance(row.get("batch_sources"), list) else None,
    }


def base_batches(tasks: list[Task], metric: str = LOSS) -> tuple[dict | None, str]:
    """The base model's eval batches: the base stage's last eval, else any variant's step-0 eval (a variant
    starts from the base weights, so its step-0 eval IS the base's, e.g. when the base stage was cached)."""
    for t in tasks:
        if t.stage == "base" and (b := eval_batches(t, metric=metric)):
            return b, f"{t.name} (last eval)"
    for t in tasks:
        if t.stage != "base" and (b := eval_batches(t, step=0, metric=metric)):
            return b, f"{t.name} (step-0 eval)"
    return None, "no eval events"


@dataclass
class Replicate:
    """One training seed of one variant (a task) and its last held-out evaluation."""

    task: str
    seed: int | None
    batches: dict | None  # eval_batches() of its last eval after training; None: not trained yet

    @property
    def key(self):  # pairs with the same seed of another variant
        return self.seed if self.seed is not None else self.task

    @property
    def val_loss(self) -> float | None:
        b = self.batches
        return None if b is None else float(b["loss_sums"].sum() / max(1.0, b["tokens"].sum()))


def replicates(tasks: list[Task], metric: str = LOSS) -> dict[str, list[Replicate]]:
    """Every variant (in the order its first task appears) -> its replicates, diverged and pruned ones and a
    seeds=auto reserve stopped once its contest was decided left out (the report lists them as such). A replicate whose only evaluation is its step-0 one is not trained yet.
    A task metric's `val_loss` is its mean signed score (stats.metric_side: lower is better)."""
    out: dict[str, list[Replicate]] = {}
    for t in tasks:
        if t.stage == "base" or t.diverged or t.pruned or t.not_needed:  # not_needed: a seeds=auto reserve stopped
            continue
        b = eval_batches(t, metric=metric)
        out.setdefault(t.variant, []).append(Replicate(t.name, t.seed, b if b and b["step"] > 0 else None))
    return out


def pruned(tasks: list[Task]) -> dict[str, list[dict]]:
    """Variant -> its replicates that prune=true stopped: [{task, seed, step, detail}] (verdict/pruning.py)."""
    out: dict[str, list[dict]] = {}
    for t in tasks:
        if t.stage != "base" and t.pruned:
            out.setdefault(t.variant, []).append({"task": t.name, "seed": t.seed, **t.pruned})
    return out


def held_out_losses(tasks: list[Task]) -> dict[str, float]:
    """Task -> its held-out loss after training (its last eval), for every trained replicate (`replicates`)."""
    return {r.task: cast(float, r.val_loss) for reps in replicates(tasks).values() for r in reps if r.batches}


def best_replicate(reps: list[Replicate], losses: dict[str, float] | None = None) -> Replicate | None:
    """The replicate of a variant to use: the best score of the metric `reps` hold (replicates(tasks, metric)),
    ties broken by the lower held-out loss (losses: held_out_losses), then by order; None when none is trained.
    The seeds table's best seed, the winner's seed and its adapter all come from here."""
    done = [r for r in reps if r.batches is not None]
    if not done:
        return None
    return min(done, key=lambda r: (cast(float, r.val_loss), (losses or {}).get(r.task, float("inf"))))


def variant_table(
    tasks: list[Task], adapters: dict[str, str | None] | None = None, metric: str = LOSS, higher: bool = False
) -> dict[str, dict]:
    """Per variant, over its trained seeds: n_seeds, seeds, the held-out loss's mean, std (n-1; None with one
    seed) and per-seed values, the best seed (by `metric`, eval.primary: best_replicate), and each replicate's
    task, loss and adapter; with a task metric also its mean score and per-seed scores (`metric`, `score_mean`,
    `score_per_seed`, each replicate's `score`: the metric's own scores, `higher` better); `pruned`: its
    replicates that prune=true stopped (a variant whose every replicate was pruned has n_seeds 0)."""
    out: dict[str, dict[str, Any]] = {}
    stopped = pruned(tasks)
    scored = replicates(tasks, metric) if metric != LOSS else {}
    losses = held_out_losses(tasks)
    sign = -1.0 if higher else 1.0  # back to the metric's own direction (metric_side negated it)
    reps: list[Any]
    for variant, reps in replicates(tasks).items():
        done = [r for r in reps if r.batches is not None]
        per_seed = [cast(float, r.val_loss) for r in done]
        by_task = {r.task: r for r in scored.get(variant, [])}
        best = best_replicate(scored.get(variant, []) if metric != LOSS else reps, losses)
        out[variant] = {
            "n_seeds": len(done),
            "seeds": [r.seed for r in done],
            "tasks": [r.task for r in reps],
            "val_loss_mean": float(np.mean(per_seed)) if per_seed else None,
            "val_loss_std": float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else None,
            "val_loss_per_seed": per_seed,
            "best_seed": best.seed if best else None,
            "best_task": best.task if best else None,
            "best_by": metric,
            "replicates": [
                {
                    "task": r.task,
                    "seed": r.seed,
                    "val_loss": r.val_loss,
                    "step": r.batches["step"] if r.batches else None,
                    "adapter": (adapters or {}).get(r.task),
                }
                for r in reps
            ],
            "pruned": stopped.get(variant, []),
        }
        if metric != LOSS:
            own = {n: sign * cast(float, r.val_loss) + 0.0 for n, r in by_task.items() if r.batches is not None}
            for entry in out[variant]["replicates"]:
                entry["score"] = own.get(entry["task"])
            scores = [own[r.task] for r in reps if r.task in own]
            out[variant].update(
                metric=metric, score_mean=float(np.mean(scores)) + 0.0 if scores else None, score_per_seed=scores
            )
    for variant, reps in stopped.items():
        out.setdefault(
            variant,
            {
                "n_seeds": 0,
                "seeds": [],
                "tasks": [r["task"] for r in reps],
                "val_loss_mean": None,
                "val_loss_std": None,
                "val_loss_per_seed": [],
                "best_seed": None,
                "best_task": None,
                "best_by": metric,
                "replicates": [],
                "pruned": reps,
            },
        )
    return out


def compare_all(
    tasks: list[Task], adapters: dict[str, str | None] | None = None, metric: str = LOSS, higher: bool = False
) -> list[dict]:
    """Every pair of variants, then every variant against the base: one row each, with its sentence. Over seeds
    and eval batches (stats.compare); with more than one pair of variants the pairs' p-values get Holm's
    correction (the comparisons with the base do not: each asks its own question, did this variant learn?).
    metric: held-out loss, or a task metric (over seeds and examples; `higher`: higher is better)."""
    groups = replicates(tasks, metric)
    names = list(groups)
    base, _ = base_batches(tasks, metric)
    pairs = [(names[i], names[j]) for i in range(len(names)) for j in range(i + 1, len(names))]
    pairs += [(n, "base") for n in names]
    rows = []
    for na, nb in pairs:
        row: dict[str, Any] = {
            "a": na,
            "b": nb,
            **({"metric": metric, "higher_is_better": higher} if metric != LOSS else {}),
        }
        side_a = trained(groups[na])
        side_b = ({"base": base} if base else {}) if nb == "base" else trained(groups[nb])
        missing = [n for n, side in ((na, side_a), (nb, side_b)) if not side]
        if missing:
            row["sentence"] = f"{na} vs {nb}: no verdict ({', '.join(missing)}: no held-out loss after training yet)"
            rows.append(row)
            continue
        try:
            row.update(stats.compare(side_a, side_b, b_fixed=nb == "base").as_dict())
        except ValueError as e:
            row["sentence"] = f"{na} vs {nb}: no verdict ({e})"
            rows.append(row)
            continue
        steps = {n: sorted({b["step"] for b in side.values()}) for n, side in ((na, side_a), (nb, side_b))}
        row.update(step_a=steps[na][-1], step_b=steps[nb][-1])
        if nb != "base" and len(set(steps[na] + steps[nb])) > 1:
            row["note"] = (
                "[not final for both: "
                + ", ".join(
                    f"{n} at step{'s' if len(st) > 1 else ''} {', '.join(map(str, st))}" for n, st in steps.items()
                )
                + "]"
            )
        rows.append(row)
    _decide(rows, groups, adapters, held_out_losses(tasks) if metric != LOSS else None)
    return rows


def trained(reps: list[Replicate]) -> dict:
    """{seed: eval batches} of the replicates trained so far (what stats.compare takes for one side)."""
    return {r.key: r.batches for r in reps if r.batches is not None}


def _decide(
    rows: list[dict], groups: dict[str, list[Replicate]], adapters: dict | None, losses: dict[str, float] | None
) -> None:
    """The one judgement over the pairs of variants, each row's decision and sentence (verdict/sentences.py), the
    interval at the level each claim was judged, then the winner's adapter and the not-final note."""
    sentences.decide_rows(rows)
    for r in rows:
        if "p" not in r:
            continue
        if "p_adjusted" in r:  # the interval the report draws beside the adjusted p: the level Holm gave the claim
            side_a, side_b = trained(groups[r["a"]]), trained(groups[r["b"]])
            low, high, coverage = judge.adjusted_interval(side_a, side_b, r["p"], r["p_adjusted"])
            r.update(ci_adjusted_low=low, ci_adjusted_high=high, ci_adjusted_coverage=coverage)
        if r["significant"] and r["b"] != "base":
            won = r["a"] if r["diff"] < 0 else r["b"]
            r["sentence"] += f"; {_weights_text(*best_adapter(groups[won], adapters, r.get('metric', LOSS), losses))}"
        if r.get("note"):
            r["sentence"] += f" {r['note']}"


def best_adapter(
    reps: list[Replicate], adapters: dict | None, metric: str = LOSS, losses: dict[str, float] | None = None
) -> tuple[str | None, str]:
    """(path, what it is) of a variant's adapter: with several seeds, its best seed (best_replicate: the lowest
    held-out loss, or the best score of the task metric `metric` that `reps` hold, ties broken by held-out loss)."""
    done = [r for r in reps if r.batches is not None]
    best = best_replicate(done, losses)
    if best is None:
        return None, ""
    what = "lowest held-out loss" if metric == LOSS else f"best {metric}"
    why = f" (seed {best.seed}: the {what} of its {len(done)} seeds)" if len(done) > 1 else ""
    return (adapters or {}).get(best.task), why


def _weights_text(path: str | None, why: str = "") -> str:
    """'its adapter: PATH' (or 'its model: PATH' for a variant trained without LoRA, adapters.py)."""
    if not path:
        return f"its adapter{why}: none saved yet (the task has not completed)"
    return f"its {'model' if Path(path).name == FULL_MODEL else 'adapter'}{why}: {path}"
