"""The report's plots (matplotlib, Agg: no display needed). Each writes one PNG into the report folder and
returns its file name, or None when there is nothing to draw (a task with no events yet)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402

from slurm_router.analysis.load import Task, atomic_write  # noqa: E402
from slurm_router.analysis.metrics import GIB, warmup_steps  # noqa: E402
from slurm_router.verdict import LEVEL  # noqa: E402

DPI = 90


def _grid(n: int, title: str, sharex: bool = False):
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.4 * rows), squeeze=False, sharex=sharex)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, list(axes.flat[:n])


def _save(fig, out: Path, name: str, fit_text: bool = False) -> str:
    """The figure as out/name, written atomically (WriteError, one line, when the disk refuses). fit_text: the
    canvas grows to hold text drawn outside the axes."""
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=DPI, bbox_inches="tight" if fit_text else None)
    plt.close(fig)
    atomic_write(out / name, png.getvalue())
    return name


def smooth(y, window: int):
    """A centred rolling mean over `window` points (fewer at the ends)."""
    import pandas as pd

    return pd.Series(np.asarray(y, float)).rolling(window, center=True, min_periods=1).mean().to_numpy()


def loss_curves(tasks: list[Task], base_val_loss: float | None, out: Path) -> str | None:
    """Training loss (raw, faint, and smoothed) and held-out loss over the eval steps: one line per task (a seed
    replicate), one colour per variant."""
    variants = [t for t in tasks if t.stage != "base" and (len(t.steps) or len(t.evals))]
    if not variants:
        return None
    names = list(dict.fromkeys(t.variant for t in variants))
    colour = {v: f"C{i % 10}" for i, v in enumerate(names)}
    n_seeds = {v: sum(t.variant == v for t in variants) for v in names}
    longest = max((len(t.steps) for t in variants), default=0)
    window = max(1, longest // 10) | 1
    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(12.8, 4))
    labelled: set[tuple] = set()

    def label(ax, v: str) -> str | None:
        if (id(ax), v) in labelled:
            return None
        labelled.add((id(ax), v))
        return f"{v} ({n_seeds[v]} seeds)" if n_seeds[v] > 1 else v

    for t in variants:
        c = colour[t.variant]
        if len(t.steps):
            train_ax.plot(t.steps["step"], t.steps["loss"], color=c, lw=0.7, alpha=0.3)
            train_ax.plot(
                t.steps["step"], smooth(t.steps["loss"], window), color=c, lw=1.5, label=label(train_ax, t.variant)
            )
        if len(t.evals):
            val_ax.plot(
                t.evals["step"], t.evals["val_loss"], color=c, marker="o", ms=3, lw=1.2, label=label(val_ax, t.variant)
            )
    if base_val_loss is not None:
        val_ax.axhline(base_val_loss, color="grey", ls="--", lw=1, label="base")
    smoothed = f"bold: rolling mean over {window} steps" if window > 1 else "too few steps to smooth"
    train_ax.set(title=f"training loss per seed (faint: raw; {smoothed})", xlabel="step", ylabel="loss (nats/token)")
    val_ax.set(title="held-out loss at each evaluation (train.eval_every)", xlabel="step", ylabel="loss (nats/token)")
    for ax in (train_ax, val_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out, "loss.png")


def forest_rows(summary: dict) -> dict | None:
    """What forest() draws, from the verdict's rows (summary.json `ab`), deciding nothing of its own: {best, rows:
    [{name, diff, low, high, filled, label}], xlabel, title}; None without a winner. Each variant's difference to
    the best in eval.primary's own direction (other minus best). A pair of variants has the interval at the level
    Holm gave it (ci_adjusted_*, verdict/judge.adjusted_interval) beside its adjusted p, so its bar excludes 0
    exactly when the verdict calls the difference (filled); the base keeps its own 95% interval and p. A difference
    the verdict does not judge (no spread to measure it by, or below float rounding) says so in its label."""
    best = (summary.get("winner") or {}).get("variant")
    if not best:
        return None
    primary = summary.get("primary") or "loss"
    rows = []
    for r in summary.get("ab", []):
        if "diff" not in r or best not in (r["a"], r["b"]):
            continue
        other = r["b"] if r["a"] == best else r["a"]
        sign = (1 if r["a"] == other else -1) * (-1 if r.get("higher_is_better") else 1)  # other minus best, own way
        adjusted = other != "base" and r.get("ci_adjusted_low") is not None
        low, high = (r["ci_adjusted_low"], r["ci_adjusted_high"]) if adjusted else (r["ci_low"], r["ci_high"])
        lo, hi = sorted((sign * low + 0.0, sign * high + 0.0))
        diff, filled = sign * r["diff"] + 0.0, bool(r.get("significant"))
        p = r.get("p_adjusted", r["p"]) if adjusted else r["p"]
        coverage = r.get("ci_adjusted_coverage", LEVEL) if adjusted else LEVEL
        label = f"{diff:+.4f} [{lo:+.4f}, {hi:+.4f}] at {coverage:.2%}"
        label += f"  {'Holm-adjusted ' if adjusted and r.get('family', 0) > 2 else ''}p={p:.2g}"
        if not filled and (lo > 0 or hi < 0):  # excludes 0, yet the verdict makes no claim: say why
            label += "  not judged: " + ("no spread to measure it by" if r.get("se") == 0 else "below float rounding")
        rows.append({"name": other, "diff": diff, "low": lo, "high": hi, "filled": filled, "label": label})
    if any(r["name"] != "base" for r in rows):
        rows = [r for r in rows if r["name"] != "base"]
    if not rows:
        return None
    rows.sort(key=lambda x: abs(x["diff"]))  # the closest to the best first
    seeds = (summary.get("winner") or {}).get("n_seeds") or 1
    rests = f"{seeds} seeds per variant" if seeds > 1 else "1 seed: eval-sample noise only"
    what = "held-out loss" if primary == "loss" else primary
    unit = " (nats/token)" if primary == "loss" else ""
    interval = (
        "interval at the level Holm gave each pair (its adjusted p beside it)"
        if rows[0]["name"] != "base"
        else f"{LEVEL:.0%} interval"
    )
    return {
        "best": best,
        "rows": rows,
        "xlabel": f"{what} minus {best}'s{unit}; {interval}",
        "title": f"difference to the best variant ({rests})\nfilled: a difference the verdict calls (its interval "
        "excludes 0); hollow: none detectable",
    }


def forest(summary: dict, out: Path) -> str | None:
    """Each variant's difference to the best variant (forest_rows): filled where the verdict calls it a difference,
    hollow where not, each bar the interval its label and the verdict read. The base is shown only when there is
    no other variant (its gap would flatten the variants' differences; the tables have it)."""
    drawn = forest_rows(summary)
    if drawn is None:
        return None
    rows = drawn["rows"]
    fig, ax = plt.subplots(figsize=(7.6, 1.6 + 0.45 * (len(rows) + 1)))
    y = np.arange(len(rows), 0, -1)
    ax.scatter([0], [len(rows) + 1], color="black", marker="D", zorder=3)
    for yi, r in zip(y, rows):
        ax.errorbar(
            r["diff"],
            yi,
            xerr=[[max(0.0, r["diff"] - r["low"])], [max(0.0, r["high"] - r["diff"])]],
            fmt="o",
            color="black" if r["filled"] else "grey",
            mfc="black" if r["filled"] else "white",
            capsize=3,
            zorder=3,
        )
        ax.annotate(r["label"], (1.01, yi), xycoords=("axes fraction", "data"), va="center", fontsize=8)
    ax.axvline(0, color="grey", lw=1, ls="--")
    ax.set_yticks([len(rows) + 1, *y], [f"{drawn['best']} (best)", *[r["name"] for r in rows]])
    ax.set(xlabel=drawn["xlabel"], title=drawn["title"])
    ax.grid(alpha=0.3, axis="x")
    ax.set_ylim(0.4, len(rows) + 1.6)
    return _save(fig, out, "forest.png", fit_text=True)


def device_load(tasks: list[Task], out: Path) -> str | None:
    """Per step, each device's busy time (compute of its share, before the gradient sync)."""
    shown = [t for t in tasks if len(t.steps)]
    if not shown:
        return None
    fig, axes = _grid(len(shown), "per-device load per step (busy time before the gradient sync)")
    for ax, t in zip(axes, shown):
        busy = np.array(t.steps["busy_s_all"].tolist(), dtype=float)
        for d in range(busy.shape[1]):
            ax.plot(t.steps["step"], busy[:, d], lw=1.1, label=f"device {d}")
        ax.set(
            title=f"{t.name} ({t.events['policy'].dropna().iloc[0] if 'policy' in t.events else '?'})",
            xlabel="step",
            ylabel="busy (s)",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=min(4, busy.shape[1]))
    return _save(fig, out, "device_load.png")


def step_timeline(tasks: list[Task], out: Path) -> str | None:
    shown = [t for t in tasks if len(t.steps)]
    if not shown:
        return None
    fig, axes = _grid(len(shown), "step time over the run (hollow: warm-up, left out of throughput)")
    for ax, t in zip(axes, shown):
        s = t.steps
        x = s["time"] - t.events["time"].min()
        is_warm = s["step"] < warmup_steps(s)
        ax.plot(x, s["t_step_s"], color="tab:blue", lw=0.8)
        ax.scatter(x[~is_warm], s["t_step_s"][~is_warm], s=10, color="tab:blue")
        ax.scatter(x[is_warm], s["t_step_s"][is_warm], s=18, facecolors="none", edgecolors="tab:red")
        if "t_sync_wait_s" in s:
            ax.plot(x, s["t_sync_wait_s"], color="tab:orange", lw=0.8, label="sync wait (device 0)")
            ax.legend(fontsize=7)
        ax.set(title=t.name, xlabel="time since task start (s)", ylabel="step time (s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    return _save(fig, out, "step_time.png")


def memory_timeline(tasks: list[Task], out: Path) -> str | None:
    shown = [t for t in tasks if len(t.micro) and "mem_peak_bytes" in t.micro]
    if not shown:
        return None
    fig, axes = _grid(len(shown), "memory peak per micro-batch against the router's budget (dashed)")
    for ax, t in zip(axes, shown):
        t0 = t.events["time"].min()
        budgets = (t.start or {}).get("mem_budget_bytes") or []
        for d, rows in t.micro.groupby("device"):
            x = (rows["t_start"] if "t_start" in rows else rows["time"]) - t0
            (line,) = ax.plot(x, rows["mem_peak_bytes"] / GIB, lw=1, marker=".", ms=3, label=f"device {d}")
            if int(d) < len(budgets):
                ax.axhline(budgets[int(d)] / GIB, color=line.get_color(), ls="--", lw=1)
        unit = "RSS" if (t.start or {}).get("device_type") == "cpu" else "allocated"
        ax.set(title=t.name, xlabel="time since task start (s)", ylabel=f"peak {unit} (GiB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out, "memory.png")


def all_plots(tasks: list[Task], base_val_loss: float | None, out: Path, summary: dict | None = None) -> list[str]:
    names = [
        loss_curves(tasks, base_val_loss, out),
        forest(summary or {}, out),
        device_load(tasks, out),
        step_timeline(tasks, out),
        memory_timeline(tasks, out),
    ]
    return [n for n in names if n]


def comparison_plot(rows, out: Path, name: str = "comparison.png") -> str | None:
    """Tokens/s per variant, one bar per run; and each variant's held-out loss minus the first run's (a bar
    chart of losses from 0 hides a 0.009 difference; the differences are the point)."""
    rows = [r for r in rows if r.get("tokens_per_s")]
    if not rows:
        return None
    runs = list(dict.fromkeys(r["run"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    first = {r["variant"]: r.get("val_loss") for r in rows if r["run"] == runs[0]}
    fig, (speed_ax, loss_ax) = plt.subplots(1, 2, figsize=(12.8, 4))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        by_v = {r["variant"]: r for r in rows if r["run"] == run}
        x = np.arange(len(variants)) + i * width
        speed_ax.bar(x, [(by_v.get(v) or {}).get("tokens_per_s") or 0 for v in variants], width, label=run)
        diffs = [
            (by_v.get(v) or {}).get("val_loss") - first[v]
            if (by_v.get(v) or {}).get("val_loss") is not None and first.get(v) is not None
            else np.nan
            for v in variants
        ]
        bars = loss_ax.bar(x, diffs, width, label=run)
        loss_ax.bar_label(bars, labels=["" if d != d else f"{d:+.4f}" for d in diffs], fontsize=7)
    loss_ax.axhline(0, color="grey", lw=1)
    loss_ax.set_title(f"final held-out loss minus {runs[0]}'s", fontsize=9)
    labels = ("tokens/s (after warm-up)", "held-out loss difference (nats/token)")
    for ax, label in zip((speed_ax, loss_ax), labels):
        ax.set_xticks(np.arange(len(variants)) + 0.4 - width / 2, variants)
        ax.set(ylabel=label)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    return _save(fig, out, name)
