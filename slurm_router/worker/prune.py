"""prune=true: stop a clear loser at an in-training evaluation, decided by the verdict's own statistics
(docs/ARCHITECTURE.md, "Pruning").

At each evaluation (train.eval_every) rank 0 of a variant's task appends its per-batch held-out losses to
tasks/<name>/evals.jsonl, then reads every task's lines: for each evaluation step so far (this one and the earlier
ones) that is each variant's table of seeds x eval batches there. Other tasks reach a step at their own pace (a
task that runs ahead finds the others' rows for its current step missing, a task that starts later finds them all
for every step), so the decision is taken at the step, up to this one, whose table holds the most rows (the latest
of equals): a task re-decides at each evaluation with everything that has reached the earlier steps, and which
task ran ahead no longer decides what can be compared. The variant with the lowest mean held-out loss there is the
best; every other variant is compared with it by analysis/stats.compare (the verdict's interval over seeds and
eval batches). A variant is pruned when it is worse than the best, the interval includes training noise (at least
2 seeds on each side: with one, eval-sample noise alone would stop equally good variants most of the time), and
its p-value, Holm-adjusted over the variants compared with the best, is below (1 - 0.95) / L, L being the number
of in-training evaluations a task makes (each makes one decision): Bonferroni over the looks, so the chance that
a variant as good as the best is ever pruned, over the whole run, stays below 5%
(benchmarks/results/verdict_calibration.md; the real protocol: benchmarks/results/prune_real.md). prune=true
therefore needs seeds >= 2. The local queue runs replicates of different variants side by side (launch/plan.py
queue_order), so that the seeds of every variant arrive early.

Pruning only ends tasks: a task that is not pruned computes exactly what it computes alone (the router's
invariant is untouched). Which rows a decision sees still depends on how far the others have got, so two runs may
prune at different steps; the reason each pruned task stopped (and the step it compared) is in its result and the
report.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from slurm_router.rundir.layout import EVALS_FILE, RunLayout

LEVEL = 0.95
NEGLIGIBLE = 1e-4  # nats per token: below this a difference is float reduction order (abtest.NEGLIGIBLE)


@dataclass
class Pruned:
    """A task that prune=true ended after the evaluation at `step`; `result` is rank 0's (None on other ranks)."""

    step: int
    result: dict | None = None


