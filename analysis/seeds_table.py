"""The report's "Variants over seeds" section: per variant, its held-out loss (and eval.primary's score) over its
seed replicates, the best seed and the comparison with the base, one unit per column (document.py places it)."""

from __future__ import annotations

import pandas as pd

from slurm_router.analysis.render import fmt


def seeds_section(summary: dict) -> list[tuple]:
    """Per variant, its held-out loss over seeds (shown when a variant has more than one seed); with a task metric
    as eval.primary its scores too. One unit per column, named in its header: held-out loss in nats per token, the
    metric in its own score; the best seed and the comparison with the base are by eval.primary, as the verdict."""
    by_variant = summary.get("by_variant") or {}
    if not any(v["n_seeds"] > 1 for v in by_variant.values()):
        return []
    primary = summary.get("primary") or "loss"
    unit = "held-out loss" if primary == "loss" else primary
    rows = []
    for name, v in by_variant.items():
        losses = v["val_loss_per_seed"]
        row = {
            "variant": name,
            "seeds": v["n_seeds"],
            "held-out loss: mean": fmt(v["val_loss_mean"], ".4f"),
            "held-out loss: std over seeds": fmt(v["val_loss_std"], ".4f"),
            "held-out loss: range": f"{min(losses):.4f} to {max(losses):.4f}" if losses else "-",
            "held-out loss per seed": ", ".join(
                f"s{r['seed']} {r['val_loss']:.4f}" for r in v["replicates"] if r["val_loss"] is not None
            )
            or "-",
        }
        if primary != "loss":
            row[f"{primary}: mean"] = fmt(v.get("score_mean"), ".4f")
            row[f"{primary} per seed"] = (
                ", ".join(f"s{r['seed']} {r['score']:.4f}" for r in v["replicates"] if r.get("score") is not None)
                or "-"
            )
        row[f"best seed (by {unit})"] = "-" if v["best_seed"] is None else str(v["best_seed"])
        row[f"{unit} vs base (95% CI)"] = _vs_base(v.get("vs_base") or {})
        rows.append(row)
    scores = "" if primary == "loss" else f"; {primary} in its own score (mean over examples)"
    return [
        ("h", 2, "Variants over seeds"),
        ("table", pd.DataFrame(rows)),
        (
            "p",
            f"Each seed replicate after training: held-out loss in nats per token{scores}. The verdict compares "
            f"the means of {unit} (eval.primary); the std (n-1) is the training noise one seed alone cannot show. "
            f"The best seed is the one with the best {unit}; the winner's adapter is its best seed's; every "
            "replicate's adapter is in summary.json (by_variant).",
        ),
    ]


def _vs_base(vs: dict) -> str:
    """A variant minus the base, with its 95% interval, in eval.primary's own direction (an ab row's task metric
    difference is signed, lower better)."""
    if vs.get("diff") is None:
        return "-"
    sign = -1.0 if vs.get("higher_is_better") else 1.0
    low, high = sorted((sign * vs["ci_low"] + 0.0, sign * vs["ci_high"] + 0.0))
    return f"{sign * vs['diff'] + 0.0:+.4f} ({low:+.4f} to {high:+.4f})"
