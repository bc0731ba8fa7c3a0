"""The verdict's rows in words, pure: Holm over the pairs of variants, each row's decision (significant: below
the level after Holm, and not negligible) and its sentence, what the interval rests on, and the one-seed caveat.
analysis/abtest.py builds the rows from a run's tasks and adds the winner's adapter.

paired_bootstrap() is the verdict before seeds (one training run per variant; resampling eval batches), kept as
the baseline of benchmarks/verdict_calibration.py, which shows how often it claims a difference between
identical variants once training noise exists.
"""

from __future__ import annotations

import numpy as np

from slurm_router.verdict import LEVEL, NEGLIGIBLE, judge

N_BOOT = 2000
SEED = 0  # fixed: the same run gives the same report, every time it is regenerated


def decide_rows(rows: list[dict]) -> None:
    """The one judgement (verdict/judge.py) over the pairs of variants (rows whose b is not "base"): each row's
    adjusted p (`p_adjusted`, `adjustment`, `family`), `significant` and `sentence`. A row against the base asks
    its own question (did this variant learn?) and is judged on its own p."""
    family = [r for r in rows if r["b"] != "base" and "p" in r]
    adjusted, size = judge.adjust([r["p"] for r in family])
    for r, p_adjusted in zip(family, adjusted):
        r.update(p_adjusted=p_adjusted, adjustment=judge.ADJUSTMENT, family=size)
    for r in rows:
        if "p" in r:
            r["significant"] = significant(r)
            r["sentence"] = sentence(r["a"], r["b"], r)


def significant(r: dict) -> bool:
    """The one rule (verdict/judge.decided) at 5%, on the row's adjusted p when it has one."""
    return judge.decided(r.get("p_adjusted", r["p"]), r["diff"])


def sentence(name_a: str, name_b: str, r: dict) -> str:
    """The row's plain sentence (A's loss minus B's is r['diff']; lower held-out loss is better). A row of a task
    metric (r['metric']; stats.metric_side's signed scores, lower is better) reads in the metric's own score."""
    nd = 3 if max(abs(r["ci_low"]), abs(r["ci_high"])) >= 0.01 else 4  # keep small effects readable
    how = _how(name_a, name_b, r)
    unit = f"in {r['metric']}" if r.get("metric") else "nats per token"
    sign = -1 if r.get("higher_is_better") else 1  # A minus B in the metric's own direction
    shown, low, high = sign * r["diff"] + 0.0, *sorted((sign * r["ci_low"], sign * r["ci_high"]))
    if abs(r["diff"]) < NEGLIGIBLE and r["se"] < NEGLIGIBLE:  # the same computation, up to reduction order
        return (
            f"{name_a} vs {name_b}: no difference detectable: {shown:+.2g} {unit}, below "
            f"{NEGLIGIBLE:g} (float rounding, not an effect; {how})"
        )
    adjusted = r.get("family", 0) > 2  # one pair: its adjusted p is its own
    p = _p(r["p"]) + (
        f", Holm-adjusted over {judge.family_words(r['family'])} {_p(r['p_adjusted'])}" if adjusted else ""
    )
    if r["se"] == 0:  # the same difference on every seed and eval batch: no noise to judge it against
        return (
            f"{name_a} vs {name_b}: not judged: {shown:+.{nd}f} {unit} on every seed and "
            f"{'example' if r.get('metric') else 'eval batch'} alike, so there is no noise to measure it against "
            f"(more eval samples, or seeds=3, give it some; {how})"
        )
    if not r["significant"]:
        covers = r["ci_low"] <= 0 <= r["ci_high"]
        after = "" if covers or not adjusted else f" after Holm's correction over {judge.family_words(r['family'])}"
        return (
            f"{name_a} vs {name_b}: no difference detectable{after}: {shown:+.{nd}f} +/- {r['se']:.{nd}f} "
            f"{unit} (95% CI {low:+.{nd}f} to {high:+.{nd}f}"
            f"{' includes 0' if covers else ''}; {p}; {how})"
        )
    winner, loser = (name_a, name_b) if r["diff"] < 0 else (name_b, name_a)
    lo, hi = sorted((abs(r["ci_low"]), abs(r["ci_high"])))
    verb = "leads" if one_seed(r) else "beats"  # one seed: training noise is not in the interval
    return (
        f"{winner} {verb} {loser} by {abs(r['diff']):.{nd}f} +/- {r['se']:.{nd}f} {unit} "
        f"(95% CI {lo:.{nd}f} to {hi:.{nd}f}, {p}; {how})"
    )


