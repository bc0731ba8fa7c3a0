"""The report's document: its sections (verdict, variants, seeds, balance, time, job facts, definitions) as
blocks for render.py, and the table a run prints at its end. From the summary report.py computed."""

from __future__ import annotations

import pandas as pd

from slurm_router.analysis import cost, forecast, fused
from slurm_router.analysis.render import fmt, gib, pct
from slurm_router.analysis.seeds_table import seeds_section
from slurm_router.rundir.throughput import WARMUP_FRACTION
from slurm_router.verdict import contest

DEFINITIONS = [
    "Losses are token-weighted means in nats per token; 'final' is the last held-out evaluation, 'best' the lowest.",
    f"Warm-up: the first {WARMUP_FRACTION:.0%} of steps (at least one) are left out of tokens/s, samples/s, "
    "step-time percentiles and MFU.",
    "Tokens/s: the real (non-padding) tokens of the steps after warm-up / the summed step time of those same "
    "steps (evaluations and checkpoints between steps are not step time); `status --json` shows the same figure.",
    "Verdict: the difference of two variants' mean held-out losses over their seeds, paired by eval batch (every "
    "task evaluates the same batches) and by seed (the same data order). Its variance has a seeds part (training "
    "noise: LoRA init, data order) and an eval-batches part (which held-out samples were drawn), from the two-way "
    "ANOVA of seeds x eval batches; +/- is its standard error, the 95% interval adds each part's standard error "
    "times its own Student t quantile in quadrature (Banerjee), the p-value inverts that interval. With one seed "
    "it is a paired t-test over eval batches and covers eval-sample noise only. With more than two variants one "
    "judgement adjusts the pairs' p-values: Holm over every ordered pair (not the comparisons with the base), and the "
    "forest plot draws each pair's interval at the level Holm gave it. Calibration on simulated runs: "
    "benchmarks/results/verdict_calibration.md.",
    "Balance ratio of a step: max / mean over devices of busy time before the gradient sync (1.0 = all devices "
    "finish together); reported as the mean and p95 over steps. Cost balance ratio: the router's planned cost, "
    "max / mean (mean over steps).",
    "Useful-token fraction: sum over steps of real tokens / sum over steps of (devices x the most padded tokens "
    "one device computed in the step); padding and imbalance both lower it.",
    "Sync wait: time in the gradient all-reduce, including waiting for the slowest device. Busy %: a device's "
    "busy time / step time.",
    "Device-hours: devices x task wall time (Slurm elapsed or the local launcher's; else the events' span). "
    "Loss gain per device-hour: (held-out loss at step 0 - final) / device-hours.",
    "MFU: tokens/s x FLOPs per token / (devices x bf16 dense peak); FLOPs per token = 4N + 2N_trainable "
    "(6N for full training, about 4N for LoRA), attention FLOPs left out.",
    "After a requeue, rows of a repeated step are kept from the last attempt only.",
]


def _tasks(summary: dict) -> dict[str, dict]:
    base = {summary["base"]["task"]: summary["base"]} if summary["base"].get("task") else {}
    return {**base, **summary["variants"]}


def task_table(summary: dict) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"task": n, **{k: v for k, v in s.items() if not isinstance(v, (dict, list))}}
            for n, s in _tasks(summary).items()
        ]
    )


