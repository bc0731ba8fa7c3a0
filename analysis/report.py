"""The run report, from events + manifest (+ sacct for Slurm runs) only: report/summary.json, report.md, a
self-contained report.html, CSV tables and PNG plots.

    python -m slurm_router.analysis runs/lora_ab/2026-11-23_07-30-00

Figures and their definitions live in metrics.py (balance, useful tokens, MFU), abtest.py (the A/B verdict)
and jobfacts.py (seff-like job facts and advice); document.py lays out the sections, plots.py draws, render.py
writes md and html. A failed,
running or requeued run still gets a report of what exists, and says what is missing (damaged event lines
included: left out and named, never a reason to refuse). A diverged variant (its loss went non-finite) is
listed as diverged at step N with its lr, and the verdict is among the others; so is a variant that prune=true
stopped early (verdict/pruning.py): its line says at which evaluation and why. The verdict names the winner
and the path of its adapter (summary.json: `winner`; each variant's `adapter` and `adapter_best`).

Seed replicates (`seeds=3`): summary.json's `variants` stays one entry per task (r8-s0, r8-s1, ...; the
variant's name when it has one seed), `by_variant` gives each variant's mean, std and per-seed held-out losses
and every replicate's adapter, and `ab` rows compare variants over seeds and eval batches (abtest.py).
"""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

import pandas as pd

from slurm_router.analysis import abtest, cost, forecast, fused, jobfacts, metrics, plots, task_metrics
from slurm_router.analysis import winner as winners
from slurm_router.analysis.contest import auto_seeds, prune_looks, task_config
from slurm_router.analysis.contest import rounds as contest_rounds
from slurm_router.analysis.document import document, task_table
from slurm_router.analysis.load import ReportError, Task, atomic_write, load_run, make_dir  # noqa: F401  (ReportError: API)
from slurm_router.analysis.metrics import finite
from slurm_router.analysis.render import to_html, to_markdown
from slurm_router.rundir.layout import ADAPTER_FILES, RunLayout
from slurm_router.verdict import sentences


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
        "steps": int(len(task.steps)),
        "devices": task.n_devices,
        "policy": policy.iloc[0] if len(policy) else None,
        "state": task.meta.get("state"),
        "expected_steps": task.expected_steps,
        "attempts": task.attempts,
    }
    s.update(metrics.losses(task))
    if task.diverged:  # no trained model to judge: its last losses are not a result
        s.update(diverged=task.diverged, state="diverged", val_loss=None, train_loss=None)
    if task.pruned:  # stopped early on purpose: its last held-out loss is at the step it stopped
        s.update(pruned=task.pruned, state="pruned")
    if task.not_needed and task.not_needed["step"]:  # a reserve stopped once its contest was decided
        s.update(stopped=task.not_needed, state="stopped")
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
    return (
        f"{name}: diverged at step {d['step']}{' (' + ', '.join(why) + ')' if why else ''}: no held-out loss, "
        "so not in the verdict; a lower train.lr may train it"
    )


