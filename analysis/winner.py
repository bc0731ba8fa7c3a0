"""The winner, read from the verdict's rows (verdict/judge.py decided them; abtest.py built them): the variant
with the best mean primary score, whether it is decided (it beats every other variant at the end, or the run's
contest stopped them while behind), a tie ("no winner"), and the line when held-out loss and the primary metric
name different winners. The best seed and its adapter follow the primary metric (abtest.best_replicate)."""

from __future__ import annotations

from typing import cast

import numpy as np

from slurm_router.analysis.abtest import (
    Replicate,
    _weights_text,
    best_adapter,
    best_replicate,
    held_out_losses,
    pruned,
    replicates,
)
from slurm_router.analysis.load import Task
from slurm_router.config.metrics import LOSS
from slurm_router.verdict import NEGLIGIBLE
from slurm_router.verdict.sentences import one_seed


def stopped_steps(tasks: list[Task], looks: list[dict] | None = None) -> dict[str, int | None]:
    """Variant -> the step at which prune=true stopped it while it was behind: the step of the run's look that
    pruned it (decisions.jsonl, report.prune_looks), else the earliest step one of its replicates stopped at."""
    out: dict[str, int | None] = {}
    for variant, reps in pruned(tasks).items():
        at = next((int(look["step"]) for look in looks or [] if variant in (look.get("pruned") or [])), None)
        steps = [int(r["step"]) for r in reps if r.get("step") is not None]
        out[variant] = at if at is not None else min(steps, default=None)
    return out


def stopped_text(variant: str, step: int | None) -> str:
    """'r4 (stopped while behind at step 10)': how the verdict names a variant prune=true stopped. It was behind the
    best variant of that look, which need not be the final winner: never 'beaten' by it."""
    return f"{variant} (stopped while behind{'' if step is None else f' at step {step}'})"


