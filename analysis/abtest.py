"""The A/B verdict: a difference in held-out loss with its uncertainty, by a paired bootstrap over eval batches.

Every eval event carries, per eval batch, the summed token loss and the token count, and every task of a run
evaluates the SAME batches (seeded), so batch i of variant A and batch i of variant B are a pair. Resampling
batch indices (with replacement) and recomputing both token-weighted losses on the same resample keeps the
pairing: batch difficulty, which moves both losses together, cancels out of the difference. The point
estimate is the plain difference of the two token-weighted held-out losses on all batches.

The winner is the variant with the lowest final held-out loss; the verdict says whether the bootstrap backs it
against every other variant, and names its adapter (tasks/<variant>/adapter/, slurm_router/adapters.py) so the
user can load it or `python -m slurm_router.export RUN_DIR --merge OUT`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from slurm_router.analysis.load import Task
from slurm_router.layout import FULL_MODEL

N_BOOT = 2000
SEED = 0            # fixed: the same run gives the same report, every time it is regenerated
LEVEL = 0.95
# Below this a difference is float reduction order (routing changes it, never the math), not an effect.
NEGLIGIBLE = 1e-4   # nats per token


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
    return {"loss_sums": np.asarray(row["batch_loss_sums"], float), "tokens": np.asarray(row["batch_tokens"], float),
            "step": int(row["step"])}


def paired_bootstrap(a: dict, b: dict, n_boot: int = N_BOOT, seed: int = SEED) -> dict:
    """Held-out loss of A minus B (nats/token), its bootstrap standard error and 95% interval."""
    n = len(a["loss_sums"])
    if n != len(b["loss_sums"]):
        raise ValueError(f"different eval batches ({n} vs {len(b['loss_sums'])}): the losses cannot be paired")
    diff = a["loss_sums"].sum() / a["tokens"].sum() - b["loss_sums"].sum() / b["tokens"].sum()
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    boot = (a["loss_sums"][idx].sum(1) / a["tokens"][idx].sum(1)
            - b["loss_sums"][idx].sum(1) / b["tokens"][idx].sum(1))
    lo, hi = np.percentile(boot, [100 * (1 - LEVEL) / 2, 100 * (1 + LEVEL) / 2])
    return {"diff": float(diff), "se": float(boot.std(ddof=1)), "ci_low": float(lo), "ci_high": float(hi),
            "n_batches": n, "same_tokens": bool(np.array_equal(a["tokens"], b["tokens"]))}


def verdict(name_a: str, name_b: str, r: dict) -> str:
    """A plain sentence; A's loss minus B's is r['diff'] (lower held-out loss is better)."""
    nd = 3 if max(abs(r["ci_low"]), abs(r["ci_high"])) >= 0.01 else 4      # keep small effects readable
    rough = " (few eval batches: a rough interval)" if r["n_batches"] < 10 else ""
    how = f"paired bootstrap over {r['n_batches']} eval batches"
    if abs(r["diff"]) < NEGLIGIBLE:
        return (f"{name_a} vs {name_b}: no difference detectable: {r['diff']:+.2g} nats per token, below "
                f"{NEGLIGIBLE:g} (float rounding, not an effect; {how})")
    if r["ci_low"] <= 0 <= r["ci_high"]:
        return (f"{name_a} vs {name_b}: no difference detectable: {r['diff']:+.{nd}f} +/- {r['se']:.{nd}f} nats per "
                f"token (95% CI {r['ci_low']:+.{nd}f} to {r['ci_high']:+.{nd}f} includes 0; {how}){rough}")
    winner, loser = (name_a, name_b) if r["diff"] < 0 else (name_b, name_a)
    lo, hi = sorted((abs(r["ci_low"]), abs(r["ci_high"])))
    return (f"{winner} beats {loser} by {abs(r['diff']):.{nd}f} +/- {r['se']:.{nd}f} nats per token "
            f"(95% CI {lo:.{nd}f} to {hi:.{nd}f}, {how}){rough}")


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


def _trained(tasks: list[Task]) -> list[tuple[str, dict | None]]:
    """(name, last eval batches) of every variant not diverged; None for one whose only evaluation is its step-0
    one (not trained yet: that is the base's loss)."""
    return [(t.name, b if b and b["step"] > 0 else None) for t in tasks if t.stage != "base" and not t.diverged
            for b in [eval_batches(t)]]


def compare_all(tasks: list[Task], adapters: dict[str, str | None] | None = None) -> list[dict]:
    """Every pair of variants, then every variant against the base: one row each, with its sentence. A diverged
    variant is in none (the report lists it as diverged): the verdict is among the others."""
    variants = _trained(tasks)
    base, _ = base_batches(tasks)
    pairs = [(variants[i], variants[j]) for i in range(len(variants)) for j in range(i + 1, len(variants))]
    pairs += [(v, ("base", base)) for v in variants]
    rows = []
    for (na, a), (nb, b) in pairs:
        row = {"a": na, "b": nb}
        if a is None or b is None:
            missing = ", ".join(n for n, x in ((na, a), (nb, b)) if x is None)
            row.update(sentence=f"{na} vs {nb}: no verdict ({missing}: no held-out loss after training yet)")
        else:
            try:
                row.update(paired_bootstrap(a, b), step_a=a["step"], step_b=b["step"])
                row["sentence"] = verdict(na, nb, row)
                won = na if row["diff"] < 0 else nb
                if nb != "base" and row["sentence"].startswith(f"{won} beats"):
                    row["sentence"] += f"; {_weights_text((adapters or {}).get(won))}"
                if nb != "base" and a["step"] != b["step"]:
                    row["sentence"] += f" [not final for both: {na} at step {a['step']}, {nb} at step {b['step']}]"
            except ValueError as e:
                row["sentence"] = f"{na} vs {nb}: no verdict ({e})"
        rows.append(row)
    return rows


def _weights_text(path: str | None) -> str:
    """'its adapter: PATH' (or 'its model: PATH' for a variant trained without LoRA, adapters.py)."""
    if not path:
        return "its adapter: none saved yet (the task has not completed)"
    return f"its {'model' if Path(path).name == FULL_MODEL else 'adapter'}: {path}"


def winner(tasks: list[Task], rows: list[dict], adapters: dict[str, str | None] | None = None) -> dict | None:
    """The variant with the lowest final held-out loss (None when no variant has one): {variant, val_loss,
    decided (it beats every other variant: each interval excludes 0), adapter, sentence}."""
    scored = [(float(b["loss_sums"].sum() / max(1.0, b["tokens"].sum())), name) for name, b in _trained(tasks)
              if b is not None]
    if not scored:
        return None
    val_loss, name = min(scored)
    others = [n for _, n in scored if n != name]
    beaten = [r for r in rows if r["b"] != "base" and name in (r["a"], r["b"])
              and r["sentence"].startswith(f"{name} beats")]
    decided = bool(others) and len(beaten) == len(others)
    adapter = (adapters or {}).get(name)
    if not others:
        what = f"{name}: held-out loss {val_loss:.4f} (the only variant with one)"
    elif decided:
        what = f"winner: {name} (held-out loss {val_loss:.4f}; beats {', '.join(others)})"
    else:
        what = (f"lowest held-out loss: {name} ({val_loss:.4f}), not a detectable win over "
                f"{', '.join(n for n in others if not any(n in (r['a'], r['b']) for r in beaten))}")
    return {"variant": name, "val_loss": val_loss, "decided": decided, "adapter": adapter,
            "sentence": f"{what}; {_weights_text(adapter)}"}