def missing(task: Task, s: dict, facts: dict) -> list[str]:
    """What this task's report lacks, in words ('r32: no events yet')."""
    state = (facts.get("state") or "").upper()
    n, want = s["steps"], task.expected_steps
    if state == "CACHED" or task.diverged or task.pruned or task.not_needed:  # listed with the verdict, not missing
        return []
    from slurm_router.scheduler.task_view import FAILED_STATES, never_runs_why

    never = never_runs_why(facts.get("reason"))
    if never and not task.has_events:  # cancelled by its scheduler: the stage it waited on failed
        return [f"{task.name}: never ran: {never}"]
    log = f"; see {task.meta['log_path']}" if task.meta.get("log_path") else ""
    if facts.get("setup_failed") and state in ("FAILED", "PENDING"):  # PENDING: the manifest's, without sacct
        return [f"{task.name}: setup failed: {facts['setup_failed']}, before the task started{log}"]
    if state in FAILED_STATES or state in ("PREEMPTED", "INTERRUPTED"):  # FAILED_STATES: each backend's too
        exit_code = f", exit {facts['exit_code']}" if facts.get("exit_code") not in (None, 0, "0:0") else ""
        return [f"{task.name}: {state.lower()}{exit_code} after {n}{f' of {want}' if want else ''} steps{log}"]
    if not task.has_events:
        what = {"SKIPPED": "skipped (an earlier stage failed)"}.get(state, f"no events yet ({state.lower() or '?'})")
        return [f"{task.name}: {what}"]
    out = []
    if want and n < want:
        out.append(
            f"{task.name}: running: {n} of {want} steps so far"
            if state == "RUNNING"
            else f"{task.name}: stopped after {n} of {want} steps" + ("" if task.ended else " (no end event)")
        )
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


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_diff(configs: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """name -> {dotted key: value} for the keys whose values differ between the configs (each task's resolved
    config, task.json's `config`); run_root and the like, equal everywhere, drop out."""
    flat = {n: _flat(c) for n, c in configs.items()}
    keys = sorted({k for f in flat.values() for k in f})
    differ = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat.values()}) > 1]
    return {n: {k: f.get(k) for k in differ} for n, f in flat.items()}


def _int(x) -> int | None:
    return None if x is None or x != x else int(x)


def variants_changed(run_dir: Path, tasks: list[Task]) -> dict[str, dict]:
    """Per variant task: what its config changed against the other variants, and its trainable parameters."""
    variants = [t for t in tasks if t.stage != "base"]
    diff = config_diff({t.name: task_config(run_dir, t.name) for t in variants}) if len(variants) > 1 else {}
    own = {t.name: _int((t.start or {}).get("n_trainable_params")) for t in variants}
    group = {t.name: str(t.meta.get("fused_into") or t.name) for t in variants}
    out = {}
    for t in variants:
        n = _int((t.start or {}).get("n_params"))
        # a fused task's model holds every member's adapters: a member alone has the base and its own
        others = [own[m] for m in own if m != t.name and group[m] == group[t.name]]
        if n is not None and others and all(x is not None for x in others):
            n -= sum(x for x in others if x is not None)
        out[t.name] = {"changed": diff.get(t.name, {}), "n_trainable_params": own[t.name], "n_params": n}
    return out


def command_line(argv: list | None) -> str | None:
    """The command as typed: `python -m slurm_router ...` for the module's path in argv[0]."""
    if not argv:
        return None
    first = str(argv[0])
    if first.endswith("__main__.py"):
        first = "python -m " + ".".join(Path(first).parent.relative_to(Path(first).parents[1]).parts)
    return " ".join([first, *map(shlex.quote, map(str, argv[1:]))])


def run_header(manifest: dict, per_task: dict[str, dict], tasks: list[Task]) -> dict:
    """Command, git commit and dirty flag, start, total wall time (first start to last event) and device-hours."""
    snapshot = manifest.get("snapshot") or {}
    created = manifest.get("created")
    ends = [float(t.events["time"].max()) for t in tasks if t.has_events and "time" in t.events]
    wall = max(ends) - float(created) if created and ends else None
    hours = [s["device_hours"] for s in per_task.values() if s.get("device_hours")]
    return {
        "command": command_line(manifest.get("command")),
        "git_commit": manifest.get("git_commit") or snapshot.get("git_commit"),
        "git_dirty": manifest.get("git_dirty", snapshot.get("git_dirty")),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(created))) if created else None,
        "wall_s": wall,
        "device_hours": sum(hours) if hours else None,
    }


def task_links(run_dir: Path, out: Path, tasks: list[Task]) -> dict[str, dict[str, str]]:
    """Per task: relative links (from the report's folder) to its log, task.json and adapters, and the run's
    config.yaml; only files that exist."""
    layout = RunLayout(run_dir)
    links: dict[str, dict[str, str]] = {}
    for t in tasks:
        paths = layout.task(t.name)
        lead = t.meta.get("fused_into")  # a fused member trains in its leader's task: the log is the task's
        log = Path(t.meta["log_path"]) if t.meta.get("log_path") else layout.log(lead or t.name)
        found = {
            f"log (the fused task {lead}'s)" if lead else "log": log,
            "task.json": paths.task_file,
            "config.yaml": layout.config,
            "adapter": paths.adapter if paths.adapter.is_dir() else paths.full_model,
            "adapter-best": paths.adapter_best,
        }
        links[t.name] = {k: os.path.relpath(p.resolve(), out.resolve()) for k, p in found.items() if p.exists()}
    return links


