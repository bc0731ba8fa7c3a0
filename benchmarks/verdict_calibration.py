"""Is the verdict calibrated? Simulated loss tables (no training): hundreds of A/A draws (two equally good
variants) must claim a difference at most at the stated 5%; A/B draws with a known effect give the power.
Writes benchmarks/results/verdict_calibration.md; tests/test_verdict_stats.py asserts the calibration bound.

    python benchmarks/verdict_calibration.py [--draws 2000] [--real-run | --run RUN_DIR]

--real-run trains REAL_RUN (lora_ab with 3 seeds, short) in a temporary folder and adds its noise sizes;
--run reads a run you made. The file is always written whole, every section by the command at its top.

A simulated replicate (variant v, training seed s) has, on eval batch i (token count n_i), the per-token loss
    h_i + effect_v + tau_vs + g_vi + e_vsi
h_i: the batch's difficulty, shared by every task (the same eval batches); tau_vs: training noise (LoRA init,
data order), correlated between variants that share seed s (the same data order); g_vi: which eval samples
favour variant v (another eval set would change the difference; 0 for identical variants); e_vsi: the
replicate's own per-batch noise. The default sizes are lora_ab's: 32 eval batches of ~2,600 target tokens, a
per-batch loss spread of 0.09 nats, a per-batch difference of ~0.006 nats between two trained models (a
one-seed standard error of ~0.001: the figures of a real lora_ab report); the training noise (0.004 nats per
replicate) is an assumption, larger than that standard error, as the issue says it often is.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats as sps

from slurm_router.verdict import stats
from slurm_router.verdict.sentences import paired_bootstrap

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import REPO, check, header, write  # noqa: E402

ALPHA = 0.05
RESULTS = Path(__file__).resolve().parent / "results" / "verdict_calibration.md"
# --real-run: a short lora_ab with 3 training seeds (the base stage and its cache in a temporary folder)
REAL_RUN = ["+experiment=lora_ab", "seeds=3", "base.steps=60", "train.steps=50"]


@dataclass(frozen=True)
class Noise:
    difficulty: float = 0.09  # sd over eval batches of the per-token loss (shared by all tasks)
    train: float = 0.004  # sd over training seeds of a replicate's held-out loss
    seed_corr: float = 0.5  # correlation of two variants' training noise under the same seed
    variant_batch: float = 0.003  # sd of a variant's lasting per-batch deviation (eval-sample noise)
    replicate_batch: float = 0.003  # sd of a replicate's own per-batch deviation
    tokens: tuple[int, int] = (2000, 3200)


REGIMES = {  # name -> noise; the first is the default
    "equally good variants": Noise(),
    "identical variants": Noise(variant_batch=0.0),
    "eval-sample noise dominates": Noise(train=0.0003),
    "per-batch replicate noise dominates": Noise(train=0.0005, variant_batch=0.0, replicate_batch=0.01),
}


def simulate(
    rng: np.random.Generator,
    n_seeds: int,
    n_batches: int = 32,
    effects=(0.0, 0.0),
    noise: Noise = Noise(),
    shared_seeds: bool = True,
) -> list[dict]:
    """One experiment: per variant {seed: {loss_sums, tokens}} (the per-batch sums a task's eval event has).
    shared_seeds False: the variants ran different seeds (their training noise is independent)."""
    tokens = rng.integers(*noise.tokens, size=n_batches)
    difficulty = 2.5 + rng.normal(0, noise.difficulty, n_batches)
    common = rng.normal(0, 1, n_seeds)  # the shared seed's part of the training noise
    rho = noise.seed_corr if shared_seeds else 0.0
    out = []
    for v, effect in enumerate(effects):
        lasting = rng.normal(0, noise.variant_batch, n_batches)
        tau = noise.train * (np.sqrt(rho) * common + np.sqrt(1 - rho) * rng.normal(0, 1, n_seeds))
        seeds = range(n_seeds) if shared_seeds else range(v * 100, v * 100 + n_seeds)
        out.append(
            {
                s: {
                    "loss_sums": tokens
                    * (difficulty + effect + tau[j] + lasting + rng.normal(0, noise.replicate_batch, n_batches)),
                    "tokens": tokens,
                }
                for j, s in enumerate(seeds)
            }
        )
    return out


def new_rejects(a: dict, b: dict) -> bool:
    """The verdict: stats.compare (crossed seeds x eval batches, Banerjee's interval)."""
    return stats.compare(a, b).p < ALPHA


def old_rejects(a: dict, b: dict) -> bool:
    """The verdict before seeds: a paired bootstrap over the eval batches of one training run each."""
    r = paired_bootstrap(a[min(a)], b[min(b)], n_boot=1000)
    return not r["ci_low"] <= 0 <= r["ci_high"]


def welch_rejects(a: dict, b: dict) -> bool:
    """The obvious alternative: the same variance, Student's t with Satterthwaite's pooled df."""
    _, xa = stats.table(a)
    _, xb = stats.table(b)
    D = xa - xb
    parts = stats.crossed_parts(D)
    se = np.sqrt(sum(v for v, _ in parts))
    return abs(D.mean()) / se > sps.t.ppf(1 - ALPHA / 2, stats.satterthwaite(parts))


def hier_boot_rejects(a: dict, b: dict, rng: np.random.Generator, n_boot: int = 1000) -> bool:
    """The naive alternative: resample seeds (paired), then eval batches; 95% percentile interval."""
    _, xa = stats.table(a)
    _, xb = stats.table(b)
    D = xa - xb
    S, B = D.shape
    seed_counts = np.apply_along_axis(np.bincount, 1, rng.integers(0, S, size=(n_boot, S)), minlength=S)
    batch_counts = np.apply_along_axis(np.bincount, 1, rng.integers(0, B, size=(n_boot, B)), minlength=B)
    boot = np.einsum("bs,si,bi->b", seed_counts, D, batch_counts) / (S * B)
    lo, hi = np.percentile(boot, [100 * ALPHA / 2, 100 * (1 - ALPHA / 2)])
    return not lo <= 0 <= hi


def rate(rejects, n_draws: int, seed: int, **sim) -> float:
    """The share of n_draws simulated experiments where `rejects` says 'a difference'."""
    rng = np.random.default_rng(seed)
    return float(np.mean([rejects(*simulate(rng, **sim)) for _ in range(n_draws)]))


def holm_fwer(
    n_draws: int, seed: int, n_variants: int = 4, n_seeds: int = 3, noise: Noise = Noise()
) -> tuple[float, float]:
    """(family-wise error with Holm, without) over every pair of n_variants equally good variants."""
    rng = np.random.default_rng(seed)
    any_holm = any_raw = 0
    for _ in range(n_draws):
        vs = simulate(rng, n_seeds, effects=(0.0,) * n_variants, noise=noise)
        p = [stats.compare(vs[i], vs[j]).p for i in range(n_variants) for j in range(i + 1, n_variants)]
        any_raw += min(p) < ALPHA
        any_holm += min(stats.holm(p)) < ALPHA
    return any_holm / n_draws, any_raw / n_draws


def power(effect: float, n_seeds: int, n_draws: int, seed: int = 5) -> float:
    """The share of draws where the better variant (lower loss by `effect`) is declared the winner."""
    rng = np.random.default_rng(seed)
    wins = 0
    for _ in range(n_draws):
        r = stats.compare(*simulate(rng, n_seeds, effects=(0.0, effect)))
        wins += r.p < ALPHA and r.diff < 0
    return wins / n_draws


def prune_rates(
    n_draws: int,
    seed: int,
    effects=(0.0, 0.0, 0.0),
    n_seeds: int = 3,
    looks: int = 4,
    noise: Noise = Noise(),
    single_seed_ok: bool = False,
) -> tuple[float, float]:
    """prune=true (slurm_router/verdict/pruning.py) over `looks` evaluations of len(effects) variants (the first is the
    best; effect > 0 is worse by that much): (the share of draws where a variant as good as the best is ever
    pruned, the share where each worse variant is pruned, averaged). Each look draws fresh tables: evaluations
    of one run are correlated over time, which only lowers the first rate (Bonferroni holds under any
    dependence). single_seed_ok: what the rule would do if it pruned on eval-sample noise alone."""
    from slurm_router.verdict import pruning

    rng = np.random.default_rng(seed)
    names = [f"v{i}" for i in range(len(effects))]
    equal = [n for n, e in zip(names, effects) if e == effects[0]]
    worse = [n for n, e in zip(names, effects) if e > effects[0]]
    false_prunes, caught = 0, 0
    for _ in range(n_draws):
        gone = set()
        for look in range(looks):
            groups = dict(zip(names, simulate(rng, n_seeds, effects=effects, noise=noise)))
            gone |= {
                n
                for n in names
                if n not in gone and pruning.decide(groups, n, look + 1, looks, single_seed_ok=single_seed_ok)
            }
        false_prunes += bool(gone & set(equal))
        caught += len(gone & set(worse))
    return false_prunes / n_draws, caught / (n_draws * max(1, len(worse)))


def band(n_draws: int, p: float = ALPHA, level: float = 0.99) -> tuple[float, float]:
    """The binomial `level` band of an observed rate over n_draws when the true rate is p."""
    lo, hi = sps.binom.interval(level, n_draws, p)
    return lo / n_draws, hi / n_draws


def prune_section(n: int) -> list[str]:
    """prune=true: how often an equally good variant is stopped, and how often a worse one is."""
    lines = [
        "",
        "## prune=true: early stops (slurm_router/verdict/pruning.py)",
        "",
        f"3 variants, 4 in-training evaluations (each a fresh draw), {n} simulated runs per cell, default "
        "noise. A/A: all three equally good, the share of runs where any variant is ever pruned (wanted: at "
        "most 5%). A/B: one variant worse by the effect (nats per token), the share of runs where it is "
        "pruned at some evaluation.",
        "",
        "| seeds | A/A: any pruned | worse by 0.005 | worse by 0.01 | worse by 0.02 |",
        "|---:|---:|---:|---:|---:|",
    ]
    aa_rates = {}
    for S in (2, 3, 5):
        aa, _ = prune_rates(n, 11, n_seeds=S)
        aa_rates[S] = aa
        caught = [prune_rates(n, 12, effects=(0.0, 0.0, e), n_seeds=S)[1] for e in (0.005, 0.01, 0.02)]
        lines.append(f"| {S} | **{aa:.1%}** | " + " | ".join(f"{c:.0%}" for c in caught) + " |")
    worst = max(aa_rates, key=aa_rates.get)
    lines += [
        "",
        f"A/A: a variant as good as the best is pruned in at most {aa_rates[worst]:.1%} of runs ({worst} "
        f"seeds); {'at or below' if aa_rates[worst] <= ALPHA else 'above'} the 5% wanted.",
        "",
        "With one seed the interval cannot include training noise: without that rule, the same A/A runs "
        f"prune a variant {prune_rates(n, 11, n_seeds=1, single_seed_ok=True)[0]:.0%} of the time, so "
        "prune=true needs seeds >= 2 (and waits for a second seed of each side before it decides).",
    ]
    return lines


def print_prune_section(n: int) -> None:
    """A quick look at the prune section alone (printed, the results file untouched)."""
    t0 = time.time()
    print(
        "\n".join(prune_section(n)[1:]) + f"\n\n({time.time() - t0:.0f} s; not written: the results file is "
        "written whole by the full command)"
    )


AA_ROWS = [(1, 32, True), (2, 32, True), (3, 32, True), (5, 32, True), (10, 32, True), (3, 16, True), (3, 32, False)]


def train_real_run(tmp: Path) -> Path:
    """REAL_RUN in tmp (its own base cache): the run dir."""
    argv = [sys.executable, "-m", "slurm_router", *REAL_RUN, f"base.cache_dir={tmp / 'cache'}", f"run_root={tmp}"]
    proc = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=3600, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return Path(proc.stdout.strip().splitlines()[-1].removeprefix("run_dir: "))


def real_run(run_dir: Path, command: str | None = None) -> list[str]:
    """The noise sizes of a real run with seeds (python -m slurm_router +experiment=lora_ab seeds=3 ...): the
    training noise against the eval-sample noise the one-seed verdict sees."""
    from slurm_router.analysis.abtest import compare_all, eval_batches, replicates
    from slurm_router.analysis.load import load_run

    manifest, tasks = load_run(run_dir)
    groups = {v: {r.key: r.batches for r in reps if r.batches} for v, reps in replicates(tasks).items()}
    (va, a), (vb, b) = list(groups.items())[:2]
    _, xa = stats.table(a)
    _, xb = stats.table(b)
    D = xa - xb
    one = [stats.compare({s: a[s]}, {s: b[s]}) for s in a]
    steps = {eval_batches(t)["step"] for t in tasks if t.stage != "base"}
    lines = [
        "",
        f"## A real run: {va} vs {vb}, {len(a)} seeds",
        "",
        f"`{command or 'python -m slurm_router ' + ' '.join(manifest.get('command', [])[1:])}` "
        f"({', '.join(map(str, sorted(steps)))} steps, {D.shape[1]} eval batches of "
        f"~{np.mean(a[min(a)]['tokens']):,.0f} target tokens).",
        "",
        f"- held-out loss over seeds: {va} {xa.mean():.4f} (std {xa.mean(1).std(ddof=1):.4f}), {vb} "
        f"{xb.mean():.4f} (std {xb.mean(1).std(ddof=1):.4f})",
        f"- the difference per seed: {', '.join(f'{d:+.4f}' for d in D.mean(1))} (std "
        f"{D.mean(1).std(ddof=1):.4f}: training noise); one seed's standard error from its eval batches alone: "
        f"{np.mean([r.se for r in one]):.4f} (per-batch spread of the difference {D.std(1, ddof=1).mean():.4f})",
        "- one-seed verdicts: "
        + "; ".join(f"seed {s}: {r.diff:+.4f} (95% CI {r.ci_low:+.4f} to {r.ci_high:+.4f})" for s, r in zip(a, one)),
    ]
    lines += [
        f"- the verdict: {r['sentence'].split('; its adapter')[0]}" for r in compare_all(tasks) if r["b"] != "base"
    ][:1]
    return lines


def _pct_range(xs: list[float]) -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo:.1%}" if f"{lo:.1%}" == f"{hi:.1%}" else f"{lo:.1%}-{hi:.1%}"


def _row_name(r: dict) -> str:
    return f"{r['regime']}, {r['seeds']} seed{'s' if r['seeds'] != 1 else ''}, {r['batches']} eval batches" + (
        "" if r["shared"] else ", different seeds"
    )


def aa_sentences(rows: list[dict], lo: float, hi: float) -> list[str]:
    """Every sentence under the A/A table, computed from its rows."""
    one = [r for r in rows if r["seeds"] == 1]
    multi = [r for r in rows if r["seeds"] >= 2]
    few = [r for r in multi if r["seeds"] <= 3 and r["naive"] is not None]
    many = [r for r in multi if r["seeds"] >= 5 and r["welch"] is not None]
    out = []
    for r in one:
        out.append(
            f"- 1 seed ({_row_name(r)}): no test can include training noise. The old bootstrap claims a "
            f"difference in {r['old']:.1%} of these A/A draws, the new verdict's 1-seed test (a paired t-test "
            f"over eval batches) in {r['new']:.1%}: the verdict's sentence with one seed says its interval "
            "covers eval-sample noise only and suggests `seeds=3`."
        )
    if few:
        out.append(
            f"- The seeds-then-batches bootstrap with 2-3 seeds: {_pct_range([r['naive'] for r in few])} "
            "(a bootstrap over S seeds has only C(2S-1, S) distinct seed resamples: 3 for 2 seeds, 10 for 3)."
        )
        out.append(
            f"- Student's t with Satterthwaite's pooled df: {_pct_range([r['welch'] for r in few])} with 2-3 "
            f"seeds, {_pct_range([r['welch'] for r in many])} with 5 or more (the Behrens-Fisher problem: "
            "S-1 df for the seeds, B-1 for the eval batches, and an estimated mix of the two)."
        )
    if multi:
        top = max(multi, key=lambda r: r["new"])
        low = min(multi, key=lambda r: r["new"])
        n_ok = sum(r["new"] <= ALPHA for r in multi)
        inside = sum(lo <= r["new"] <= hi for r in multi)
        below = sum(r["new"] < lo for r in multi)
        above = sum(r["new"] > hi for r in multi)
        by_regime = "; ".join(
            f"{g} {_pct_range([r['new'] for r in multi if r['regime'] == g])}"
            for g in dict.fromkeys(r["regime"] for r in multi)
        )
        out.append(
            "- New: the two-way (seeds x eval batches) variance of the mean difference, MS_seed + (MS_batch - "
            "MS_resid)+ over S*B, each part's standard error times its own Student t quantile, added in "
            "quadrature (Banerjee's interval; the p-value inverts it). With 2 or more seeds its false-claim "
            f"rate is at most {top['new']:.1%} ({_row_name(top)}) and at least {low['new']:.1%} "
            f"({_row_name(low)}); {n_ok} of {len(multi)} rows at or below 5%, {inside} inside the 99% band, "
            f"{below} below it, {above} above it. Per noise regime: {by_regime}."
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument(
        "--real-run",
        action="store_true",
        help="train REAL_RUN (lora_ab, 3 seeds, short) in a temporary folder, report its noise sizes",
    )
    parser.add_argument("--run", type=Path, help="report the noise sizes of this real run with seeds instead")
    parser.add_argument(
        "--prune-only",
        action="store_true",
        help="print only the prune=true section (a quick look; the results file is not written)",
    )
    args = parser.parse_args()
    if not args.prune_only:
        check(RESULTS)
    n = args.draws
    if args.prune_only:
        return print_prune_section(min(n, 1000))
    command = (
        f"python benchmarks/verdict_calibration.py --draws {n}"
        + (" --real-run" if args.real_run else "")
        + (f" --run {args.run}" if args.run else "")
    )
    t0 = time.time()
    lo, hi = band(n)
    lines = [
        "# Verdict calibration (simulated loss tables)",
        "",
        *header(command),
        "",
        f"{n} simulated experiments per cell, 5% level. A test calibrated at 5% shows a rate inside the binomial "
        f"99% band [{lo:.1%}, {hi:.1%}]. The simulation model and its noise sizes are in the script's docstring.",
        "",
        "## A/A: two equally good variants (false-positive rate; at most 5% wanted)",
        "",
        "| noise | seeds | eval batches | same seeds | old: 1-seed bootstrap (first seed) "
        "| seeds-then-batches bootstrap | t, Satterthwaite df | **new** |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    hier_rng = np.random.default_rng(7)
    rows = []
    for i, (name, noise) in enumerate(REGIMES.items()):
        for S, B, shared in AA_ROWS if i == 0 else [(2, 32, True), (3, 32, True), (5, 32, True)]:
            sim = dict(n_seeds=S, n_batches=B, noise=noise, shared_seeds=shared)
            multi = S >= 2 and shared
            r = {
                "regime": name,
                "seeds": S,
                "batches": B,
                "shared": shared,
                "old": rate(old_rejects, n, 1, **sim),
                "naive": rate(lambda a, b: hier_boot_rejects(a, b, hier_rng), n, 2, **sim) if multi else None,
                "welch": rate(welch_rejects, n, 3, **sim) if multi else None,
                "new": rate(new_rejects, n, 3, **sim),
            }
            rows.append(r)
            mark = "" if S < 2 or r["new"] <= hi else " (above the band)"
            cells = " | ".join("-" if r[k] is None else f"{r[k]:.1%}" for k in ("naive", "welch"))
            lines.append(
                f"| {name} | {S} | {B} | {'yes' if shared else 'no'} | {r['old']:.1%} | {cells} | "
                f"**{r['new']:.1%}**{mark} |"
            )
    fw_holm, fw_raw = holm_fwer(n, 4)
    lines += [
        "",
        *aa_sentences(rows, lo, hi),
        "",
        "## Several variants: Holm's correction",
        "",
        f"4 equally good variants, 3 seeds, every pair (6 comparisons): family-wise false-positive rate "
        f"{fw_raw:.1%} without a correction, **{fw_holm:.1%}** with Holm's (wanted: at most 5%).",
        "",
        "## A/B: power (share of draws where the better variant is declared the winner, new verdict)",
        "",
        "Default noise (training noise 0.004 nats per replicate, 32 eval batches); effect in nats per token.",
        "",
        "| effect | 2 seeds | 3 seeds | 5 seeds | 10 seeds |",
        "|---:|---:|---:|---:|---:|",
    ]
    for effect in (0.002, 0.005, 0.01, 0.02):
        lines.append(f"| {effect} | " + " | ".join(f"{power(effect, S, n):.0%}" for S in (2, 3, 5, 10)) + " |")
    lines += prune_section(min(n, 1000))
    if args.real_run:
        with tempfile.TemporaryDirectory(prefix="verdict_calibration-") as tmp:
            run_dir = train_real_run(Path(tmp))
            lines += real_run(
                run_dir, "python -m slurm_router " + " ".join(REAL_RUN) + " base.cache_dir=TMP/cache run_root=TMP"
            )
    elif args.run:
        lines += real_run(args.run)
    lines += ["", f"Computed in {time.time() - t0:.0f} s; load average (1 min) {os.getloadavg()[0]:.2f} at the end."]
    write(RESULTS, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
