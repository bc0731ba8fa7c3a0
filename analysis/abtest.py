"""The verdict: per pair of variants, the difference in held-out loss with its uncertainty, over training seeds
and eval batches together (stats.py holds the statistics; this module picks the data out of a run's tasks).

Every eval event carries, per eval batch, the summed token loss and the token count, and every task of a run
evaluates the SAME batches (seeded by the run's `seed`), so batch i of any two tasks is a pair. A variant run
with `seeds=N` has N replicates (tasks r8-s0, r8-s1, ...: the variant and its training seed come from the
manifest or task.json, load.py); seed s of two variants is a pair too (the same data order). The point estimate
is the difference of the variants' mean held-out losses over their seeds; the interval and p-value include
training noise (how much another seed would move the loss) when a variant has at least 2 seeds, else eval-sample
noise only, and the sentence says which, and on how many seeds and eval batches it rests. More than two
variants: Holm's correction over the pairs.

The winner is the variant with the lowest mean held-out loss; the verdict says whether it beats every other
variant, and names its adapter (tasks/<task>/adapter/, slurm_router/artifacts/adapters.py) so the user can load it or
`python -m slurm_router.export RUN_DIR --merge OUT`: with several seeds, the adapter of its seed with the
lowest held-out loss (the verdict is about the variant; the best replicate is the one to use), and the
report lists every replicate's adapter.

paired_bootstrap() is the verdict before seeds (one training run per variant; resampling eval batches), kept as
the baseline of benchmarks/verdict_calibration.py, which shows how often it claims a difference between
identical variants once training noise exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from slurm_router.analysis import stats
from slurm_router.analysis.load import Task
from slurm_router.rundir.layout import FULL_MODEL

N_BOOT = 2000
SEED = 0  # fixed: the same run gives the same report, every time it is regenerated
LEVEL = 0.95
# Below this a difference is float reduction order (routing changes it, never the math), not an effect.
NEGLIGIBLE = 1e-4  # nats per token


def eval_batches(task: Task, step: int | None = None) -> dict | None:
    """{loss_sums, tokens, step} of the task's last eval (or of `step`), or None if it has none."""
    ev = task.evals
    if ev.empty or "batch_loss_sums" not in ev:
        return None
    ev = ev[ev["batch_loss_sums"].map(lambda v: isinstance(v, list) and len(v) > 0)]
    if step is not None:
        ev = ev[ev["step"] == step]
    if ev.empty:
        return None
    row = ev.iloc[-1]
    return {
        "loss_sums": np.asarray(row["batch_loss_sums"], float),
        "tokens": np.asarray(row["batch_tokens"], float),
        "step": int(row["step"]),
    }


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


def base_batches(tasks: list[Task]) -> tuple[dict | None, str]:
    """The base model's eval batches: the base stage's last eval, else any variant's step-0 eval (a variant
    starts from the base weights, so its step-0 eval IS the base's, e.g. when the base stage was cached)."""
    for t in tasks:
        if t.stage == "base" and (b := eval_batches(t)):
            return b, f"{t.name} (last eval)"
    for t in tasks:
        if t.stage != "base" and (b := eval_batches(t, step=0)):
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


def replicates(tasks: list[Task]) -> dict[str, list[Replicate]]:
    """Every variant (in the order its first task appears) -> its replicates, diverged and pruned ones left out
    (the report lists them as such). A replicate whose only evaluation is its step-0 one is not trained yet."""
    out: dict[str, list[Replicate]] = {}
    for t in tasks:
        if t.stage == "base" or t.diverged or t.pruned:
            continue
        b = eval_batches(t)
        out.setdefault(t.variant, []).append(Replicate(t.name, t.seed, b if b and b["step"] > 0 else None))
    return out


def pruned(tasks: list[Task]) -> dict[str, list[dict]]:
    """Variant -> its replicates that prune=true stopped: [{task, seed, step, detail}] (slurm_router/worker/prune.py)."""
    out: dict[str, list[dict]] = {}
    for t in tasks:
        if t.stage != "base" and t.pruned:
            out.setdefault(t.variant, []).append({"task": t.name, "seed": t.seed, **t.pruned})
    return out