def partial_line(run_dir: Path, manifest: dict, tasks: list[Task], facts: dict) -> str | None:
    """One line when the run is still training (or queued): the report covers what exists so far; else None."""
    if manifest.get("state") not in ("running", "submitted"):
        return None
    live = [t.name for t in tasks if facts[t.name].get("state") in ("RUNNING", "PENDING") and not t.ended]
    if not live:
        return None
    shown = ", ".join(live if len(live) <= 6 else [*live[:5], "..."])
    return (
        f"partial report: the run is still {'training' if manifest['state'] == 'running' else 'queued or training'} "
        f"({len(live)} of {len(tasks)} tasks not ended: {shown}); it covers what exists so far: run "
        f"python -m slurm_router.analysis {run_dir} again when the run has ended"
    )


def analyze(run_dir: Path, peak_tflops: float | None = None, runner=None):
    """(summary, tasks, tables): everything the report shows, nothing written."""
    manifest, every = load_run(run_dir)
    # seeds=auto reserves never run: only the cost counts them; one stopped once its contest was decided trained
    # some steps: listed (as stopped), never a replicate the verdict reads (abtest.replicates)
    tasks = [t for t in every if not (t.not_needed and not t.not_needed["step"])]
    facts = jobfacts.job_facts(manifest, every, runner)
    summary: dict[str, Any] = {
        "experiment": manifest.get("experiment"),
        "run_dir": str(run_dir),
        "run_id": manifest.get("run_id"),
        "launcher": manifest.get("launcher"),
        "state": manifest.get("state"),
        "base": {"val_loss": None},
        "variants": {},
    }
    per_task = {t.name: summarize_task(t, facts[t.name], peak_tflops) for t in every}
    for t in tasks:  # a fused group computes its variants' tokens together: the micro rows are in its leader's events
        leader = per_task.get(t.meta.get("fused_into") or "")
        if leader is not None and per_task[t.name].get("useful_token_fraction") is None:
            per_task[t.name]["useful_token_fraction"] = leader.get("useful_token_fraction")
    fused.apply(per_task, tasks)  # which variants shared a task; each one's share of it (device-hours counted once)
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
    summary["prune_looks"] = prune_looks(run_dir)  # the run's looks (verdict/contest.py), one line per look
    if auto := auto_seeds(run_dir, every, summary["prune_looks"]):
        summary["auto_seeds"] = auto
    adapters = {n: v["adapter"] for n, v in summary["variants"].items()}
    primary = next((str(task_config(run_dir, t.name).get("eval", {}).get("primary", "loss")) for t in tasks), "loss")
    # eval.primary decides (config/metrics.py); held-out loss: lower is better
    higher = primary != "loss" and task_metrics.metric_directions(tasks).get(primary, True)
    summary["by_variant"] = abtest.variant_table(tasks, adapters, primary, higher)  # best seed: by eval.primary
    summary["primary"], summary["metrics"] = primary, task_metrics.metric_table(tasks)
    summary["ab"] = abtest.compare_all(tasks, adapters, primary, higher)
    looks = summary["prune_looks"]
    summary["winner"] = winners.winner(tasks, summary["ab"], adapters, primary, higher, looks)
    if primary != "loss":  # held-out loss's own winner, said in one line when it is another variant
        by_loss = winners.winner(tasks, abtest.compare_all(tasks, adapters), adapters, looks=looks)
        summary["disagreement"] = winners.disagreement(by_loss, summary["winner"], primary)
        summary["disagree_examples"] = task_metrics.disagreements(tasks, primary, summary["winner"])
    for row in summary["ab"]:  # in eval.primary: `metric` names it (a task metric's diff is signed, lower better)
        vs_base = {k: row.get(k) for k in ("diff", "se", "ci_low", "ci_high", "p", "sentence")}
        vs_base.update(metric=primary, higher_is_better=bool(higher))
        for table in (summary["by_variant"], summary["variants"]):  # a variant; its task when it has one seed
            if row["b"] == "base" and row["a"] in table:
                table[row["a"]]["vs_base"] = vs_base
    summary["missing"] = [line for t in tasks for line in per_task[t.name]["missing"]]
    summary["partial"] = partial_line(run_dir, manifest, tasks, facts)
    summary["header"] = run_header(manifest, per_task, tasks)
    summary["changed"] = variants_changed(run_dir, tasks)
    summary["caveat"] = sentences.one_seed_caveat(summary["ab"])
    rounds = contest_rounds(run_dir, every)  # seeds=auto: a later round starts once the earlier ones ended
    summary["cost"] = cost.account(every, per_task, summary["winner"], rounds)  # in all, to the decision
    summary["forecast"] = forecast.compare(run_dir, summary, manifest)  # forecast.json beside what happened
    members = fused.members(tasks)
    tables = {
        "steps_detail": pd.concat([metrics.per_step_table(t) for t in tasks] or [pd.DataFrame()]),
        "devices": pd.concat(  # a fused member's devices are its leader's: shown once, under the leader
            [metrics.device_table(t).assign(task=t.name) for t in tasks if len(t.steps) and t.name not in members]
            or [pd.DataFrame()]
        ),
    }
    return summary, tasks, tables


