"""The one judgement, pure: which differences between variants are decided, at a given level. Every surface reads
it: a look of prune=true (verdict/pruning.py look_at, at the look's share of the level), the final verdict
(verdict/sentences.py decide_rows, at 5%), and through them summary.json, the report and its plots, status and
export. No other module adjusts a p-value or says "significant" (docs/design/pruning.md, "One judgement").

The family. Each pair of variants (a, b) holds two claims, "a is better than b" and "b is better than a", each a
one-sided test with p / 2 in the direction the data point and 1 - p / 2 in the other (p: verdict/stats.compare's
two-sided p-value). Holm's step-down over all k(k-1) claims bounds, at any dependence, the chance of making any
false claim by the level. A variant as good as the best (tied with it, or the best itself) has every claim against
it false, so the chance that any such variant is declared beaten (pruned at a look, or said to lose in the
verdict) is at most the level, however many variants there are and whichever one the data make look best.
Comparing each variant with the sample best and correcting over k-1 does not: the best is chosen by the data
(A/A at one look: k=4 6.9%, k=8 9.3%, issue 48). For k=2 the adjusted p is the pair's own p.

The adjusted p is on the scale the level reads: a claim is decided when its adjusted p is below the level
(1 - LEVEL for the verdict, the look's share for a look). Its interval, drawn by the report, is the pair's
interval at the level Holm gave that claim (adjusted_interval): it excludes 0 exactly when the claim's own step
passes, so a bar and its label never disagree.
"""

from __future__ import annotations

from slurm_router.verdict import LEVEL, NEGLIGIBLE

ADJUSTMENT = "holm-ordered-pairs"  # the rule's name in the data (decisions.jsonl, summary.json)


def adjust(p_values: list[float]) -> tuple[list[float], int]:
    """(each pair's adjusted p in the direction its data point, the family's size: the k(k-1) claims). p_values:
    the pairs' two-sided p-values. A non-finite p is a claim that cannot be tested: adjusted 1."""
    from slurm_router.verdict.stats import holm

    p = [min(1.0, max(0.0, x)) if x == x else 1.0 for x in p_values]
    one_sided = [x / 2 for x in p] + [1 - x / 2 for x in p]  # the direction observed, then the other one
    adjusted = holm(one_sided)[: len(p)] if p else []
    return [min(1.0, a) for a in adjusted], 2 * len(p)


def decided(p_adjusted: float, diff: float, threshold: float = 1 - LEVEL) -> bool:
    """The one rule: a claim holds when its adjusted p is below `threshold` and the difference is larger than float
    reduction order (routing, packing and fusing change the loss by that much, never more)."""
    return bool(p_adjusted < threshold and abs(diff) >= NEGLIGIBLE)


def claim_level(p: float, p_adjusted: float, threshold: float = 1 - LEVEL) -> float:
    """The two-sided level Holm gave this pair's claim: threshold x p / p_adjusted (its step's share), so that the
    pair's interval at 1 - this level excludes 0 when the claim passes its own step. threshold when unadjusted."""
    if p_adjusted <= 0 or p <= 0 or p_adjusted <= p:
        return threshold
    return threshold * p / p_adjusted


def adjusted_interval(
    a: dict, b: dict, p: float, p_adjusted: float, b_fixed: bool = False
) -> tuple[float, float, float]:
    """(low, high, coverage) of A - B at the level Holm gave the claim (claim_level): the interval the report draws
    beside the adjusted p it shows."""
    from slurm_router.verdict import stats

    coverage = 1 - claim_level(p, p_adjusted)
    d = stats.compare(a, b, b_fixed=b_fixed, level=coverage)
    return d.ci_low, d.ci_high, coverage


def family_words(family: int) -> str:
    """'the 6 ordered pairs of 3 variants': what Holm adjusted over, in words."""
    k = round((1 + (1 + 4 * family) ** 0.5) / 2)
    return f"the {family} ordered pairs of {k} variants"