def document(summary: dict, tables: dict) -> list[tuple]:
    """The report's blocks, section by section (render.py turns them into markdown and html)."""
    tasks = _tasks(summary)
    head = (
        f"Run dir {summary['run_dir']} | run id {summary.get('run_id')} | launcher {summary.get('launcher')} | "
        f"state {summary.get('state')}"
    )
    b: list[tuple] = [("h", 1, f"{summary['experiment']}: run report"), ("p", head)]
    b += [("banner", summary["partial"])] if summary.get("partial") else []
    b += _header(summary.get("header") or {})
    winner = [summary["winner"]["sentence"]] if summary.get("winner") else []
    winner += [summary["disagreement"]] if summary.get("disagreement") else []  # loss and eval.primary differ
    verdict = winner + summary.get("diverged", []) + [r["sentence"] for r in summary["ab"]] + summary.get("pruned", [])
    verdict += [line for line in [contest.looks_line(summary.get("prune_looks") or [])] if line]
    verdict += [summary["auto_seeds"]["line"]] if summary.get("auto_seeds") else []  # and why reserves did not run
    auto = summary.get("auto_seeds") or {}
    verdict += auto.get("not_run", []) + auto.get("stopped", [])  # reserves never run, or stopped once decided
    b += [("h", 2, "Verdict")] + ([("banner", summary["caveat"])] if summary.get("caveat") else [])
    b += [("ul", verdict or ["no variants to compare"])]
    b += seeds_section(summary) + _metrics_section(summary)
    if summary["missing"]:
        b += [("h", 2, "What is missing"), ("ul", summary["missing"])]
    b += _changed_section(summary) + _variants_section(summary, tasks) + fused.section(summary["variants"])
    if summary.get("links"):
        b += [
            ("h", 2, "Files"),
            ("links", [(n, list(ls.items())) for n, ls in summary["links"].items() if ls]),
            ("p", "Links are relative to this report's folder: open the report inside the run dir, or copy both."),
        ]
    b += cost.section(summary)  # what the verdict cost: device-hours in all, to the decision, fixed design
    b += forecast.section(summary)  # the plan's forecast beside what happened
    b += _balance_section(tasks, tables["devices"]) + _time_section(tasks)
    facts = [_facts_row(fused.label(n, s), s["job"]) for n, s in tasks.items()]
    b += [("h", 2, "Job facts"), ("table", pd.DataFrame(facts))]
    tips = [f"{n}: {a}" for n, s in tasks.items() for a in s.get("advice", [])]
    b += [("h", 3, "Advice"), ("ul", tips or ["nothing stands out"])]
    if summary.get("plots"):
        b.append(("h", 2, "Plots"))
        b += [("img", p, p.removesuffix(".png").replace("_", " ")) for p in summary["plots"]]
    return b + [("h", 2, "Definitions"), ("ul", DEFINITIONS)]


def _duration(x) -> str:
    if x is None:
        return "-"
    x = float(x)
    return f"{x / 3600:.2f} h" if x >= 3600 else f"{x / 60:.1f} min" if x >= 60 else f"{x:.1f} s"


def _header(h: dict) -> list[tuple]:
    """What ran, from which code, when, and what it cost."""
    if not h:
        return []
    flag = h.get("git_dirty")
    dirty = " (dirty: unknown)" if flag is None else " (dirty: uncommitted changes)" if flag else " (clean)"
    return [
        (
            "ul",
            [
                f"Command: {h.get('command') or '-'}",
                f"Git commit: {h.get('git_commit') or 'unknown (not a git checkout)'}{dirty}",
                f"Started: {h.get('started') or '-'}; total wall time {_duration(h.get('wall_s'))}; "
                f"total device-hours {fmt(h.get('device_hours'), '.4f')}",
            ],
        )
    ]


def _value(v) -> str:
    return "-" if v is None else ",".join(map(str, v)) if isinstance(v, list) else str(v)


def _changed_section(summary: dict) -> list[tuple]:
    """What each variant changed: the keys whose values differ between the variants' resolved configs."""
    changed = summary.get("changed") or {}
    if not changed:
        return []
    keys = list(dict.fromkeys(k for c in changed.values() for k in c["changed"]))
    rows = [
        {
            "variant": n,
            **{k: _value(c["changed"].get(k)) for k in keys},
            "trainable params": fmt(c.get("n_trainable_params"), ",.0f"),
            "of all params": pct(c["n_trainable_params"] / c["n_params"], 2)
            if c.get("n_trainable_params") and c.get("n_params")
            else "-",
        }
        for n, c in changed.items()
    ]
    what = "config keys whose values differ between the variants (each task's task.json holds its resolved config)"
    return [("h", 2, "What each variant changed"), ("table", pd.DataFrame(rows)), ("p", f"Columns: {what}.")]