def write_report(run_dir: Path, out: Path | None = None, peak_tflops: float | None = None) -> dict:
    """Analyze run_dir and write its report into out (default run_dir/report); returns summary.json's dict."""
    return report_run(run_dir, out, peak_tflops)[0]


def report_run(run_dir: Path, out: Path | None = None, peak_tflops: float | None = None) -> tuple[dict, list[Task]]:
    run_dir = Path(run_dir)
    summary, tasks, tables = analyze(run_dir, peak_tflops)
    out = Path(out) if out else RunLayout(run_dir).report
    make_dir(out)
    summary["links"] = task_links(run_dir, out, tasks)
    summary["plots"] = plots.all_plots(tasks, summary["base"]["val_loss"], out, summary)
    curves = task_metrics.curves(tasks)  # eval.metrics over steps (docs/metrics.md)
    summary["plots"] += [p for p in [task_metrics.plot_curves(curves, out)] if p]
    summary = finite(summary)
    steps = tables["steps_detail"]
    compat = (
        steps[steps["task"].isin(list(summary["variants"]))].rename(
            columns={"task": "variant", "n_tokens": "tokens", "t_step_s": "step_time_s"}
        )[["variant", "step", "loss", "tokens", "step_time_s"]]
        if len(steps)
        else pd.DataFrame(columns=["variant", "step", "loss", "tokens", "step_time_s"])
    )
    csvs = {
        "steps.csv": compat,
        "steps_detail.csv": steps,
        "devices.csv": tables["devices"],
        "variants.csv": task_table(summary),
        "ab.csv": pd.DataFrame(summary["ab"]),
        "metrics.csv": curves,
        "evals.csv": pd.concat(
            [t.evals.assign(task=t.name)[["task", "step", "val_loss"]] for t in tasks if len(t.evals)]
            or [pd.DataFrame(columns=["task", "step", "val_loss"])]
        ),
    }
    for name, df in csvs.items():
        atomic_write(out / name, df.to_csv(index=False))
    blocks = document(summary, tables)
    atomic_write(out / "report.md", to_markdown(blocks))
    atomic_write(out / "report.html", to_html(blocks, f"{summary['experiment']}: run report", out))
    atomic_write(out / "summary.json", json.dumps(summary, indent=1))
    return summary, tasks


def write_report_job(run_dir: str) -> dict:
    """The last job of a Slurm run: the report, once every stage has ended (afterany)."""
    return write_report(Path(run_dir))
