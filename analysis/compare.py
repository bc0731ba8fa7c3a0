"""Several runs side by side (e.g. two router policies on the same experiment): one row per (run, task),
speed-up against the first run, and, for a variant present in several runs, its held-out loss compared with the
first run's by the verdict's statistics (abtest.py, stats.compare: over its seeds and eval batches, paired by
seed and eval batch when both runs ran the same seeds). Routing must not change the math, so 'no difference
detectable' (float rounding) is expected between policies; another lr or data order is a real difference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from slurm_router.analysis import abtest, plots
from slurm_router.analysis.load import Task, atomic_write, make_dir
from slurm_router.analysis.metrics import finite
from slurm_router.analysis.render import fmt, pct, to_html, to_markdown
from slurm_router.rundir.layout import RunLayout
from slurm_router.verdict import stats
from slurm_router.verdict.sentences import sentence, significant

NOT_A_DIFFERENCE = ("run_root", "base.cache_dir")  # where a run went, not what it did


def run_configs(run_dirs: list[Path]) -> list[dict]:
    """Each run's resolved config (config.yaml), flattened to dotted keys; {} where it cannot be read."""
    import yaml

    from slurm_router.analysis.report import _flat

    out = []
    for run_dir in run_dirs:
        try:
            out.append(_flat(yaml.safe_load(RunLayout(run_dir).config.read_text()) or {}))
        except (OSError, yaml.YAMLError):
            out.append({})
    return out


def config_differences(run_dirs: list[Path]) -> list[dict[str, Any]]:
    """Per run, {dotted key: value} for the keys whose values differ between the runs' configs."""
    flat = run_configs(run_dirs)
    keys = sorted({k for f in flat for k in f if not k.startswith(NOT_A_DIFFERENCE)})
    differ = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flat}) > 1]
    return [{k: f.get(k) for k in differ} for f in flat]


def _label(run_dir: Path, diff: dict, taken: set[str]) -> str:
    """A run's label: what its config changed ('router.policy=balanced'), else its folder's name."""
    shown = [f"{k}={v}" for k, v in diff.items()]
    label = ", ".join(shown[:3]) + (f", +{len(shown) - 3} more" if len(shown) > 3 else "") or run_dir.name
    while label in taken:
        label += "'"
    taken.add(label)
    return label


def comparison_rows(runs: list[tuple[Path, dict, list[Task]]]) -> tuple[list[dict], list[str]]:
    taken: set[str] = set()
    diffs = config_differences([r[0] for r in runs])
    labels = [_label(run_dir, diff, taken) for (run_dir, _, _), diff in zip(runs, diffs)]
    first: dict[str, Any]
    rows, first = [], {}
    for label, (run_dir, summary, _) in zip(labels, runs):
        for name, v in summary["variants"].items():
            # a fused variant shares its task's devices: the task's tokens/s (all its variants') is what its
            # devices did, the figure a variant alone compares with (analysis/fused.py)
            group = v.get("fused") or {}
            tps = v.get("tokens_per_s")
            task_tps = group.get("group_tokens_per_s") or tps
            first.setdefault(name, task_tps)
            rows.append(
                {
                    "run": label,
                    "run_dir": str(run_dir),
                    "variant": name,
                    "policy": v.get("policy"),
                    "devices": v.get("devices"),
                    "steps": v.get("steps"),
                    "val_loss": v.get("val_loss"),
                    "tokens_per_s": tps,
                    "trained_in": ", ".join(group["variants"]) if group else "alone",
                    "task_tokens_per_s": task_tps,
                    "speedup": task_tps / first[name] if task_tps and first[name] else None,
                    "balance_ratio": v.get("balance_ratio"),
                    "cost_balance_ratio": v.get("cost_balance_ratio"),
                    "useful_token_fraction": v.get("useful_token_fraction"),
                    "step_time_p50_s": (v.get("step_time_s") or {}).get("p50"),
                    "oom_retries": v.get("oom_retries"),
                    "device_hours": v.get("device_hours"),
                }
            )
    return rows, across_runs(labels, [tasks for _, _, tasks in runs])


