"""prune=true's rule at one look, pure: which variants are clear losers in one table of evaluations, decided by the
verdict's own statistics (docs/design/pruning.md, "Pruning"); when the run looks and what each look may spend is
verdict/contest.py, the files worker/prune.py.

The variant with the lowest mean (held-out loss, or eval.primary's task metric) in the table is the best; every
other variant is compared with it by verdict/stats.compare (the verdict's interval over seeds and eval batches).
A variant is pruned when it is worse than the best by more than the negligible, the interval includes training
noise (at least 2 seeds on each side: with one, eval-sample noise alone would stop equally good variants most of
the time), and its p-value, Holm-adjusted over the variants compared with the best, is below the look's level.
prune=true therefore needs seeds >= 2, and enough eval batches for the level: reach_note says at submission when
it can never fire. Pruning only ends tasks: a task that is not pruned computes exactly what it computes alone (the
router's invariant is untouched).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from slurm_router.verdict import LEVEL, NEGLIGIBLE


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
    compared_step: int = 0  # the evaluation whose rows were compared (the run's look); `step` is where it stopped
    reason: str = ""
    metric: str = "loss"  # what it is worse in: held-out loss, or eval.primary's task metric
    look: int = 0  # the run's look that decided it (verdict/contest.py); 0: a table decided on its own
    spending: str = ""  # how the threshold was set, when not 5% / looks (seeds=auto: verdict/contest.py Auto)

    def as_dict(self) -> dict:
        return asdict(self)


def looks(steps: int, eval_every: int) -> int:
    """How many in-training evaluations a task makes (steps eval_every, 2*eval_every, ... before the last)."""
    return max(1, (steps - 1) // eval_every) if eval_every > 0 else 1


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
    metric: str = "loss",
) -> Decision | None:
    """The Decision to prune `variant` (its replicate `task`) given every variant's evaluations at `step`, at
    the level (1 - level) / n_looks, or None to go on. single_seed_ok: also on eval-sample noise alone (only
    benchmarks/ use it, to show why not)."""
    d = look_at(groups, step, (1 - level) / max(1, n_looks), n_looks, level, single_seed_ok, metric).get(variant)
    if d is not None:
        d.reason = reason(task if task and task != variant else variant, d)
    return d


def look_at(
    groups: dict[str, dict[int, dict]],
    step: int,
    threshold: float,
    n_looks: int,
    level: float = LEVEL,
    single_seed_ok: bool = False,
    metric: str = "loss",
) -> dict[str, Decision]:
    """{variant: Decision} of every variant a look at this table prunes: worse than the best, training noise in
    the interval, Holm-adjusted p below `threshold`."""
    if len(groups) < 2:
        return {}
    from slurm_router.verdict import stats  # scipy: imported when a prune decision is made, not by every worker

    best = min(groups, key=lambda v: mean_loss(groups[v]))
    rows = {}
    for other in groups:
        if other == best:
            continue
        try:
            rows[other] = stats.compare(groups[other], groups[best], level=level)
        except ValueError:  # not comparable (other eval batches): never a reason to prune
            continue
    names = list(rows)
    adjusted = dict(zip(names, stats.holm([rows[n].p for n in names])))
    out = {}
    for variant, r in rows.items():
        # Training noise must be in the interval: with one seed on a side (so far), eval-sample noise alone would
        # stop equally good variants most of the time (benchmarks/results/verdict_calibration.md).
        if not ((r.training_noise or single_seed_ok) and r.diff >= NEGLIGIBLE and adjusted[variant] < threshold):
            continue
        out[variant] = Decision(
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
            compared_step=step,
            metric=metric,
        )
    return out


def equivalent(groups: dict[str, dict[int, dict]], threshold: float, margin: float) -> dict[str, dict] | None:
    """seeds=auto's settled contest (docs/design/pruning.md, "seeds=auto"): {variant: its comparison}
    when every variant in `groups` is within `margin` of the best (the lowest mean), else None. Each one's interval
    against the best at 1 - 2 x threshold / m (two one-sided tests at threshold / m, m the variants compared, so
    Bonferroni over them) must lie inside (-margin, margin) with training noise in it: when a variant is in fact
    worse by margin or more, a look settles with chance at most `threshold`, the share the look spends."""
    if len(groups) < 2 or threshold <= 0 or margin <= 0:
        return None
    from slurm_router.verdict import stats  # scipy: imported when a prune decision is made, not by every worker

    best = min(groups, key=lambda v: mean_loss(groups[v]))
    others = [v for v in groups if v != best]
    confidence = 1 - 2 * threshold / len(others)
    out = {}
    for other in others:
        try:
            r = stats.compare(groups[other], groups[best], level=confidence)
        except ValueError:  # other eval batches: nothing to settle on
            return None
        if not (r.training_noise and -margin < r.ci_low and r.ci_high < margin):
            return None
        out[other] = {"best": best, "diff": r.diff, "ci_low": r.ci_low, "ci_high": r.ci_high, "confidence": confidence}
    return out


def reason(who: str, d: Decision) -> str:
    """'r4-s0: pruned at step 10: worse than r32 by 0.412 nats per token (95% CI 0.301 to 0.523, p = 1e-05;
    Holm-adjusted over 2 variants p = 2e-05, below 0.0167 = 5% / 3 looks; r4 2 seeds, r32 2 seeds x 16 eval
    batches at step 8, the run's look 2)'."""
    nd = 3 if max(abs(d.ci_low), abs(d.ci_high)) >= 0.01 else 4
    family = f"Holm-adjusted over {d.n_compared} variants {_p(d.p_holm)}, " if d.n_compared > 1 else ""
    units = "eval batches" if d.metric == "loss" else "example clusters"
    seeds = f"{d.variant} {_n(d.n_seeds, 'seed')}, {d.best} {_n(d.n_seeds_best, 'seed')} x {d.n_batches} {units}"
    if d.look:
        seeds += f" at step {d.compared_step}, the run's look {d.look}"
    return (
        f"{who}: pruned at step {d.step}: worse than {d.best} by {d.diff:.{nd}f} {unit(d.metric)} (95% CI "
        f"{d.ci_low:.{nd}f} to {d.ci_high:.{nd}f}, {_p(d.p)}; {family}below {d.threshold:.3g} = "
        f"{d.spending or f'5% / {d.looks} looks'}; {seeds})"
    )


def unit(metric: str) -> str:
    """How a difference reads: in nats per token (held-out loss), or in a task metric's own score."""
    return "nats per token" if metric == "loss" else f"in {metric}"