def _how(name_a: str, name_b: str, r: dict) -> str:
    """What the interval rests on: seeds and eval batches (or examples), and what it leaves out."""
    B = r["n_batches"]
    units = "example clusters" if r.get("metric") else "eval batches"  # examples sharing a source count once
    rough = f"; few {units}: a rough interval" if B < 10 else ""
    if r["method"] == "crossed":
        seeds = r["n_seeds_paired"]
        pairing = "paired by eval batch" if name_b == "base" else "paired by seed and eval batch"
        pairing = pairing.replace("eval batch", "example") if r.get("metric") else pairing
        return f"{seeds} seeds x {B} {units}, {pairing}{rough}"
    if r["method"] == "welch":
        return (
            f"{name_a} {r['n_seeds_a']} seeds, {name_b} {r['n_seeds_b']} seeds (not the same ones) x {B} {units}, "
            f"paired by {units[:-1]}{rough}"
        )
    one = [n for n, k in ((name_a, r["n_seeds_a"]), (name_b, r["n_seeds_b"])) if k == 1 and n != "base"]
    whose = "of 1 seed" if len(one) != 1 or name_b == "base" else f"({one[0]} has 1 seed)"
    return f"paired t-test over {B} {units} {whose}{rough}: eval-sample noise only"


ONE_SEED_CAVEAT = (
    "One training seed: the intervals cover eval-sample noise only (which held-out samples were drawn), not "
    "training noise (LoRA init, data order), so a variant that 'leads' may not win on another seed; seeds=3 "
    "puts training noise in the interval."
)


def one_seed(r: dict) -> bool:
    """A row whose interval has no training noise in it (a one-seed paired t-test over eval batches)."""
    return r.get("method") == "batches"


def one_seed_caveat(rows: list[dict]) -> str | None:
    """The caveat, said once (the report's banner), when any comparison rests on one seed."""
    return ONE_SEED_CAVEAT if any(one_seed(r) for r in rows if "diff" in r) else None


def _p(p: float) -> str:
    return "p < 1e-6" if p < 1e-6 else f"p = {p:.2g}"


def paired_bootstrap(a: dict, b: dict, n_boot: int = N_BOOT, seed: int = SEED) -> dict:
    """Held-out loss of A minus B (nats/token), its bootstrap standard error and 95% interval."""
    n = len(a["loss_sums"])
    if n != len(b["loss_sums"]):
        raise ValueError(f"different eval batches ({n} vs {len(b['loss_sums'])}): the losses cannot be paired")
    diff = a["loss_sums"].sum() / a["tokens"].sum() - b["loss_sums"].sum() / b["tokens"].sum()
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    boot = a["loss_sums"][idx].sum(1) / a["tokens"][idx].sum(1) - b["loss_sums"][idx].sum(1) / b["tokens"][idx].sum(1)
    lo, hi = np.percentile(boot, [100 * (1 - LEVEL) / 2, 100 * (1 + LEVEL) / 2])
    return {
        "diff": float(diff),
        "se": float(boot.std(ddof=1)),
        "ci_low": float(lo),
        "ci_high": float(hi),
        "n_batches": n,
        "same_tokens": bool(np.array_equal(a["tokens"], b["tokens"])),
    }