def across_runs(labels: list[str], runs: list[list[Task]]) -> list[str]:
    """Each variant of each later run against the same variant of the first run, one sentence each (a diverged
    or pruned replicate has no result and is left out, as in the verdict)."""
    sentences = []
    ref = {v: abtest.trained(reps) for v, reps in abtest.replicates(runs[0]).items()}
    for label, tasks in zip(labels[1:], runs[1:]):
        for variant, reps in abtest.replicates(tasks).items():
            a, b = abtest.trained(reps), ref.get(variant)
            if not a or not b:
                continue
            try:
                r = stats.compare(a, b).as_dict()
            except ValueError as e:
                sentences.append(f"{variant}: {label} vs {labels[0]}: no verdict ({e})")
                continue
            r["significant"] = significant(r)
            sentences.append(f"{variant}: " + sentence(label, labels[0], r))
    return sentences


def write_comparison(runs: list[tuple[Path, dict, list[Task]]], out: Path) -> pd.DataFrame:
    make_dir(out)
    rows, sentences = comparison_rows(runs)
    df = pd.DataFrame(rows)
    atomic_write(out / "comparison.csv", df.to_csv(index=False))
    atomic_write(
        out / "comparison.json",
        json.dumps(finite({"runs": [str(r[0]) for r in runs], "rows": rows, "verdicts": sentences}), indent=1),
    )
    shown = pd.DataFrame(
        [
            {
                "run": r["run"],
                "variant": r["variant"],
                "devices": r["devices"],
                "steps": r["steps"],
                "final held-out": fmt(r["val_loss"], ".4f"),
                "trained in": r["trained_in"],
                "tokens/s": fmt(r["tokens_per_s"], ",.0f"),
                "task tokens/s": fmt(r["task_tokens_per_s"], ",.0f"),
                "speed-up": fmt(r["speedup"], ".2f", "x"),
                "balance ratio": fmt(r["balance_ratio"]),
                "cost balance": fmt(r["cost_balance_ratio"]),
                "useful tokens": pct(r["useful_token_fraction"]),
                "step p50": fmt(r["step_time_p50_s"], ".3f", " s"),
                "OOM retries": r["oom_retries"],
                "device-hours": fmt(r["device_hours"], ".4f"),
            }
            for r in rows
        ]
    )
    diffs = config_differences([r[0] for r in runs])
    configs = [f"{r['run']}: {r['run_dir']}" for r in {r["run"]: r for r in rows}.values()]
    keys = list(dict.fromkeys(k for d in diffs for k in d))
    diff_table = pd.DataFrame(
        [{"run": str(run_dir), **{k: str(d.get(k)) for k in keys}} for (run_dir, _, _), d in zip(runs, diffs)]
    )
    blocks: list[tuple] = [
        ("h", 1, "Comparison of runs"),
        ("ul", configs),
        ("h", 2, "What differs between the runs' configs"),
        ("table", diff_table) if keys else ("p", "nothing: the runs' resolved configs are the same"),
        ("h", 2, "Side by side"),
        ("table", shown),
        (
            "p",
            "Speed-up: the task's tokens/s (after warm-up) against the same variant's task in the first run. A "
            "variant fused with others (trained in: their names) shares one task: its own tokens/s counts its "
            "tokens only, its task's counts the group's, what the devices did.",
        ),
        ("h", 2, "Held-out loss across runs"),
        ("ul", sentences or ["no variant with per-batch eval sums in two runs"]),
    ]
    plot = plots.comparison_plot(rows, out)
    if plot:
        first = rows[0]["run"] if rows else "the first run"
        blocks.append(("img", plot, f"tokens/s per variant and run; held-out loss minus {first}'s (differences)"))
    atomic_write(out / "comparison.md", to_markdown(blocks))
    atomic_write(out / "comparison.html", to_html(blocks, "comparison of runs", out))
    return df