def variant_table(tasks: list[Task], adapters: dict[str, str | None] | None = None) -> dict[str, dict]:
    """Per variant, over its trained seeds: n_seeds, seeds, the held-out loss's mean, std (n-1; None with one
    seed) and per-seed values, the best seed, and each replicate's task, loss and adapter; `pruned`: its
    replicates that prune=true stopped (a variant whose every replicate was pruned has n_seeds 0)."""
    out = {}
    stopped = pruned(tasks)
    reps: list[Any]
    for variant, reps in replicates(tasks).items():
        done = [r for r in reps if r.batches is not None]
        losses = [cast(float, r.val_loss) for r in done]
        best = min(done, key=lambda r: cast(float, r.val_loss)) if done else None
        out[variant] = {
            "n_seeds": len(done),
            "seeds": [r.seed for r in done],
            "tasks": [r.task for r in reps],
            "val_loss_mean": float(np.mean(losses)) if losses else None,
            "val_loss_std": float(np.std(losses, ddof=1)) if len(losses) > 1 else None,
            "val_loss_per_seed": losses,
            "best_seed": best.seed if best else None,
            "best_task": best.task if best else None,
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
                "replicates": [],
                "pruned": reps,
            },
        )
    return out


def compare_all(tasks: list[Task], adapters: dict[str, str | None] | None = None) -> list[dict]:
    """Every pair of variants, then every variant against the base: one row each, with its sentence. Over seeds
    and eval batches (stats.compare); with more than one pair of variants the pairs' p-values get Holm's
    correction (the comparisons with the base do not: each asks its own question, did this variant learn?)."""
    groups = replicates(tasks)
    names = list(groups)
    base, _ = base_batches(tasks)
    pairs = [(names[i], names[j]) for i in range(len(names)) for j in range(i + 1, len(names))]
    pairs += [(n, "base") for n in names]
    rows = []
    for na, nb in pairs:
        row = {"a": na, "b": nb}
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
    _decide(rows, groups, adapters)
    return rows


def trained(reps: list[Replicate]) -> dict:
    """{seed: eval batches} of the replicates trained so far (what stats.compare takes for one side)."""
    return {r.key: r.batches for r in reps if r.batches is not None}


def _decide(rows: list[dict], groups: dict[str, list[Replicate]], adapters: dict | None) -> None:
    """Holm over the pairs of variants, then each row's decision and sentence."""
    family = [r for r in rows if r["b"] != "base" and "p" in r]
    if len(family) > 1:
        for r, adjusted in zip(family, stats.holm([r["p"] for r in family])):
            r.update(p_holm=adjusted, holm_m=len(family))
    for r in rows:
        if "p" not in r:
            continue
        r["significant"] = bool(r.get("p_holm", r["p"]) < 1 - LEVEL and abs(r["diff"]) >= NEGLIGIBLE)
        r["sentence"] = sentence(r["a"], r["b"], r)
        if r["significant"] and r["b"] != "base":
            won = r["a"] if r["diff"] < 0 else r["b"]
            r["sentence"] += f"; {_weights_text(*best_adapter(groups[won], adapters))}"
        if r.get("note"):
            r["sentence"] += f" {r['note']}"


def sentence(name_a: str, name_b: str, r: dict) -> str:
    """The row's plain sentence (A's loss minus B's is r['diff']; lower held-out loss is better)."""
    nd = 3 if max(abs(r["ci_low"]), abs(r["ci_high"])) >= 0.01 else 4  # keep small effects readable
    how = _how(name_a, name_b, r)
    if abs(r["diff"]) < NEGLIGIBLE and r["se"] < NEGLIGIBLE:  # the same computation, up to reduction order
        return (
            f"{name_a} vs {name_b}: no difference detectable: {r['diff']:+.2g} nats per token, below "
            f"{NEGLIGIBLE:g} (float rounding, not an effect; {how})"
        )
    p = _p(r["p"]) + (f", Holm-adjusted for {r['holm_m']} comparisons {_p(r['p_holm'])}" if "p_holm" in r else "")
    if not r["significant"]:
        covers = r["ci_low"] <= 0 <= r["ci_high"]
        after = "" if covers else f" after Holm's correction for {r['holm_m']} comparisons"
        return (
            f"{name_a} vs {name_b}: no difference detectable{after}: {r['diff']:+.{nd}f} +/- {r['se']:.{nd}f} "
            f"nats per token (95% CI {r['ci_low']:+.{nd}f} to {r['ci_high']:+.{nd}f}"
            f"{' includes 0' if covers else ''}; {p}; {how})"
        )
    winner, loser = (name_a, name_b) if r["diff"] < 0 else (name_b, name_a)
    lo, hi = sorted((abs(r["ci_low"]), abs(r["ci_high"])))
    verb = "leads" if one_seed(r) else "beats"  # one seed: training noise is not in the interval
    return (
        f"{winner} {verb} {loser} by {abs(r['diff']):.{nd}f} +/- {r['se']:.{nd}f} nats per token "
        f"(95% CI {lo:.{nd}f} to {hi:.{nd}f}, {p}; {how})"
    )