def _n(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _p(p: float) -> str:
    return "p < 1e-6" if p < 1e-6 else f"p = {p:.2g}"


# A real effect is not the same on every held-out sample: over eval batches the difference spreads by about a third
# of itself (issue 36: a loser 0.6-0.7 nats worse, 2 seeds x 4 eval batches, was never below p = 0.011). So the
# eval batches' part of the interval alone keeps the difference within sqrt(B) / BATCH_SPREAD standard errors,
# however well the seeds agree, and the p-value above this floor.
BATCH_SPREAD = 0.35


def lowest_p(n_batches: int) -> float:
    """The smallest p-value a comparison over `n_batches` eval batches reaches (0: no floor with one batch)."""
    if n_batches < 2:
        return 0.0
    from scipy import special

    return float(2 * special.stdtr(n_batches - 1, -np.sqrt(n_batches) / BATCH_SPREAD))


def reach_note(n_seeds: int, n_batches: int, steps: int, eval_every: int, n_variants: int) -> str | None:
    """One line when prune=true can never fire: the lowest p-value the tables reach is not below the level a
    decision needs (5% / evaluations, and Holm's first step over the variants compared with the best), with the
    smallest change that lets it: more eval batches, or fewer evaluations (a larger train.eval_every)."""
    n_looks, m = looks(steps, eval_every), max(1, n_variants - 1)
    level = (1 - LEVEL) / n_looks / m
    floor = lowest_p(n_batches)
    if floor < level:
        return None
    batches = next(b for b in range(n_batches + 1, 100_000) if lowest_p(b) < level)
    fixes = [f"raise train.eval_batches to {batches}"]
    most = next((k for k in range(n_looks - 1, 0, -1) if floor < (1 - LEVEL) / k / m), 0)
    if most:
        every = next(e for e in range(eval_every + 1, steps + 1) if looks(steps, e) <= most)
        fixes.append(f"train.eval_every to {every} ({_n(most, 'evaluation')})")
    holm = f" / {m} variants compared with the best" if m > 1 else ""
    return (
        f"prune=true: with {_n(n_seeds, 'seed')} x {n_batches} eval batches and {_n(n_looks, 'evaluation')} per task no "
        f"variant can be pruned: the lowest p-value {n_batches} eval batches reach ({floor:.2g}) is not below the "
        f"level each decision needs ({level:.2g} = 5% / {_n(n_looks, 'evaluation')}{holm}); {' or '.join(fixes)}"
    )