@dataclass
class Decision:
    """Why a variant stops: it is worse than `best` at `step` by `diff` nats per token."""

    variant: str
    step: int
    best: str
    diff: float
    ci_low: float
    ci_high: float
    p: float
    p_holm: float
    threshold: float  # (1 - LEVEL) / looks: the prune level
    n_compared: int  # variants compared with the best (Holm's family)
    looks: int
    n_seeds: int
    n_seeds_best: int
    n_batches: int
    training_noise: bool
    compared_step: int = 0  # the evaluation whose rows were compared (fullest_step); `step` is where it stopped
    reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def looks(steps: int, eval_every: int) -> int:
    """How many in-training evaluations a task makes (steps eval_every, 2*eval_every, ... before the last)."""
    return max(1, (steps - 1) // eval_every) if eval_every > 0 else 1


def record(
    task_dir: str | os.PathLike, step: int, variant: str, seed: int, loss_sums: list[float], tokens: list[int]
) -> None:
    """Append one evaluation as one line (one write to an O_APPEND file: readers never see half of it locally;
    a torn line elsewhere is skipped by read_step)."""
    line = json.dumps({"step": step, "variant": variant, "seed": seed, "loss_sums": loss_sums, "tokens": tokens}) + "\n"
    fd = os.open(Path(task_dir) / EVALS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_steps(run_dir: str | os.PathLike) -> dict[int, dict[str, dict[int, dict]]]:
    """{step: {variant: {seed: {loss_sums, tokens}}}} of every task's evaluations (a task evaluated twice at a
    step, after a requeue, gives the same numbers: the last line counts)."""
    out: dict[int, dict[str, dict[int, dict]]] = {}
    for path in sorted(RunLayout(run_dir).tasks.glob(f"*/{EVALS_FILE}")):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                row = json.loads(line)
                step, variant, seed = int(row["step"]), str(row["variant"]), int(row["seed"])
                entry = {"loss_sums": row["loss_sums"], "tokens": row["tokens"]}
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):  # a torn line being written
                continue
            out.setdefault(step, {}).setdefault(variant, {})[seed] = entry
    return out


def read_step(run_dir: str | os.PathLike, step: int) -> dict[str, dict[int, dict]]:
    """{variant: {seed: {loss_sums, tokens}}} of every task's evaluation at `step`."""
    return read_steps(run_dir).get(step, {})


def fullest_step(tables: dict[int, dict[str, dict[int, dict]]], variant: str, up_to: int) -> int | None:
    """The evaluation step, at most `up_to`, whose table holds `variant` and the most rows (the latest of equals):
    where the comparison sees the most seeds, whichever task reached its steps first."""
    steps = [s for s, g in tables.items() if s <= up_to and variant in g and len(g) >= 2]
    if not steps:
        return None
    return max(steps, key=lambda s: (sum(len(side) for side in tables[s].values()), s))


def mean_loss(side: dict[int, dict]) -> float:
    """The mean over seeds of each seed's token-weighted held-out loss."""
    return float(np.mean([sum(r["loss_sums"]) / max(1, sum(r["tokens"])) for r in side.values()]))


def decide(
    groups: dict[str, dict[int, dict]],
    variant: str,
    step: int,
    n_looks: int,
    level: float = LEVEL,
    task: str | None = None,
    single_seed_ok: bool = False,
    compared_step: int | None = None,
) -> Decision | None:
    """The Decision to prune `variant` (its replicate `task`) at `step` given every variant's evaluations at
    `compared_step` (default `step`), or None to go on. single_seed_ok: also on eval-sample noise alone (only
    benchmarks/ use it, to show why not)."""
    if variant not in groups or len(groups) < 2:
        return None
    from slurm_router.analysis import stats  # scipy: imported when a prune decision is made, not by every worker

    best = min(groups, key=lambda v: mean_loss(groups[v]))
    if best == variant:
        return None
    rows = {}
    for other in groups:
        if other == best:
            continue
        try:
            rows[other] = stats.compare(groups[other], groups[best], level=level)
        except ValueError:  # not comparable (other eval batches): never a reason to prune
            continue
    if variant not in rows:
        return None
    names = list(rows)
    adjusted = dict(zip(names, stats.holm([rows[n].p for n in names])))
    r, threshold = rows[variant], (1 - level) / max(1, n_looks)
    # Training noise must be in the interval: with one seed on a side (so far), eval-sample noise alone would stop
    # equally good variants most of the time (benchmarks/results/verdict_calibration.md); its next seeds decide.
    if not ((r.training_noise or single_seed_ok) and r.diff >= NEGLIGIBLE and adjusted[variant] < threshold):
        return None
    d = Decision(
        variant=variant,
        step=step,
        best=best,
        diff=r.diff,
        ci_low=r.ci_low,
        ci_high=r.ci_high,
        p=r.p,
        p_holm=adjusted[variant],
        threshold=threshold,
        n_compared=len(names),
        looks=max(1, n_looks),
        n_seeds=r.n_seeds_a,
        n_seeds_best=r.n_seeds_b,
        n_batches=r.n_batches,
        training_noise=r.training_noise,
        compared_step=step if compared_step is None else compared_step,
    )
    d.reason = reason(task if task and task != variant else variant, d)
    return d


def reason(who: str, d: Decision) -> str:
    """'r4-s0: pruned at step 10: worse than r32 by 0.412 nats per token (95% CI 0.301 to 0.523, p = 1e-05, Holm over
    2 variants below 0.0167 = 5% / 3 evaluations; 2 seeds x 16 eval batches)'."""
    nd = 3 if max(abs(d.ci_low), abs(d.ci_high)) >= 0.01 else 4
    family = f"Holm-adjusted over {d.n_compared} variants {_p(d.p_holm)}, " if d.n_compared > 1 else ""
    seeds = f"{d.variant} {_n(d.n_seeds, 'seed')}, {d.best} {_n(d.n_seeds_best, 'seed')} x {d.n_batches} eval batches"
    if d.compared_step and d.compared_step != d.step:
        seeds += f" at step {d.compared_step}, the evaluation with the most rows so far"
    return (
        f"{who}: pruned at step {d.step}: worse than {d.best} by {d.diff:.{nd}f} nats per token (95% CI "
        f"{d.ci_low:.{nd}f} to {d.ci_high:.{nd}f}, {_p(d.p)}; {family}below {d.threshold:.3g} = 5% / {d.looks} "
        f"evaluations; {seeds})"
    )


def _n(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _p(p: float) -> str:
    return "p < 1e-6" if p < 1e-6 else f"p = {p:.2g}"


def after_eval(spec, step: int, loss_sums: list[float], tokens: list[int], n_looks: int) -> Decision | None:
    """Rank 0 of a variant's task after an in-training evaluation: record it, then decide over all tasks' rows at
    the evaluation step so far that holds the most of them (fullest_step)."""
    record(spec.task_dir, step, spec.variant, spec.seed, loss_sums, tokens)
    return decide_after(spec, step, n_looks)


def decide_after(spec, step: int, n_looks: int) -> Decision | None:
    """The decision for a task whose evaluation at `step` is recorded (a fused task records all its variants'
    first: worker/fused.py)."""
    tables = read_steps(spec.run_dir)
    at = fullest_step(tables, spec.variant, step)
    if at is None:
        return None
    return decide(tables[at], spec.variant, step, n_looks, task=spec.name, compared_step=at)