def _metrics_section(summary: dict) -> list[tuple]:
    """Per variant and metric (held-out loss, each of eval.metrics): mean and 95% interval (shown with task metrics)."""
    table = summary.get("metrics") or {}
    names = list(dict.fromkeys(m for per in table.values() for m in per))
    if names == ["loss"] or not names:
        return []
    rows = []
    for variant, per in table.items():
        row = {"variant": variant}
        for m in names:
            r = per.get(m)
            row[m] = f"{r['mean']:.4f} ({r['ci_low']:.4f} to {r['ci_high']:.4f})" if r else "-"
        rows.append(row)
    primary = summary.get("primary") or "loss"
    return [
        ("h", 2, "Metrics"),
        ("table", pd.DataFrame(rows)),
        (
            "p",
            "Each variant's mean over its trained seeds and eval batches (loss: nats per token) or examples (task "
            "metrics, docs/metrics.md), with the 95% interval of that mean (training noise and example noise; "
            f"examples that share a source count as one). The verdict, prune=true and export follow {primary}.",
        ),
    ] + _disagree_block(summary.get("disagree_examples"))


def _disagree_block(d: dict | None) -> list[tuple]:
    """The examples on which the leader and the runner-up differ most (analysis/task_metrics.py), as a list."""
    from slurm_router.analysis.task_metrics import disagreement_lines

    lines = disagreement_lines(d)
    if not d or not lines:
        return []
    what = (
        f"Where {d['leader']} and {d['runner_up']} differ most ({d['metric']}; examples as your function numbers them):"
    )
    return [("p", what), ("ul", lines)]


def _state(s: dict) -> str | None:
    """A task's state in the tables: 'diverged' or 'pruned', else the job's (Slurm's word) or the manifest's."""
    if s.get("diverged") or s.get("pruned"):
        return "diverged" if s.get("diverged") else "pruned"
    return (s.get("job") or {}).get("state") or s.get("state")


def _variants_section(summary: dict, tasks: dict[str, dict]) -> list[tuple]:
    base = summary["base"].get("val_loss")
    rows = [
        {
            "task": n,
            "state": _state(s),
            "steps": "cached"
            if s.get("state") == "cached"
            else f"{s['steps']}/{s.get('expected_steps') or '?'}"
            + (f" (diverged at step {s['diverged']['step']})" if s.get("diverged") else "")
            + (f" (pruned at step {s['pruned']['step']})" if s.get("pruned") else ""),
            "final held-out": fmt(s.get("val_loss"), ".4f"),
            "best held-out (step)": f"{s['best_val_loss']:.4f} ({s['best_val_loss_step']})"
            if "best_val_loss" in s
            else "-",
            "vs base": fmt(s["val_loss"] - base, "+.4f")
            if n in summary["variants"] and s.get("val_loss") is not None and base is not None
            else "-",
            "train loss": fmt(s.get("train_loss"), ".4f"),
            "tokens/s": fmt(s.get("tokens_per_s"), ",.0f"),
            "samples/s": fmt(s.get("samples_per_s"), ",.1f"),
            "device-hours": fmt(s.get("device_hours"), ".4f"),
            "loss gain per device-hour": fmt(s.get("loss_improvement_per_device_hour"), ",.2f"),
        }
        for n, s in tasks.items()
    ]
    warmup = ", ".join(f"{n} {s.get('warmup_steps', '-')}" for n, s in tasks.items())
    return [
        ("h", 2, "Variants"),
        ("table", pd.DataFrame(rows)),
        (
            "p",
            f"Losses in nats per token; base held-out loss {fmt(base, '.4f')}. Throughput leaves out the "
            f"warm-up steps ({warmup}).",
        ),
    ]


