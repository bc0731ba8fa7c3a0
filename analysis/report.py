"""The run report, from events + manifest (+ sacct for Slurm runs) only: report/summary.json, report.md, a
self-contained report.html, CSV tables and PNG plots.

    python -m slurm_router.analysis runs/lora_ab/2026-11-23_07-30-00

Figures and their definitions live in metrics.py (balance, useful tokens, MFU), abtest.py (the A/B verdict)
and jobfacts.py (seff-like job facts and advice); plots.py draws, render.py writes md and html. A failed,
running or requeued run still gets a report of what exists, and says what is missing (damaged event lines
included: left out and named, never a reason to refuse). A diverged variant (its loss went non-finite) is
listed as diverged at step N with its lr, and the verdict is among the others; so is a variant that prune=true
stopped early (slurm_router/worker/prune.py): its line says at which evaluation and why. The verdict names the winner
and the path of its adapter (summary.json: `winner`; each variant's `adapter` and `adapter_best`).

Seed replicates (`seeds=3`): summary.json's `variants` stays one entry per task (r8-s0, r8-s1, ...; the
variant's name when it has one seed), `by_variant` gives each variant's mean, std and per-seed held-out losses
and every replicate's adapter, and `ab` rows compare variants over seeds and eval batches (abtest.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from slurm_router.analysis import abtest, jobfacts, metrics, plots
from slurm_router.analysis.load import ReportError, Task, atomic_write, load_run, make_dir  # noqa: F401  (ReportError: API)
from slurm_router.analysis.metrics import WARMUP_FRACTION, finite
from slurm_router.analysis.render import fmt, gib, pct, to_html, to_markdown
from slurm_router.rundir.layout import ADAPTER_FILES, RunLayout

DEFINITIONS = [
    "Losses are token-weighted means in nats per token; 'final' is the last held-out evaluation, 'best' the lowest.",
    f"Warm-up: the first {WARMUP_FRACTION:.0%} of steps (at least one) are left out of tokens/s, samples/s, "
    "step-time percentiles and MFU.",
    "Verdict: the difference of two variants' mean held-out losses over their seeds, paired by eval batch (every "
    "task evaluates the same batches) and by seed (the same data order). Its variance has a seeds part (training "
    "noise: LoRA init, data order) and an eval-batches part (which held-out samples were drawn), from the two-way "
    "ANOVA of seeds x eval batches; +/- is its standard error, the 95% interval adds each part's standard error "
    "times its own Student t quantile in quadrature (Banerjee), the p-value inverts that interval. With one seed "
    "it is a paired t-test over eval batches and covers eval-sample noise only. With more than two variants the "
    "pairs' p-values get Holm's correction (not the comparisons with the base). Calibration on simulated runs: "
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


def _wall_s(task: Task, facts: dict) -> float | None:
    if facts.get("elapsed_s"):
        return float(facts["elapsed_s"])
    if not task.has_events:
        return None
    span = task.events.groupby("attempt")["time"].agg(lambda t: t.max() - t.min())
    return float(span.sum())


def summarize_task(task: Task, facts: dict, peak_tflops: float | None = None) -> dict:
    policy = task.events["policy"].dropna() if "policy" in task.events else pd.Series(dtype=object)
    s: dict[str, Any] = {
         "steps": int(len(task.steps)), "devices": task.n_devices, "policy": policy.iloc[0] if len(policy) else None,
         "state": task.meta.get("state"), "expected_steps": task.expected_steps, "attempts": task.attempts}
    s.update(metrics.losses(task))
    if task.diverged:           # no trained model to judge: its last losses are not a result
        s.update(diverged=task.diverged, state="diverged", val_loss=None, train_loss=None)
    if task.pruned:             # stopped early on purpose: its last held-out loss is at the step it stopped
        s.update(pruned=task.pruned, state="pruned")
    s.update(metrics.throughput(task))
    s.update(metrics.balance(task))
    s["oom_retries"] = metrics.oom_retries(task)
    s["step_time_s"] = metrics.step_times(task)
    s["time_split"] = metrics.time_split(task)
    s["memory"] = metrics.memory(task)
    m = metrics.mfu(task, s["tokens_per_s"], peak_tflops)
    s["mfu"], s["mfu_text"] = m.get("mfu"), m["text"]
    s["wall_s"] = _wall_s(task, facts)
    s["device_hours"] = s["wall_s"] * (task.n_devices or 1) / 3600 if s["wall_s"] else None
    if s.get("val_loss_start") is not None and s.get("val_loss") is not None and s["device_hours"]:
        s["loss_improvement_per_device_hour"] = (s["val_loss_start"] - s["val_loss"]) / s["device_hours"]
    s["job"] = facts
    s["advice"] = jobfacts.advice(facts, s)
    s["missing"] = missing(task, s, facts) + task.problems
    return s


def diverged_line(name: str, d: dict) -> str:
    """'r8: diverged at step 3 (loss nan, lr 10): ...' (the events' step, counted from 0 as in steps.csv)."""
    why = [d["detail"]] if d.get("detail") else []
    why += [f"lr {d['lr']:g}"] if isinstance(d.get("lr"), (int, float)) else []
    return (f"{name}: diverged at step {d['step']}{' (' + ', '.join(why) + ')' if why else ''}: no held-out loss, "
            "so not in the verdict; a lower train.lr may train it")


def missing(task: Task, s: dict, facts: dict) -> list[str]:
    """What this task's report lacks, in words ('r32: no events yet')."""
    state = (facts.get("state") or "").upper()
    n, want = s["steps"], task.expected_steps
    if state == "CACHED" or task.diverged or task.pruned:   # listed with the verdict, not as missing
        return []
    never = (facts.get("reason") or "").partition("DependencyNeverSatisfied: ")[2]
    if never and not task.has_events:           # cancelled by Slurm: the stage it waited on failed (launch/slurm/parse.py)
        return [f"{task.name}: never ran: {never}"]
    log = f"; see {task.meta['log_path']}" if task.meta.get("log_path") else ""
    if facts.get("setup_failed") and state in ("FAILED", "PENDING"):     # PENDING: the manifest's, without sacct
        return [f"{task.name}: setup failed: {facts['setup_failed']}, before the task started{log}"]
    if state in ("FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "CANCELLED", "PREEMPTED"):
        exit_code = f", exit {facts['exit_code']}" if facts.get("exit_code") not in (None, 0, "0:0") else ""
        return [f"{task.name}: {state.lower()}{exit_code} after {n}{f' of {want}' if want else ''} steps{log}"]
    if not task.has_events:
        what = {"SKIPPED": "skipped (an earlier stage failed)"}.get(state, f"no events yet ({state.lower() or '?'})")
        return [f"{task.name}: {what}"]
    out = []
    if want and n < want:
        out.append(f"{task.name}: running: {n} of {want} steps so far" if state == "RUNNING" else
                   f"{task.name}: stopped after {n} of {want} steps" + ("" if task.ended else " (no end event)"))
    if s.get("val_loss") is None or (want and s.get("val_loss_step") != want):
        out.append(f"{task.name}: no final held-out loss yet")
    return out


def saved_weights(run_dir: Path, name: str) -> dict[str, str | None]:
    """A task's saved adapter folders (or whole model, trained without LoRA), as paths under the run dir the
    user gave; None where there is none (yet). Folders appear whole or not at all (adapters.write_folder)."""
    paths = RunLayout(run_dir).task(name)

    def whole(folder: Path) -> str | None:
        return str(folder) if all((folder / f).is_file() for f in ADAPTER_FILES) else None
    model = str(paths.full_model) if (paths.full_model / "config.json").is_file() else None
    return {"adapter": whole(paths.adapter) or model, "adapter_best": whole(paths.adapter_best)}


def analyze(run_dir: Path, peak_tflops: float | None = None, runner=jobfacts.run_command):
    """(summary, tasks, tables): everything the report shows, nothing written."""
    manifest, tasks = load_run(run_dir)
    facts = jobfacts.job_facts(manifest, tasks, runner)
    summary: dict[str, Any] = {
               "experiment": manifest.get("experiment"), "run_dir": str(run_dir), "run_id": manifest.get("run_id"),
               "launcher": manifest.get("launcher"), "state": manifest.get("state"),
               "base": {"val_loss": None}, "variants": {}}
    per_task = {t.name: summarize_task(t, facts[t.name], peak_tflops) for t in tasks}
    for t in tasks:
        if t.stage != "base":
            summary["variants"][t.name] = {**per_task[t.name], **saved_weights(run_dir, t.name)}
            continue
        result = RunLayout(run_dir).task(t.name).result
        val = json.loads(result.read_text()).get("val_loss") if result.is_file() else per_task[t.name].get("val_loss")
        summary["base"] = {**per_task[t.name], "val_loss": val, "state": t.meta.get("state"), "task": t.name}
    # The base's held-out loss is measured where it compares: a variant's step-0 eval runs on the very eval
    # batches the variants end on (a cached base may have been evaluated under other eval settings; a local
    # checkpoint has no base stage at all). The base task's own figure is the fallback.
    starts = [v["val_loss_start"] for v in summary["variants"].values() if v.get("val_loss_start") is not None]
    if starts:
        summary["base"]["val_loss"] = starts[0]
    summary["diverged"] = [diverged_line(t.name, t.diverged) for t in tasks if t.diverged]
    summary["pruned"] = [t.pruned["detail"] for t in tasks if t.stage != "base" and t.pruned]
    adapters = {n: v["adapter"] for n, v in summary["variants"].items()}
    summary["by_variant"] = abtest.variant_table(tasks, adapters)
    summary["ab"] = abtest.compare_all(tasks, adapters)
    summary["winner"] = abtest.winner(tasks, summary["ab"], adapters)
    for row in summary["ab"]:
        vs_base = {k: row.get(k) for k in ("diff", "se", "ci_low", "ci_high", "p", "sentence")}
        for table in (summary["by_variant"], summary["variants"]):     # a variant; its task when it has one seed
            if row["b"] == "base" and row["a"] in table:
                table[row["a"]]["vs_base"] = vs_base
    summary["missing"] = [line for s in per_task.values() for line in s["missing"]]
    tables = {"steps_detail": pd.concat([metrics.per_step_table(t) for t in tasks] or [pd.DataFrame()]),
              "devices": pd.concat([metrics.device_table(t).assign(task=t.name) for t in tasks
                                    if len(t.steps)] or [pd.DataFrame()])}
    return summary, tasks, tables


def write_report(run_dir: Path, out: Path | None = None, peak_tflops: float | None = None) -> dict:
    """Analyze run_dir and write its report into out (default run_dir/report); returns summary.json's dict."""
    return report_run(run_dir, out, peak_tflops)[0]


def report_run(run_dir: Path, out: Path | None = None, peak_tflops: float | None = None) -> tuple[dict, list[Task]]:
    run_dir = Path(run_dir)
    summary, tasks, tables = analyze(run_dir, peak_tflops)
    out = Path(out) if out else RunLayout(run_dir).report
    make_dir(out)
    summary["plots"] = plots.all_plots(tasks, summary["base"]["val_loss"], out, summary)
    summary = finite(summary)
    steps = tables["steps_detail"]
    compat = (steps[steps["task"].isin(list(summary["variants"]))].rename(columns={
        "task": "variant", "n_tokens": "tokens", "t_step_s": "step_time_s"})[["variant", "step", "loss", "tokens",
                                                                                "step_time_s"]]
              if len(steps) else pd.DataFrame(columns=["variant", "step", "loss", "tokens", "step_time_s"]))
    csvs = {"steps.csv": compat, "steps_detail.csv": steps, "devices.csv": tables["devices"],
            "variants.csv": task_table(summary), "ab.csv": pd.DataFrame(summary["ab"]),
            "evals.csv": pd.concat([t.evals.assign(task=t.name)[["task", "step", "val_loss"]] for t in tasks
                                    if len(t.evals)] or [pd.DataFrame(columns=["task", "step", "val_loss"])])}
    for name, df in csvs.items():
        atomic_write(out / name, df.to_csv(index=False))
    blocks = document(summary, tables)
    atomic_write(out / "report.md", to_markdown(blocks))
    atomic_write(out / "report.html", to_html(blocks, f"{summary['experiment']}: run report", out))
    atomic_write(out / "summary.json", json.dumps(summary, indent=1))
    return summary, tasks


def _tasks(summary: dict) -> dict[str, dict]:
    base = {summary["base"]["task"]: summary["base"]} if summary["base"].get("task") else {}
    return {**base, **summary["variants"]}


def task_table(summary: dict) -> pd.DataFrame:
    return pd.DataFrame([{"task": n, **{k: v for k, v in s.items() if not isinstance(v, (dict, list))}}
                         for n, s in _tasks(summary).items()])


def document(summary: dict, tables: dict) -> list[tuple]:
    """The report's blocks, section by section (render.py turns them into markdown and html)."""
    tasks = _tasks(summary)
    head = (f"Run dir {summary['run_dir']} | run id {summary.get('run_id')} | launcher {summary.get('launcher')} | "
            f"state {summary.get('state')}")
    b: list[tuple] = [("h", 1, f"{summary['experiment']}: run report"), ("p", head)]
    winner = [summary["winner"]["sentence"]] if summary.get("winner") else []
    verdict = (winner + summary.get("diverged", []) + [r["sentence"] for r in summary["ab"]]
               + summary.get("pruned", []))
    b += [("h", 2, "Verdict"), ("ul", verdict or ["no variants to compare"])]
    b += _seeds_section(summary)
    if summary["missing"]:
        b += [("h", 2, "What is missing"), ("ul", summary["missing"])]
    b += _variants_section(summary, tasks) + _balance_section(tasks, tables["devices"]) + _time_section(tasks)
    b += [("h", 2, "Job facts"), ("table", pd.DataFrame([_facts_row(n, s["job"]) for n, s in tasks.items()]))]
    tips = [f"{n}: {a}" for n, s in tasks.items() for a in s.get("advice", [])]
    b += [("h", 3, "Advice"), ("ul", tips or ["nothing stands out"])]
    if summary.get("plots"):
        b.append(("h", 2, "Plots"))
        b += [("img", p, p.removesuffix(".png").replace("_", " ")) for p in summary["plots"]]
    return b + [("h", 2, "Definitions"), ("ul", DEFINITIONS)]


def _seeds_section(summary: dict) -> list[tuple]:
    """Per variant, its held-out loss over seeds (shown when a variant has more than one seed)."""
    by_variant = summary.get("by_variant") or {}
    if not any(v["n_seeds"] > 1 for v in by_variant.values()):
        return []
    rows = []
    for name, v in by_variant.items():
        vs = v.get("vs_base") or {}
        rows.append({"variant": name, "seeds": v["n_seeds"], "held-out mean": fmt(v["val_loss_mean"], ".4f"),
                     "std over seeds": fmt(v["val_loss_std"], ".4f"),
                     "range": f"{min(v['val_loss_per_seed']):.4f} to {max(v['val_loss_per_seed']):.4f}"
                     if v["val_loss_per_seed"] else "-",
                     "per seed": ", ".join(f"s{r['seed']} {r['val_loss']:.4f}" for r in v["replicates"]
                                           if r["val_loss"] is not None) or "-",
                     "best seed": "-" if v["best_seed"] is None else str(v["best_seed"]),
                     "vs base (95% CI)": f"{vs['diff']:+.4f} ({vs['ci_low']:+.4f} to {vs['ci_high']:+.4f})"
                     if vs.get("diff") is not None else "-"})
    return [("h", 2, "Variants over seeds"), ("table", pd.DataFrame(rows)),
            ("p", "Held-out loss (nats per token) of each seed replicate after training; the mean is what the "
                  "verdict compares, the std (n-1) is the training noise one seed alone cannot show. The winner's "
                  "adapter is its best seed's; every replicate's adapter is in summary.json (by_variant).")]


def _state(s: dict) -> str | None:
    """A task's state in the tables: 'diverged' or 'pruned', else the job's (Slurm's word) or the manifest's."""
    if s.get("diverged") or s.get("pruned"):
        return "diverged" if s.get("diverged") else "pruned"
    return (s.get("job") or {}).get("state") or s.get("state")


def _variants_section(summary: dict, tasks: dict[str, dict]) -> list[tuple]:
    base = summary["base"].get("val_loss")
    rows = [{"task": n, "state": _state(s),
             "steps": "cached" if s.get("state") == "cached" else f"{s['steps']}/{s.get('expected_steps') or '?'}"
             + (f" (diverged at step {s['diverged']['step']})" if s.get("diverged") else "")
             + (f" (pruned at step {s['pruned']['step']})" if s.get("pruned") else ""),
             "final held-out": fmt(s.get("val_loss"), ".4f"),
             "best held-out (step)": f"{s['best_val_loss']:.4f} ({s['best_val_loss_step']})"
             if "best_val_loss" in s else "-",
             "vs base": fmt(s["val_loss"] - base, "+.4f") if n in summary["variants"]
             and s.get("val_loss") is not None and base is not None else "-",
             "train loss": fmt(s.get("train_loss"), ".4f"), "tokens/s": fmt(s.get("tokens_per_s"), ",.0f"),
             "samples/s": fmt(s.get("samples_per_s"), ",.1f"), "device-hours": fmt(s.get("device_hours"), ".4f"),
             "loss gain per device-hour": fmt(s.get("loss_improvement_per_device_hour"), ",.2f")}
            for n, s in tasks.items()]
    warmup = ", ".join(f"{n} {s.get('warmup_steps', '-')}" for n, s in tasks.items())
    return [("h", 2, "Variants"), ("table", pd.DataFrame(rows)),
            ("p", f"Losses in nats per token; base held-out loss {fmt(base, '.4f')}. Throughput leaves out the "
                  f"warm-up steps ({warmup}).")]


def _balance_section(tasks: dict[str, dict], dev: pd.DataFrame) -> list[tuple]:
    b: list[tuple] = [("h", 2, "Routing balance"), ("table", pd.DataFrame([{
        "task": n, "policy": s.get("policy"), "devices": s.get("devices"),
        "balance ratio (mean)": fmt(s.get("balance_ratio")), "balance ratio (p95)": fmt(s.get("balance_ratio_p95")),
        "cost balance ratio": fmt(s.get("cost_balance_ratio")), "useful tokens": pct(s.get("useful_token_fraction")),
        "OOM retries": s.get("oom_retries")} for n, s in tasks.items()]))]
    for n in tasks:
        d = dev[dev["task"] == n] if len(dev) else dev
        if d.empty:
            continue
        col = lambda name: d.get(name, pd.Series(index=d.index, dtype=float))  # noqa: E731
        b += [("h", 3, f"{n}: per device"), ("table", pd.DataFrame({
            "device": d["device"], "samples": d["samples_share"].map(pct), "tokens": d["tokens_share"].map(pct),
            "cost": d["cost_share"].map(pct), "busy": d["busy_pct"].map(lambda x: fmt(x, ".1f", "%")),
            "sync wait": col("sync_wait_s").map(lambda x: fmt(x, ".2f", " s")),
            "sync wait share": col("sync_wait_pct").map(lambda x: fmt(x, ".1f", "%")),
            "micro-batches/step": col("micro_per_step").map(lambda x: fmt(x, ".1f")),
            "OOM retries": d["oom_retries"], "memory peak": d["mem_peak_bytes"].map(gib),
            "predicted peak": d["mem_predicted_bytes"].map(gib), "budget": d["mem_budget_bytes"].map(gib)}))]
        mem = tasks[n].get("memory") or {}
        if mem:
            b.append(("p", f"Memory model: observed / predicted peak per micro-batch, median "
                           f"{mem['observed_over_predicted_p50']:.2f}x, max {mem['observed_over_predicted_max']:.2f}x;"
                           f" under-predicted in {pct(mem['under_predicted_share'], 0)} of micro-batches "
                           f"(observed: {mem['observed_is']})."))
    return b


def _time_section(tasks: dict[str, dict]) -> list[tuple]:
    rows = []
    for n, s in tasks.items():
        st, split = s.get("step_time_s") or {}, s.get("time_split") or {}
        rows.append({"task": n, **{f"step {k}": fmt(st.get(k), ".3f", " s") for k in ("p50", "p95", "max")},
                     **{k: pct(split.get(k)) for k in ("data", "compute", "sync", "other")},
                     "tokens/s": fmt(s.get("tokens_per_s"), ",.0f"), "MFU": s.get("mfu_text")})
    return [("h", 2, "Throughput and time"), ("table", pd.DataFrame(rows)),
            ("p", "Step times after warm-up. data / compute / sync / other: shares of all devices' step time "
                  "(other: router plan, optimizer step, telemetry).")]


def _facts_row(name: str, f: dict) -> dict:
    dur = lambda x: "-" if x is None else f"{float(x) / 60:.1f} min" if x >= 60 else f"{float(x):.1f} s"  # noqa: E731
    mem_peak, mem_total = f.get("device_mem_peak_bytes"), f.get("device_mem_total_bytes")
    return {"task": name, "source": f.get("source"), "state": f.get("state"),
            "elapsed": dur(f.get("elapsed_s")), "time limit": dur(f.get("time_limit_s")) if f.get("time_limit_s")
            else "none", "requeues": f.get("requeues"), "node": f.get("node"),
            "devices used/allocated": f"{f.get('devices_used', '-')}/{f.get('devices_allocated', '-')}",
            "CPUs (efficiency)": f"{f['cpus_allocated']} ({pct(f.get('cpu_efficiency'), 0)})"
            if f.get("cpus_allocated") else "-",
            "host memory (max RSS/asked)": f"{gib(f.get('mem_max_rss_bytes'))} / {gib(f.get('mem_allocated_bytes'))}"
            if f.get("mem_allocated_bytes") else "-",
            "device memory peak/total": f"{gib(mem_peak)} / {gib(mem_total)} ({pct(mem_peak / mem_total, 0)})"
            + (" RSS" if f.get("device_type") == "cpu" else "") if mem_peak and mem_total else "-",
            "util": fmt(f.get("util_mean"), ".0f", "%")}


def print_table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"{summary['experiment']}: held-out loss (nats/token) and routing")
    cols = ("variant", "val_loss", "train_loss", "tokens/s", "balance", "cost_bal", "useful", "oom", "steps",
            "devices", "policy")
    for col in cols:
        t.add_column(col, justify="left" if col in ("variant", "policy") else "right")
    base = summary["base"].get("val_loss")
    t.add_row("base", fmt(base, ".4f"), *[""] * (len(cols) - 2))
    for name, v in summary["variants"].items():
        val = "diverged" if v.get("diverged") else fmt(v.get("val_loss"), ".4f")
        val += f" (pruned at {v['pruned']['step']})" if v.get("pruned") else ""
        t.add_row(name, val, fmt(v.get("train_loss"), ".4f"),
                  fmt(v.get("tokens_per_s"), ",.0f"), fmt(v.get("balance_ratio"), ".3f"),
                  fmt(v.get("cost_balance_ratio"), ".3f"), pct(v.get("useful_token_fraction"), 0),
                  str(v.get("oom_retries", "-")), str(v.get("steps")), str(v.get("devices")), str(v.get("policy")))
    console = Console(width=140)
    console.print(t)
    for name, v in (summary.get("by_variant") or {}).items():
        if v["n_seeds"] > 1:
            console.print(f"{name}: held-out {v['val_loss_mean']:.4f} +/- {v['val_loss_std']:.4f} (std over "
                          f"{v['n_seeds']} seeds)", highlight=False)
    if summary.get("winner"):
        console.print(summary["winner"]["sentence"], highlight=False)
    for line in summary.get("diverged", []):
        console.print(line, highlight=False)
    for row in summary.get("ab", []):
        console.print(row["sentence"], highlight=False)
    for line in summary.get("pruned", []):
        console.print(line, highlight=False)
    for line in summary.get("missing", []):
        console.print(f"missing: {line}", highlight=False)
    from slurm_router.tracking.trackers import tracker_lines  # tracker=...: where to look, and the `wandb sync` line
    for line in tracker_lines(summary["run_dir"]):
        print(line, flush=True)


def write_report_job(run_dir: str) -> dict:
    """The last job of a Slurm run: the report, once every stage has ended (afterany)."""
    return write_report(Path(run_dir))