def winner(
    tasks: list[Task],
    rows: list[dict],
    adapters: dict[str, str | None] | None = None,
    metric: str = LOSS,
    higher=False,
    looks: list[dict] | None = None,
) -> dict | None:
    """The variant with the best mean score of `metric` over its seeds (held-out loss by default: the lowest; None
    when no variant has one): {variant, val_loss (its mean held-out loss over those seeds, whatever `metric` is),
    metric, score (the metric's mean, in its own direction), n_seeds, decided (it beats every other variant:
    significant, after Holm's correction, with training noise in each interval, or pruned by the run's contest; a
    win that rests on one seed only leads), beats (the variants it significantly beats in the final verdict),
    stopped ({variant: step} prune=true stopped while behind; `looks`: the run's, for the look's step), adapter,
    seed and task (of its best seed: best_replicate), sentence}. Every variant that finished scoring the same (within
    NEGLIGIBLE): no winner: variant None, `tied` those variants, `score` the score they share."""
    groups = replicates(tasks, metric)
    losses = held_out_losses(tasks)
    means = {
        name: float(np.mean([r.val_loss for r in reps if r.batches is not None]))
        for name, reps in groups.items()
        if any(r.batches is not None for r in reps)
    }
    if not means:
        return None
    sign = -1.0 if higher else 1.0  # a task metric's own score (metric_side negated it when higher is better)
    unit = "held-out loss" if metric == LOSS else metric
    best_score, name = min((v, n) for n, v in means.items())
    stops = stopped_steps(tasks, looks)
    # a variant the run's contest pruned was behind the best one at that look (worker/prune.py: one decision per
    # variant, at the level its spending bounds), whether or not some of its replicates had finished before it
    lost = [n for n in stops if n != name]
    stopped = [stopped_text(n, stops[n]) for n in lost]
    finished = {n: v for n, v in means.items() if n not in stops}
    if len(finished) > 1 and max(finished.values()) - min(finished.values()) < NEGLIGIBLE:  # a constant metric
        who = "every variant that finished" if stops else "every variant"
        shared = sign * min(finished.values()) + 0.0
        lost, stopped = list(stops), [stopped_text(n, stops[n]) for n in stops]
        return {
            "variant": None,
            "tied": list(finished),
            "val_loss": None,
            "metric": metric,
            "score": shared,
            "n_seeds": None,
            "decided": False,
            "beats": [],
            "stopped": {n: stops[n] for n in lost},
            "adapter": None,
            "seed": None,
            "task": None,
            "sentence": "; ".join([f"no winner: {who} has {unit} {shared:.4f} ({', '.join(finished)})", *stopped]),
        }
    done = [r for r in groups[name] if r.batches is not None]
    best = cast(Replicate, best_replicate(done, losses))
    own_losses = [losses[r.task] for r in done if r.task in losses]
    others = [n for n in means if n != name and n not in lost]
    beaten_rows = [
        r
        for r in rows
        if r["b"] != "base"
        and name in (r["a"], r["b"])
        and ({r["a"], r["b"]} - {name}) <= set(others)
        and r.get("significant")
        and (r["a"] if r["diff"] < 0 else r["b"]) == name
    ]
    other_of = {id(r): r["b"] if r["a"] == name else r["a"] for r in beaten_rows}
    firm = [n for n in others if any(other_of[id(r)] == n and not one_seed(r) for r in beaten_rows)]
    on_one = [n for n in others if any(other_of[id(r)] == n and one_seed(r) for r in beaten_rows)]
    beats_all = bool(others or lost) and len(beaten_rows) == len(others)
    # a win on one seed measures eval-sample noise only: the variant leads, nothing is decided (DESIGN.md)
    leads = beats_all and bool(on_one)
    decided = beats_all and not leads
    adapter, why = best_adapter(groups[name], adapters, metric, losses)
    shown = sign * best_score + 0.0
    parts = [f"{unit} {shown:.4f}" + (f", mean of {len(done)} seeds" if len(done) > 1 else "")]
    parts += [f"beats {', '.join(firm)}"] if firm else []  # significant in the final verdict, nothing else
    parts += [f"ahead of {', '.join(on_one)} on 1 seed"] if on_one else []
    parts += stopped
    if not others and not lost:
        what = f"{name}: {parts[0]} (the only variant with one)"
    elif leads:  # significant on eval batches, training noise unknown
        what = f"leads: {name} ({'; '.join(parts)})"
    elif decided:
        what = f"winner: {name} ({'; '.join(parts)})"
    else:
        unsettled = [n for n in others if n not in firm + on_one]
        tied = [n for n in unsettled if means[n] - best_score < NEGLIGIBLE]
        rest = [n for n in unsettled if n not in tied]
        what = f"{'lowest held-out loss' if metric == LOSS else 'best ' + metric}: {name} ({'; '.join(parts)})"
        what += f", not a detectable win over {', '.join(rest)}" if rest else ""
        what += f", tied with {', '.join(tied)}" if tied else ""
    return {
        "variant": name,
        "val_loss": float(np.mean(own_losses)) if own_losses else None,
        "metric": metric,
        "score": shown,
        "n_seeds": len(done),
        "decided": decided,
        "beats": firm,
        "stopped": {n: stops[n] for n in lost},
        "adapter": adapter,
        "seed": best.seed,
        "task": best.task,
        "sentence": f"{what}; {_weights_text(adapter, why)}",
    }


def disagreement(loss_winner: dict | None, metric_winner: dict | None, metric: str) -> str | None:
    """One line when held-out loss and the primary task metric name different winners, else None. A tie (no winner,
    winner()) on either side names no winner: never a disagreement."""
    if not loss_winner or not metric_winner or metric == LOSS:
        return None
    if loss_winner.get("variant") is None or metric_winner.get("variant") is None:
        return None
    if loss_winner["variant"] == metric_winner["variant"]:
        return None
    return (
        f"held-out loss and {metric} name different winners: {loss_winner['variant']} has the lowest held-out loss "
        f"({loss_winner['score']:.4f}), {metric_winner['variant']} the best {metric} ({metric_winner['score']:.4f}); "
        f"the verdict, prune=true and export follow eval.primary={metric}"
    )