def _balance_section(tasks: dict[str, dict], dev: pd.DataFrame) -> list[tuple]:
    b: list[tuple] = [
        ("h", 2, "Routing balance"),
        (
            "table",
            pd.DataFrame(
                [
                    {
                        "task": n,
                        "policy": s.get("policy"),
                        "devices": s.get("devices"),
                        **(
                            dict.fromkeys(
                                ("balance ratio (mean)", "balance ratio (p95)", "cost balance ratio"),
                                "n/a (1 device per task)",
                            )
                            if s.get("devices") == 1
                            else {
                                "balance ratio (mean)": fmt(s.get("balance_ratio")),
                                "balance ratio (p95)": fmt(s.get("balance_ratio_p95")),
                                "cost balance ratio": fmt(s.get("cost_balance_ratio")),
                            }
                        ),
                        "useful tokens": pct(s.get("useful_token_fraction")),
                        "OOM retries": s.get("oom_retries"),
                    }
                    for n, s in tasks.items()
                ]
            ),
        ),
    ]
    for n in tasks:
        d = dev[dev["task"] == n] if len(dev) else dev
        if d.empty:
            continue
        col = lambda name: d.get(name, pd.Series(index=d.index, dtype=float))  # noqa: E731
        b += [
            ("h", 3, f"{fused.label(n, tasks[n])}: per device"),
            (
                "table",
                pd.DataFrame(
                    {
                        "device": d["device"],
                        "samples": d["samples_share"].map(pct),
                        "tokens": d["tokens_share"].map(pct),
                        "cost": d["cost_share"].map(pct),
                        "busy": d["busy_pct"].map(lambda x: fmt(x, ".1f", "%")),
                        "sync wait": col("sync_wait_s").map(lambda x: fmt(x, ".2f", " s")),
                        "sync wait share": col("sync_wait_pct").map(lambda x: fmt(x, ".1f", "%")),
                        "micro-batches/step": col("micro_per_step").map(lambda x: fmt(x, ".1f")),
                        "OOM retries": d["oom_retries"],
                        "memory peak": d["mem_peak_bytes"].map(gib),
                        "predicted peak": d["mem_predicted_bytes"].map(gib),
                        "budget": d["mem_budget_bytes"].map(gib),
                    }
                ),
            ),
        ]
        mem = tasks[n].get("memory") or {}
        if mem:
            b.append(
                (
                    "p",
                    f"Memory model: observed / predicted peak per micro-batch, median "
                    f"{mem['observed_over_predicted_p50']:.2f}x, max {mem['observed_over_predicted_max']:.2f}x;"
                    f" under-predicted in {pct(mem['under_predicted_share'], 0)} of micro-batches "
                    f"(observed: {mem['observed_is']}).",
                )
            )
    return b


def _time_section(tasks: dict[str, dict]) -> list[tuple]:
    rows = []
    for n, s in tasks.items():
        st, split = s.get("step_time_s") or {}, s.get("time_split") or {}
        rows.append(
            {
                "task": fused.label(n, s),
                **{f"step {k}": fmt(st.get(k), ".3f", " s") for k in ("p50", "p95", "max")},
                **{k: pct(split.get(k)) for k in ("data", "compute", "sync", "other")},
                "tokens/s": fmt(s.get("tokens_per_s"), ",.0f"),
                "MFU": s.get("mfu_text"),
            }
        )
    return [
        ("h", 2, "Throughput and time"),
        ("table", pd.DataFrame(rows)),
        (
            "p",
            "Step times after warm-up. data / compute / sync / other: shares of all devices' step time "
            "(other: router plan, optimizer step, telemetry).",
        ),
    ]


def _facts_row(name: str, f: dict) -> dict:
    dur = lambda x: "-" if x is None else f"{float(x) / 60:.1f} min" if x >= 60 else f"{float(x):.1f} s"  # noqa: E731
    mem_peak, mem_total = f.get("device_mem_peak_bytes"), f.get("device_mem_total_bytes")
    return {
        "task": name,
        "source": f.get("source"),
        "state": f.get("state"),
        "elapsed": dur(f.get("elapsed_s")),
        "time limit": dur(f.get("time_limit_s")) if f.get("time_limit_s") else "none",
        "requeues": f.get("requeues"),
        "node": f.get("node"),
        "devices used/allocated": f"{f.get('devices_used', '-')}/{f.get('devices_allocated', '-')}",
        "CPUs (efficiency)": f"{f['cpus_allocated']} ({pct(f.get('cpu_efficiency'), 0)})"
        if f.get("cpus_allocated")
        else "-",
        "host memory (max RSS/asked)": f"{gib(f.get('mem_max_rss_bytes'))} / {gib(f.get('mem_allocated_bytes'))}"
        if f.get("mem_allocated_bytes")
        else "-",
        "device memory peak/total": f"{gib(mem_peak)} / {gib(mem_total)} ({pct(mem_peak / mem_total, 0)})"
        + (" RSS" if f.get("device_type") == "cpu" else "")
        if mem_peak and mem_total
        else "-",
        "util": fmt(f.get("util_mean"), ".0f", "%"),
    }