def _how(name_a: str, name_b: str, r: dict) -> str:
    """What the interval rests on: seeds and eval batches, and what it leaves out."""
    B = r["n_batches"]
    rough = "; few eval batches: a rough interval" if B < 10 else ""
    if r["method"] == "crossed":
        seeds = r["n_seeds_paired"]
        pairing = "paired by eval batch" if name_b == "base" else "paired by seed and eval batch"
        return f"{seeds} seeds x {B} eval batches, {pairing}{rough}"
    if r["method"] == "welch":
        return (
            f"{name_a} {r['n_seeds_a']} seeds, {name_b} {r['n_seeds_b']} seeds (not the same ones) x {B} eval "
            f"batches, paired by eval batch{rough}"
        )
    one = [n for n, k in ((name_a, r["n_seeds_a"]), (name_b, r["n_seeds_b"])) if k == 1 and n != "base"]
    whose = "of 1 seed" if len(one) != 1 or name_b == "base" else f"({one[0]} has 1 seed)"
    return f"paired t-test over {B} eval batches {whose}{rough}: eval-sample noise only"


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


def best_adapter(reps: list[Replicate], adapters: dict | None) -> tuple[str | None, str]:
    """(path, what it is) of a variant's adapter: with several seeds, the seed with the lowest held-out loss."""
    done = [r for r in reps if r.batches is not None]
    if not done:
        return None, ""
    best = min(done, key=lambda r: cast(float, r.val_loss))
    why = f" (seed {best.seed}: the lowest held-out loss of its {len(done)} seeds)" if len(done) > 1 else ""
    return (adapters or {}).get(best.task), why


def _weights_text(path: str | None, why: str = "") -> str:
    """'its adapter: PATH' (or 'its model: PATH' for a variant trained without LoRA, adapters.py)."""
    if not path:
        return f"its adapter{why}: none saved yet (the task has not completed)"
    return f"its {'model' if Path(path).name == FULL_MODEL else 'adapter'}{why}: {path}"


def winner(tasks: list[Task], rows: list[dict], adapters: dict[str, str | None] | None = None) -> dict | None:
    """The variant with the lowest held-out loss (mean over its seeds; None when no variant has one): {variant,
    val_loss, n_seeds, decided (it beats every other variant: significant, after Holm's correction), adapter
    (of its best seed), seed, task, sentence}."""
    groups = replicates(tasks)
    scored = [
        (float(np.mean([r.val_loss for r in reps if r.batches is not None])), name)
        for name, reps in groups.items()
        if any(r.batches is not None for r in reps)
    ]
    if not scored:
        return None
    val_loss, name = min(scored)
    done = [r for r in groups[name] if r.batches is not None]
    best = min(done, key=lambda r: cast(float, r.val_loss))
    others = [n for _, n in scored if n != name]
    beaten = [
        r
        for r in rows
        if r["b"] != "base"
        and name in (r["a"], r["b"])
        and r.get("significant")
        and (r["a"] if r["diff"] < 0 else r["b"]) == name
    ]
    # a variant every replicate of which was pruned lost to the best one at that evaluation (prune.py)
    lost = [n for n in pruned(tasks) if n not in groups]
    decided = bool(others or lost) and len(beaten) == len(others)
    adapter, why = best_adapter(groups[name], adapters)
    loss = f"held-out loss {val_loss:.4f}" + (f", mean of {len(done)} seeds" if len(done) > 1 else "")
    if not others and not lost:
        what = f"{name}: {loss} (the only variant with one)"
    elif decided and any(one_seed(r) for r in beaten):  # significant on eval batches, training noise unknown
        ahead = others + [f"{n} (pruned)" for n in lost]
        what = f"leads: {name} ({loss}; ahead of {', '.join(ahead)} on 1 seed)"
    elif decided:
        beats = others + [f"{n} (pruned)" for n in lost]
        what = f"winner: {name} ({loss}; beats {', '.join(beats)})"
    else:
        what = (
            f"lowest held-out loss: {name} ({loss}), not a detectable win over "
            f"{', '.join(n for n in others if not any(n in (r['a'], r['b']) for r in beaten))}"
        )
    return {
        "variant": name,
        "val_loss": val_loss,
        "n_seeds": len(done),
        "decided": decided,
        "adapter": adapter,
        "seed": best.seed,
        "task": best.task,
        "sentence": f"{what}; {_weights_text(adapter, why)}",
    }
