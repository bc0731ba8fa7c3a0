"""The table a run prints at its end (rich): each task's state, losses, tokens/s and balance, and the verdict's
line, from the summary report.py computed (docs/ARCHITECTURE.md, "Rooms")."""

from __future__ import annotations

from slurm_router.analysis.render import fmt, pct


def print_table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{summary['experiment']}: held-out loss (nats/token) and routing")
    cols = (
        "variant",
        "val_loss",
        "train_loss",
        "tokens/s",
        "balance",
        "cost_bal",
        "useful",
        "oom",
        "steps",
        "devices",
        "policy",
    )
    for col in cols:
        t.add_column(col, justify="left" if col in ("variant", "policy") else "right")
    base = summary["base"].get("val_loss")
    t.add_row("base", fmt(base, ".4f"), *[""] * (len(cols) - 2))
    for name, v in summary["variants"].items():
        val = "diverged" if v.get("diverged") else fmt(v.get("val_loss"), ".4f")
        val += f" (pruned at {v['pruned']['step']})" if v.get("pruned") else ""
        t.add_row(
            name,
            val,
            fmt(v.get("train_loss"), ".4f"),
            fmt(v.get("tokens_per_s"), ",.0f"),
            "n/a" if v.get("devices") == 1 else fmt(v.get("balance_ratio"), ".3f"),
            "n/a" if v.get("devices") == 1 else fmt(v.get("cost_balance_ratio"), ".3f"),
            pct(v.get("useful_token_fraction"), 0),
            str(v.get("oom_retries", "-")),
            str(v.get("steps")),
            str(v.get("devices")),
            str(v.get("policy")),
        )
    console = Console(width=140)
    console.print(t)
    for name, v in (summary.get("by_variant") or {}).items():
        if v["n_seeds"] > 1:
            console.print(
                f"{name}: held-out {v['val_loss_mean']:.4f} +/- {v['val_loss_std']:.4f} (std over "
                f"{v['n_seeds']} seeds)",
                highlight=False,
            )
    if summary.get("caveat"):
        console.print(f"note: {summary['caveat']}", highlight=False)
    if summary.get("winner"):
        console.print(summary["winner"]["sentence"], highlight=False)
    if summary.get("disagreement"):  # held-out loss and eval.primary name different winners
        console.print(summary["disagreement"], highlight=False)
    for line in summary.get("diverged", []):
        console.print(line, highlight=False)
    for row in summary.get("ab", []):
        console.print(row["sentence"], highlight=False)
    for line in summary.get("pruned", []):
        console.print(line, highlight=False)
    if summary.get("auto_seeds"):  # seeds=auto: replicates run, and why the rest were not
        console.print(summary["auto_seeds"]["line"], highlight=False)
    for line in summary.get("missing", []):
        console.print(f"missing: {line}", highlight=False)
    if summary.get("partial"):
        console.print(summary["partial"], highlight=False)
    from slurm_router.tracking.replay import tracker_lines  # tracker=...: where to look, and the `wandb sync` line

    for line in tracker_lines(summary["run_dir"]):
        print(line, flush=True)
