"""The pruning rules side by side on real tasks: real runs of the fixed design (prune=false: every task to its
end, every evaluation recorded), and every rule replayed on the very same recorded curves in the order the
evaluations really happened. Writes benchmarks/results/prune_replay.md (and .json, the recordings too).

    python benchmarks/prune_replay.py [--repeats 20] [--out benchmarks/results/prune_replay]
                                                        (needs optuna: pip install -e .[bench])
    python benchmarks/prune_replay.py --recordings benchmarks/results/prune_replay.json
                                        (the rules again on an earlier results file's recorded runs; no new run)

Each repeat is one run as benchmarks/prune_real.py makes it (its `launch`): variants `a` and `b` (the same config:
an A/A pair) and `loser` (train.lr=1e-6), 3 training seeds each, the tiny config-built model on data=stdlib,
8 steps, an evaluation every 2 steps on 4 eval batches, this machine's default launcher.cpu_slots; but prune=false.
From the run directory, per task (task.json: variant, seed): each evaluation's per-batch held-out sums, tokens and
sources, and the time it happened (rank 0's `eval` rows in events-rank0.jsonl: docs/run-directory.md). The
in-training evaluations (steps 2, 4, 6: the looks prune=true takes) in the order of their times are the
arrivals; the evaluation at step 8 (after the last step) is each task's final loss.

The rules are benchmarks/prune_protocol.py's functions (run_rules, tally, figures), on a Design read from the run:
contest (prune=true today: the production code, worker/prune.after_eval with its files and lock, the sources
passed as the worker passes them), per replicate (prune=true before), ASHA (Ray Tune's defaults, reduction factor
4 and grace period 1: with 3 evaluations one rung, at the first, where a task above the 25th percentile of the
losses before it stops), optuna's WilcoxonPruner (optuna itself, its defaults), fixed. They are counted as
prune_protocol counts them: a false prune is a run where `a` or `b` was pruned; the winner is the variant with the
lowest mean final loss among the tasks that ran to the end; device-steps are the steps the tasks trained (a task
stops at the evaluation that pruned it) beside the fixed design's 9 x 8.

What a replay cannot show: under a rule that prunes, the tasks behind a pruned one would start sooner, and
prune=true ends a replicate that starts after its variant was pruned before its first step (prune_real.py counts
it at step 0; here it stops at its first evaluation, as in prune_protocol). The arrival order is the fixed design's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import REPO, check, header, write  # noqa: E402
from prune_protocol import RULES, Design, figures, require_optuna, run_rules, tally  # noqa: E402
from prune_real import VARIANTS, launch  # noqa: E402

from slurm_router.rundir.events import read_events  # noqa: E402
from slurm_router.rundir.layout import RunLayout  # noqa: E402
from slurm_router.worker.prune import read_looks  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "prune_replay"
LOSER = "loser"
REPLAY_RULES = RULES
SEEDS, STEPS = 3, 8


def recording(run_dir: Path) -> dict:
    """What a run recorded, per task: variant, seed, steps, each evaluation (step, time, loss_sums, tokens,
    sources) from rank 0's events, the start and end times; and the run's looks (decisions.jsonl, prune=true)."""
    tasks = {}
    layout = RunLayout(run_dir)
    for spec_path in sorted(layout.tasks.glob("*/task.json")):
        spec = json.loads(spec_path.read_text())
        paths = layout.task(spec_path.parent.name)
        rows = list(read_events(paths.events(0)))
        result = json.loads(paths.result.read_text()) if paths.result.is_file() else {}
        tasks[paths.name] = {
            "variant": spec["variant"],
            "seed": int(spec["seed"]),
            "steps": int(spec["steps"]),
            "start": min(r["time"] for r in rows if r["event"] == "start"),
            "end": max((r["time"] for r in rows if r["event"] == "end"), default=None),
            "exit_state": result.get("exit_state", "completed" if result else None),
            "evals": [
                {
                    "step": r["step"],
                    "time": r["time"],
                    "loss_sums": r["batch_loss_sums"],
                    "tokens": r["batch_tokens"],
                    "sources": r.get("batch_sources"),
                }
                for r in rows
                if r["event"] == "eval"
            ],
        }
    return {"tasks": tasks, "looks": read_looks(run_dir)}


def replay_input(rec: dict) -> tuple[Design, list[tuple[float, str, int, int]], dict, dict[str, tuple[str, int]]]:
    """(the run's Design, its arrivals (time, variant, replicate, step) in time order, its tables {step: {variant:
    {replicate: row}}}, {task: (variant, replicate)}) from a recording. A replicate is the seed's place among its
    variant's seeds (0, 1, 2); in-training evaluations are those after step 0 and before the last step."""
    tasks = rec["tasks"]
    variants = tuple(sorted({t["variant"] for t in tasks.values()}))
    seeds = {v: sorted(t["seed"] for t in tasks.values() if t["variant"] == v) for v in variants}
    (n_seeds,) = {len(s) for s in seeds.values()}
    (steps,) = {t["steps"] for t in tasks.values()}
    where = {name: (t["variant"], seeds[t["variant"]].index(t["seed"])) for name, t in tasks.items()}
    events, tabs = [], {}
    for name, t in tasks.items():
        v, i = where[name]
        for e in t["evals"]:  # a step evaluated twice (a requeue) gives the same numbers: the last one counts
            tabs.setdefault(e["step"], {}).setdefault(v, {})[i] = {
                "loss_sums": e["loss_sums"],
                "tokens": e["tokens"],
                **({"sources": e["sources"]} if e.get("sources") is not None else {}),
            }
        firsts = {e["step"]: e["time"] for e in reversed(t["evals"])}
        events += [(at, v, i, step) for step, at in firsts.items() if 0 < step < steps]
    eval_steps = tuple(sorted({step for _, _, _, step in events}))
    return Design(variants, n_seeds, eval_steps, steps, final=steps), sorted(events), tabs, where


