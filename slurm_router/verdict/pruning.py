"""prune=true's rule at one look, pure: which variants are clear losers in one table of evaluations, decided by the
one judgement (verdict/judge.py) on the verdict's own statistics (docs/design/pruning.md, "One judgement"); when
the run looks and what each look may spend is verdict/contest.py and verdict/schedule.py, the files worker/prune.py.

A variant is pruned when some other variant is better than it by a claim the one judgement decides at the look's
level (Holm over every ordered pair of the variants at the look), by more than the negligible, with training noise
in the interval (at least 2 seeds on each side: with one, eval-sample noise alone would stop equally good variants
most of the time). prune=true therefore needs seeds >= 2, and enough eval batches for the level: reach_note says at
submission when it can never fire. Pruning only ends tasks: a task that is not pruned computes exactly what it
computes alone (the router's invariant is untouched).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from slurm_router.verdict import LEVEL


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
    p_adjusted: float  # verdict/judge.py: Holm over every ordered pair of the variants at the look
    threshold: float  # the look's share of 1 - LEVEL (verdict/contest.py spend)
    family: int  # the claims Holm adjusted over: k(k-1) for k variants at the look
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
    adjustment: str = "holm-ordered-pairs"  # verdict/judge.py ADJUSTMENT

    @classmethod
    def from_dict(cls, d: dict) -> Decision:
        """A decisions.jsonl entry, also one written before the one judgement (p_holm over the k - 1 variants
        compared with the best)."""
        d = dict(d)
        if "p_holm" in d:
            d["p_adjusted"] = d.pop("p_holm")
            d["family"] = d.pop("n_compared", 1)
            d["adjustment"] = "holm-vs-best"
        return cls(**d)

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
    """{variant: Decision} of every variant a look at this table prunes: some other variant is better than it by a
    claim the one judgement decides at `threshold` (verdict/judge.py: Holm over every ordered pair, so a variant as
    good as the best is pruned with chance at most `threshold`, for any number of variants), with training noise in
    the interval. It names the variant whose claim against it is strongest. Seeds whose held-out numbers are not
    finite (a diverged replicate) are left out; a variant with none left is not compared."""
    from slurm_router.verdict import judge, stats  # scipy: imported when a prune decision is made, not by every worker

    groups = finite_groups(groups)
    if len(groups) < 2:
        return {}
    names = list(groups)
    rows = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            try:
                rows[a, b] = stats.compare(groups[a], groups[b], level=level)
            except ValueError:  # not comparable (other eval batches): never a reason to prune
                continue
    pairs = list(rows)
    adjusted, family = judge.adjust([rows[p].p for p in pairs])
    out: dict[str, Decision] = {}
    for (a, b), p_adjusted in zip(pairs, adjusted):
        r = rows[a, b]
        loser, best = (a, b) if r.diff > 0 else (b, a)
        # Training noise must be in the interval: with one seed on a side (so far), eval-sample noise alone would
        # stop equally good variants most of the time (benchmarks/results/verdict_calibration.md).
        if not ((r.training_noise or single_seed_ok) and judge.decided(p_adjusted, r.diff, threshold)):
            continue
        if loser in out and out[loser].p_adjusted <= p_adjusted:
            continue
        flip = loser != a  # the Decision reads loser minus best
        out[loser] = Decision(
            variant=loser,
            step=step,
            best=best,
            diff=-r.diff if flip else r.diff,
            ci_low=-r.ci_high if flip else r.ci_low,
            ci_high=-r.ci_low if flip else r.ci_high,
            p=r.p,
            p_adjusted=p_adjusted,
            threshold=threshold,
            family=family,
            looks=max(1, n_looks),
            n_seeds=r.n_seeds_b if flip else r.n_seeds_a,
            n_seeds_best=r.n_seeds_a if flip else r.n_seeds_b,
            n_batches=r.n_batches,
            training_noise=r.training_noise,
            compared_step=step,
            metric=metric,
        )
    return out


def finite_groups(groups: dict[str, dict[int, dict]]) -> dict[str, dict[int, dict]]:
    """`groups` without the seeds whose held-out sums are not all finite (a replicate that diverged: NaN never
    reaches a test, and a NaN variant is never the best), and without a variant left with no seed."""
    out = {}
    for v, side in groups.items():
        kept = {s: r for s, r in side.items() if np.isfinite(np.asarray(r["loss_sums"], float)).all()}
        if kept:
            out[v] = kept
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
    from slurm_router.verdict.judge import family_words

    family = f"Holm-adjusted over {family_words(d.family)} {_p(d.p_adjusted)}, " if d.family > 2 else ""
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


def reach_note(
    n_seeds: int,
    n_batches: int,
    steps: int,
    eval_every: int,
    n_variants: int,
    auto_cap: int | None = None,
    tasks: list[tuple[int, int]] | None = None,
) -> str | None:
    """One line when prune=true can never fire, or (seeds=auto, auto_cap) when its reserves' looks can never prune:
    the lowest p-value the tables reach is not below the level a decision needs (the look's share of 5%: over the
    run's L looks (contest.Schedule, from every task's (steps, eval_every) in `tasks`), halved and split over the
    depths with seeds=auto; then Holm's first step over the k(k-1)/2 pairs of variants), with the smallest change
    that lets it: more eval batches, or fewer evaluations (a larger train.eval_every)."""
    from slurm_router.verdict.schedule import Schedule

    def n_looks(every: int) -> int:
        return Schedule.of([(t, every) for t, _ in tasks] if tasks else [(steps, every)]).n_looks

    pairs = max(1, n_variants * (n_variants - 1) // 2)
    share = 0.5 if auto_cap else 1.0  # seeds=auto: half of 5% to the looks at 2 seeds (contest.spend)
    level = (1 - LEVEL) * share / n_looks(eval_every) / pairs
    floor = lowest_p(n_batches)
    holm = f" / {pairs} pairs of variants" if pairs > 1 else ""
    looks_now = _n(n_looks(eval_every), "look")
    if floor < level:
        if not auto_cap or auto_cap <= 3:
            return None
        deep = level / (auto_cap - 2)  # the depths 3..cap share the other half
        if floor < deep:
            return None
        return (
            f"prune=true with seeds=auto: the looks after the first round (3-{auto_cap} seeds) can never prune: the "
            f"lowest p-value {n_batches} eval batches reach ({floor:.2g}) is not below their level ({deep:.2g} = half "
            f"of 5% / {auto_cap - 2} depths / {looks_now}{holm}); reserves then only settle or reach the cap; "
            f"raise train.eval_batches to {_batches_for(deep, n_batches)}, or lower auto_seeds.max"
        )
    fixes = [f"raise train.eval_batches to {_batches_for(level, n_batches)}"]
    most = next((k for k in range(n_looks(eval_every) - 1, 0, -1) if floor < level * n_looks(eval_every) / k), 0)
    if most:
        every = next((e for e in range(eval_every + 1, steps + 1) if n_looks(e) <= most), 0)
        if every:
            fixes.append(f"train.eval_every to {every} ({_n(most, 'look')})")
    half = "half of " if auto_cap else ""
    return (
        f"prune=true: with {_n(n_seeds, 'seed')} x {n_batches} eval batches and {looks_now} (evaluations from half "
        f"of training on) no variant can be pruned: the lowest p-value {n_batches} eval batches reach ({floor:.2g}) "
        f"is not below the level each decision needs ({level:.2g} = {half}5% / {looks_now}{holm}); "
        f"{' or '.join(fixes)}"
    )


def _batches_for(level: float, n_batches: int) -> int:
    return next(b for b in range(n_batches + 1, 100_000) if lowest_p(b) < level)
