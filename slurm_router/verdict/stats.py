"""The verdict's statistics, pure (numpy and scipy.stats; no run, no pandas): the difference in held-out loss
between two variants over training seeds AND eval batches together, its interval, its p-value, and Holm's
correction when several pairs are compared. analysis/abtest.py (the report) and verdict/pruning.py feed it the
runs' eval events; the calibration on simulated loss tables is benchmarks/verdict_calibration.py (tests/test_verdict_stats.py asserts it).

The data. A replicate is one training seed of one variant (a task). Its last evaluation gives, per eval batch i,
the summed token loss and the token count; its held-out loss is sum(loss sums) / sum(tokens). Write it as the
mean over the B batches of x[i] = B * loss_sum[i] / tokens_total (exact), so a variant's seeds x eval batches
form a table whose grand mean is the mean held-out loss over its seeds. Every task evaluates the SAME batches
(seeded by the run's `seed`), so batch i pairs across all tasks; seed s pairs across variants when both ran it
(the same data order), and the base (one fixed model) pairs with every seed.

The model (two-way crossed random effects, on the difference table D[s, i] = x_A[s, i] - x_B[s, i]):
    D[s, i] = mu + a_s + b_i + e_si
a_s is training noise (LoRA init, data order: what another seed would change), b_i is eval-sample noise
(which held-out samples were drawn: another eval set would change it), e_si their interaction. The variance
of the grand mean, var(a)/S + var(b)/B + var(e)/(S*B), is estimated from the two-way ANOVA mean squares as
two parts: the seeds' MS_seed / (S*B) (S - 1 df; it holds var(a)/S + var(e)/(S*B)) and the eval batches'
(MS_batch - MS_resid) / (S*B) (B - 1 df; var(b)/B; 0 when negative). The 95% interval adds each part's
standard error times its own Student t quantile in quadrature (Banerjee's interval) and the p-value is the
level at which it just reaches 0 (scipy's t quantiles and root finder). Student's t with Satterthwaite's pooled
df would be the textbook choice, but with 2-3 seeds it claims differences between identical variants 6-10% of
the time instead of 5% (Behrens-Fisher: 2 df beside 31, mixed in an estimated ratio); Banerjee's never exceeds
the level, is exact when one part dominates and conservative (down to ~2-3%) when both matter. A bootstrap over
3 seeds has 10 distinct resamples: its intervals are far too narrow. benchmarks/results/verdict_calibration.md
has the figures.

Eval batches must be independent units: examples that share a source (the pieces of one file) are one cluster,
and an eval batch holds whole sources (train/data.py eval_batches). Where the recorded `sources` say batches share
one, they are summed into one unit before the variance (by_cluster: cluster-robust), so file-level effects are
not mistaken for eval-sample noise that averages out.

Seeds that differ between the two sides (a replicate failed): paired on the seeds both have when there are at
least 2; else, with at least 2 seeds each, three parts (each side's seed spread, and the eval batches' paired
difference of the seed means: conservative, the interaction is counted twice). With one seed (either side)
training noise cannot be estimated: the test is a paired t-test over eval batches, and its interval covers
eval-sample noise only (`training_noise` False; the verdict says so).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from scipy import optimize, special

from slurm_router.verdict import LEVEL


@dataclass
class Difference:
    """A minus B in held-out loss (nats per token; negative: A is better), over seeds and eval batches."""

    diff: float  # mean over A's seeds of A's held-out loss minus the same for B
    se: float  # standard error of diff
    ci_low: float
    ci_high: float
    p: float  # two-sided, H0: no difference
    df: float  # Satterthwaite's df of the whole (for reading; the interval uses each part's)
    n_seeds_a: int
    n_seeds_b: int
    n_seeds_paired: int  # seeds both sides ran (0: not paired by seed)
    n_batches: int
    training_noise: bool  # the interval includes training noise (at least 2 seeds)
    method: str  # "crossed" | "welch" | "batches"

    def as_dict(self) -> dict:
        return asdict(self)


def metric_side(entry: dict) -> dict:
    """A replicate's per-example scores of a task metric (an eval row's `metrics[NAME]`: scores, higher_is_better,
    sources) as this module's input: one eval "batch" per example with one "token", its score negated when higher
    is better, so that everywhere here lower is better and x[i] is the example's (signed) score. Examples that
    share a source become one cluster (by_cluster)."""
    scores = np.asarray(entry["scores"], float)
    sign = -1.0 if entry.get("higher_is_better", True) else 1.0
    sources = entry.get("sources")
    return {
        "loss_sums": sign * scores,
        "tokens": np.ones(len(scores)),
        "sources": [[s] for s in sources] if sources is not None else None,
    }


def contributions(loss_sums, tokens) -> np.ndarray:
    """x[i] = B * loss_sum[i] / sum(tokens): its mean over batches is the token-weighted held-out loss."""
    loss_sums, tokens = np.asarray(loss_sums, float), np.asarray(tokens, float)
    return len(loss_sums) * loss_sums / max(1.0, tokens.sum())


def table(replicates: dict) -> tuple[list, np.ndarray]:
    """(seeds, S x B table of contributions) of {seed: {loss_sums, tokens}}."""
    seeds = sorted(replicates, key=str)
    return seeds, np.array([contributions(replicates[s]["loss_sums"], replicates[s]["tokens"]) for s in seeds])


def clusters(sources: list) -> list[int]:
    """Per eval batch, its cluster: batches that share a source (a file whose pieces are in both) are one, and so
    on transitively. sources[i]: the source ids of batch i's samples (or one id)."""
    parent = list(range(len(sources)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict = {}
    for i, ids in enumerate(sources):
        for s in ids if isinstance(ids, (list, tuple)) else [ids]:
            parent[root(i)] = root(first.setdefault(s, i))
    roots = [root(i) for i in range(len(sources))]
    order = {r: k for k, r in enumerate(dict.fromkeys(roots))}
    return [order[r] for r in roots]


def by_cluster(a: dict, b: dict) -> tuple[dict, dict]:
    """Both sides with each cluster's batches summed into one (cluster-robust: the pieces of one file are not
    independent samples, so they count once in the variance). Sides without sources (runs that did not record
    them) or whose batches share no source are returned as they are."""
    sources = next((r["sources"] for r in (*a.values(), *b.values()) if r.get("sources") is not None), None)
    if sources is None:
        return a, b
    labels = clusters(list(sources))
    if len(set(labels)) == len(labels):
        return a, b

    def merged(r: dict) -> dict:
        if len(r["loss_sums"]) != len(labels):
            return r  # other eval batches: compare() refuses them
        out = {k: np.bincount(labels, weights=np.asarray(r[k], float)) for k in ("loss_sums", "tokens")}
        return {**out, "sources": [[c] for c in range(max(labels) + 1)]}

    return {s: merged(r) for s, r in a.items()}, {s: merged(r) for s, r in b.items()}


def compare(a: dict, b: dict, b_fixed: bool = False, level: float = LEVEL) -> Difference:
    """A vs B, each {seed: {loss_sums, tokens}} (one entry per replicate). b_fixed: B is one fixed model (the
    base, where every variant starts) and pairs with every seed of A. ValueError when the eval batches are not
    the same ones (a different number of them, or other token counts). A side's entries may carry `sources`
    (per eval batch, the files its samples come from): batches that share one are summed first (by_cluster)."""
    a, b = by_cluster(a, b)
    seeds_a, xa = table(a)
    seeds_b, xb = table(b)
    if not (np.isfinite(xa).all() and np.isfinite(xb).all()):
        raise ValueError("a held-out number is not finite (a diverged replicate): the losses cannot be compared")
    if xa.shape[1] != xb.shape[1]:
        raise ValueError(f"different eval batches ({xa.shape[1]} vs {xb.shape[1]}): the losses cannot be paired")
    tokens = {tuple(np.asarray(r["tokens"], float)) for r in (*a.values(), *b.values())}
    if len(tokens) > 1:  # the same batches have the same target tokens, whatever the model
        raise ValueError(
            "different eval batches (their token counts differ: another seed, or other data "
            "settings, chose them): the losses cannot be paired"
        )
    n_a, n_b, B = len(seeds_a), len(seeds_b), xa.shape[1]
    if b_fixed:
        seeds_b, xb = seeds_a, np.repeat(xb.mean(0, keepdims=True), n_a, axis=0)
    common = [s for s in seeds_a if s in seeds_b]
    if len(common) >= 2:  # paired by seed and by eval batch
        D = xa[[seeds_a.index(s) for s in common]] - xb[[seeds_b.index(s) for s in common]]
        return _finish(float(D.mean()), crossed_parts(D), level, n_a, n_b, len(common), B, "crossed")
    diff = float(xa.mean() - xb.mean())
    d = xa.mean(0) - xb.mean(0)  # the seed means' difference per eval batch
    batches = [(float(d.var(ddof=1)) / B, B - 1)] if B > 1 else []
    if n_a >= 2 and n_b >= 2:  # seeds not shared: each side's seed spread, paired by eval batch
        seeds = [(float(x.mean(1).var(ddof=1)) / len(x), len(x) - 1) for x in (xa, xb)]
        return _finish(diff, seeds + batches, level, n_a, n_b, 0, B, "welch")
    if not batches:  # one seed and one eval batch: no spread to measure noise by
        raise ValueError(
            "1 eval batch of 1 seed: nothing to estimate the noise from; raise train.eval_batches "
            "(or data.val_fraction, for more held-out samples), or run seeds=3"
        )
    return _finish(diff, batches, level, n_a, n_b, len(common), B, "batches")  # one seed: over eval batches


def crossed_parts(D: np.ndarray) -> list[tuple[float, float]]:
    """[(variance, df)] of the grand mean of an S x B table of seeds x eval batches (S >= 2): the seeds' part
    MS_seed / (S*B) (S - 1 df) and the eval batches' part (MS_batch - MS_resid) / (S*B) (B - 1 df; left out
    when negative). Together: (MS_seed + MS_batch - MS_resid) / (S*B)."""
    S, B = D.shape
    grand, row, col = D.mean(), D.mean(1), D.mean(0)
    ms_seed = B * float(((row - grand) ** 2).sum()) / (S - 1)
    if B < 2:
        return [(ms_seed / (S * B), S - 1)]
    ms_batch = S * float(((col - grand) ** 2).sum()) / (B - 1)
    df_res = (S - 1) * (B - 1)
    ms_res = float(((D - row[:, None] - col[None, :] + grand) ** 2).sum()) / df_res
    parts = [(ms_seed / (S * B), S - 1)]
    if ms_batch > ms_res:
        parts.append(((ms_batch - ms_res) / (S * B), B - 1))
    return parts


def satterthwaite(terms: list[tuple[float, float]]) -> float:
    """Degrees of freedom of a sum of signed mean squares, each with its df."""
    total = sum(v for v, _ in terms)
    denom = sum(v**2 / df for v, df in terms if df > 0)
    return float(total**2 / denom) if denom > 0 else float("inf")


def half_width(parts: list[tuple[float, float]], alpha: float) -> float:
    """Banerjee's interval: each part's standard error times its own Student t quantile, added in quadrature.
    Never narrower than the exact t interval of the part that dominates, so a part with few df (the seeds) is
    not diluted by one with many (the eval batches), as Satterthwaite's pooled df would."""
    return float(np.sqrt(sum(special.stdtrit(df, 1 - alpha / 2) ** 2 * v for v, df in parts if v > 0)))


def p_value(diff: float, parts: list[tuple[float, float]]) -> float:
    """The smallest two-sided level whose interval excludes 0 (the interval inverted)."""
    if abs(diff) >= half_width(parts, 1e-15):
        return 1e-15
    if abs(diff) <= half_width(parts, 1.0 - 1e-12):
        return 1.0
    return float(
        optimize.brentq(lambda a: half_width(parts, a) - abs(diff), 1e-15, 1.0 - 1e-12, xtol=1e-17, rtol=1e-10)
    )


def _finish(diff, parts, level, n_a, n_b, n_paired, B, method) -> Difference:
    parts = [(v, df) for v, df in parts if v == v and v > 0]
    se = float(np.sqrt(sum(v for v, _ in parts)))
    if se > 0:
        half, p = half_width(parts, 1 - level), p_value(diff, parts)
    else:  # no spread at all: identical tasks, or a difference the same on every seed and batch (a constant
        # metric). Nothing measures its noise, so it is never a finding (verdict/judge.py); p 1, not 0.
        half, p = 0.0, 1.0
    df = satterthwaite(parts) if parts else float("inf")
    return Difference(
        diff=diff,
        se=se,
        ci_low=diff - half,
        ci_high=diff + half,
        p=p,
        df=df,
        n_seeds_a=n_a,
        n_seeds_b=n_b,
        n_seeds_paired=n_paired,
        n_batches=B,
        training_noise=method != "batches",
        method=method,
    )


def mean_interval(side: dict, level: float = LEVEL) -> tuple[float, float, float]:
    """(mean, 95% interval low, high) of one variant's seeds x eval batches (or examples) table: its difference
    from a fixed zero, so the interval holds the same training and eval-sample noise as the verdict's."""
    zero = next(iter(side.values()))
    zero = {**zero, "loss_sums": np.zeros(len(zero["loss_sums"]))}
    d = compare(side, {"zero": zero}, b_fixed=True, level=level)
    return d.diff, d.ci_low, d.ci_high


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error at most the level, any dependence)."""
    p = np.asarray(p_values, float)
    m = len(p)
    order = np.argsort(p, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adjusted
    return out.tolist()