def replay(rec: dict, work: Path, rules=REPLAY_RULES) -> tuple[Design, dict, dict]:
    """Every rule on one recording: (its Design, its tables, {rule: (variants pruned, {(variant, replicate): step
    it stopped at})}). The contest's run directory is made under `work` and removed."""
    design, events, tabs, _ = replay_input(rec)
    run = Path(tempfile.mkdtemp(prefix="contest-", dir=work))
    try:
        got = run_rules(run, events, tabs, design, list(rules))
    finally:
        shutil.rmtree(run, ignore_errors=True)
    return design, tabs, {r: got[r] for r in rules}


def device_seconds(rec: dict, stopped: dict[tuple[str, int], int]) -> float:
    """The recorded seconds the tasks held a device to where the rule stopped them: from a task's start to the
    evaluation that pruned it, or to its end; a replicate the contest stopped between evaluations (at the step it
    was in when its variant was pruned) to that step, linear between the recorded evaluations around it."""
    _, _, _, where = replay_input(rec)
    total = 0.0
    for name, t in rec["tasks"].items():
        step = stopped.get(where[name])
        at = {e["step"]: e["time"] for e in t["evals"]}
        end = t["end"] or at[max(at)]
        if step is None or step >= t["steps"]:
            stop = end
        elif step in at:
            stop = at[step]
        else:
            points = sorted({0: t["start"], **at, t["steps"]: end}.items())
            stop = float(np.interp(step, [s for s, _ in points], [x for _, x in points]))
        total += stop - t["start"]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20, help="real runs (each: a, b and loser, 3 seeds each)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results path without suffix (.md and .json)")
    ap.add_argument("--recordings", type=Path, help="replay the runs an earlier results .json recorded (no new run)")
    args = ap.parse_args()
    require_optuna()
    check(args.out.with_suffix(".md"))
    command = "python benchmarks/prune_replay.py" + (f" --repeats {args.repeats}" if args.repeats != 20 else "")
    earlier = json.loads(args.recordings.read_text()) if args.recordings else None
    if earlier is not None:
        command = f"python benchmarks/prune_replay.py --recordings {args.recordings}"
        args.repeats = len(earlier["runs"])
    head = header(command)
    load_before = os.getloadavg()
    counts: dict[str, dict] = {}
    runs, seconds = [], []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="prune_replay-") as tmp:
        for i in range(args.repeats):
            if earlier is not None:  # the runs an earlier results file recorded, replayed again
                run_dir, wall, rec = Path(tmp) / "none", earlier["runs"][i]["seconds"], earlier["runs"][i]["recording"]
            else:
                run_dir, wall, _ = launch(Path(tmp), i, SEEDS, STEPS, prune=False)
                rec = recording(run_dir)
            design, tabs, got = replay(rec, Path(tmp))
            tally(counts, got, tabs, LOSER, design)
            fixed_s = device_seconds(rec, {})
            runs.append(
                {
                    "repeat": i,
                    "seconds": wall,
                    "rules": {
                        r: {
                            "pruned": sorted(pruned),
                            "stopped": {f"{v}-r{s}": step for (v, s), step in sorted(stopped.items())},
                            "device_seconds_share": device_seconds(rec, stopped) / fixed_s,
                        }
                        for r, (pruned, stopped) in got.items()
                    },
                    "recording": rec,
                }
            )
            seconds.append(wall)
            shutil.rmtree(run_dir, ignore_errors=True)
            said = {r: sorted(p) for r, (p, _) in got.items() if p}
            print(f"repeat {i}: {wall:.0f} s, pruned {said or 'none'}", flush=True)
    load_after = os.getloadavg()
    recorded, origin = "", {}
    if earlier is not None:  # the load the real runs met is the recording's
        load_before, load_after = earlier["load_before"], earlier["load_after"]
        origin = earlier.get("recorded_by") or {"command": earlier["command"], "commit": earlier["commit"]}
        recorded = f" The runs were recorded by `{origin['command']}` at commit {origin['commit']} and replayed here."
    n = args.repeats
    rates = figures(counts, n, design)
    for r in REPLAY_RULES:
        rates[r]["device_seconds_share"] = statistics.mean(x["rules"][r]["device_seconds_share"] for x in runs)
    lines = [
        "# The pruning rules side by side on real tasks (recorded runs of the fixed design, replayed)",
        "",
        *head,
        "",
        f"{n} real runs of the fixed design (prune=false): variants `a` and `b` (the same config: an A/A pair) and "
        f"`loser` (train.lr=1e-6), {SEEDS} training seeds each, the tiny config-built model on data=stdlib, {STEPS} "
        f"steps, evaluations at steps {', '.join(map(str, design.eval_steps))} (the looks) and {STEPS} (the final "
        "loss), 4 eval batches, this machine's default launcher.cpu_slots. Every rule replayed on each run's "
        "recorded per-batch tables, the evaluations in the order their events' times give; 'contest' is the "
        "production code (prune=true). The rules and the counts are prune_protocol.py's; the script's docstring "
        f"says what a replay cannot show. Load average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_before)} "
        f"before, {'/'.join(f'{x:.2f}' for x in load_after)} after; median wall time of a run "
        f"{statistics.median(seconds):.0f} s.{recorded}",
        "",
        "| rule | runs with a or b pruned (false) | 95% interval | loser pruned | winner not the loser | "
        "device-steps vs fixed | device-time vs fixed |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in REPLAY_RULES:
        x, c = rates[r], counts[r]
        lo, hi = x["false_ci"]
        lines.append(
            f"| {r} | {c['false']}/{n} ({x['false_rate']:.0%}) | {lo:.1%}-{hi:.1%} | {c['caught']}/{n} "
            f"({x['caught_rate']:.0%}) | {c['winner']}/{n} ({x['winner_rate']:.0%}) | {x['device_steps_share']:.0%} | "
            f"{x['device_seconds_share']:.0%} |"
        )
    c = counts["contest"]
    lines += [
        "",
        "Device-time: the recorded seconds from each task's start to the evaluation that stopped it (or its end), "
        "beside the fixed design's; a mean of the runs' shares.",
        "",
        f"The contest rule pruned `a` or `b` in {c['false']} of {n} runs and the loser in {c['caught']}; the winner "
        f"was not the loser in {c['winner']} of {n}. Took {time.time() - t0:.0f} s.",
    ]
    res = {
        "command": command,
        "header": head,
        "variants": VARIANTS,
        "design": {"eval_steps": list(design.eval_steps), "steps": design.steps, "seeds": design.seeds},
        "rates": rates,
        "counts": counts,
        **({"recorded_by": origin} if earlier is not None else {}),  # the commit and command that ran the runs
        "load_before": load_before,
        "load_after": load_after,
        "runs": runs,
    }
    write(args.out.with_suffix(".md"), "\n".join(lines), res)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
