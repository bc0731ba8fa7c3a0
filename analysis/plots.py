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

DPI = 90


def _grid(n: int, title: str, sharex: bool = False):
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.4 * rows), squeeze=False, sharex=sharex)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, list(axes.flat[:n])


def _save(fig, out: Path, name: str) -> str:
    """The figure as out/name, written atomically (WriteError, one line, when the disk refuses)."""
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=DPI)
    plt.close(fig)
    atomic_write(out / name, png.getvalue())
    return name


def loss_curves(tasks: list[Task], base_val_loss: float | None, out: Path) -> str | None:
    variants = [t for t in tasks if t.stage != "base" and (len(t.steps) or len(t.evals))]
    if not variants:
        return None
    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(12.8, 4))
    for t in variants:
        if len(t.steps):
            train_ax.plot(t.steps["step"], t.steps["loss"], label=t.name, lw=1.2)
        if len(t.evals):
            val_ax.plot(t.evals["step"], t.evals["val_loss"], marker="o", label=t.name)
    if base_val_loss is not None:
        val_ax.axhline(base_val_loss, color="grey", ls="--", lw=1, label="base")
    train_ax.set(title="training loss (global, token-weighted)", xlabel="step", ylabel="loss (nats/token)")
    val_ax.set(title="held-out loss", xlabel="step", ylabel="loss (nats/token)")
    for ax in (train_ax, val_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out, "loss.png")


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
        ax.set(title=f"{t.name} ({t.events['policy'].dropna().iloc[0] if 'policy' in t.events else '?'})",
               xlabel="step", ylabel="busy (s)")
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
            line, = ax.plot(x, rows["mem_peak_bytes"] / GIB, lw=1, marker=".", ms=3, label=f"device {d}")
            if int(d) < len(budgets):
                ax.axhline(budgets[int(d)] / GIB, color=line.get_color(), ls="--", lw=1)
        unit = "RSS" if (t.start or {}).get("device_type") == "cpu" else "allocated"
        ax.set(title=t.name, xlabel="time since task start (s)", ylabel=f"peak {unit} (GiB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out, "memory.png")


def all_plots(tasks: list[Task], base_val_loss: float | None, out: Path) -> list[str]:
    names = [loss_curves(tasks, base_val_loss, out), device_load(tasks, out), step_timeline(tasks, out),
             memory_timeline(tasks, out)]
    return [n for n in names if n]


def comparison_plot(rows, out: Path, name: str = "comparison.png") -> str | None:
    """Tokens/s and held-out loss per variant, one bar per run (rows: the comparison table's records)."""
    rows = [r for r in rows if r.get("tokens_per_s")]
    if not rows:
        return None
    runs = list(dict.fromkeys(r["run"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12.8, 4))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        by_v = {r["variant"]: r for r in rows if r["run"] == run}
        x = np.arange(len(variants)) + i * width
        for ax, key in zip(axes, ("tokens_per_s", "val_loss")):
            ax.bar(x, [(by_v.get(v) or {}).get(key) or 0 for v in variants], width, label=run)
    for ax, label in zip(axes, ("tokens/s (after warm-up)", "final held-out loss (nats/token)")):
        ax.set_xticks(np.arange(len(variants)) + 0.4 - width / 2, variants)
        ax.set(ylabel=label)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    return _save(fig, out, name)
