"""The pruning rules on real curves that cross (issue 48, "the decision users care about is the end of training"): a
learning-rate sweep and a LoRA-rank sweep recorded with the real command (prune=false: every task to its end, every
evaluation recorded), and every rule replayed on the recorded curves in the order the evaluations happened: how
often a rule prunes the variant that would have won at the end, and what it saves against the fixed design.
Writes OUT/prune_crossing_lr.md, OUT/prune_crossing_rank.md (and .json), and with a recording
OUT/prune_crossing_recordings.md and .json (what the replay reads; OUT defaults to benchmarks/results).

    python benchmarks/prune_crossing.py [--runs 20] [--out DIR]         (needs optuna: pip install -e .[bench])
    python benchmarks/prune_crossing.py --recordings benchmarks/results/prune_crossing_recordings.json [--out DIR]
                                              (the rules again on the committed recordings; no new run)

The recording: real commands (prune=false) of the tiny config-built model on data=stdlib (base.enabled=false,
data.max_len 32, train.global_batch_size 8, 30 steps with 3 warmup steps and the cosine decay to 10%, an evaluation
every 5 steps on 8 eval batches of 8 samples), 7 variants: lr3e-2, lr1e-2, r8, lr1e-3 (train.lr 3e-2, 1e-2, 3e-3,
1e-3 at model.lora.r 8) and r4, r32, r64 (model.lora.r 4, 32, 64 at train.lr 3e-3; model.lora.alpha 16 in every
variant, the update scaled by 16/r). One command records 10 runs: 30 training seeds (`seeds=[...]`), with
resources.fuse_variants=21, so the 7 variants of 3 consecutive seeds train fused in one process, side by side with
the next group on this machine's default launcher.cpu_slots. A replay run is one such group of 3 seeds
(benchmarks/prune_replay.py `recording`, the group's tasks apart); the runs of one command share its eval batches
(they come from the config seed: the command's index, 0 and 1 for 20 runs). The sweeps are read from it:
- lr: lr3e-2, lr1e-2, r8, lr1e-3 (the highest leads at the first evaluation, then stalls or spikes; the lowest
  trails far behind early and catches up);
- rank: r4, r8, r32, r64 (the smaller the rank the larger the update early: alpha / r x sqrt(r)).
r8 is in both sweeps. The in-training evaluations (steps 5..25) are the arrivals, the one at step 30 each task's final
loss. Exploratory runs on this machine (2 cores shared with other work) sized it: at data.max_len 64 and 36 steps
the recording would have taken about 40 minutes; with 2 seeds a run the contest cannot prune at all (the seeds'
part of the interval has one degree of freedom a side).

The rules (benchmarks/prune_protocol.py run_rules, as prune_replay.py runs them): contest (the production code,
worker/prune.after_eval, its files and lock) with the grace period of the Schedule built from the Design at 0, 0.25,
0.5 (the default, verdict.GRACE) and 0.75 of training; ASHA (Ray Tune's defaults); optuna's WilcoxonPruner
(defaults); fixed. Per run, from the fixed design's recording: the final winner is the variant with the lowest
mean final held-out loss over its seeds (step 30), the final loser the highest. Per rule: runs where it pruned the
final winner (any replicate of it), runs where it pruned the final loser, runs where the variant it leaves best (the
lowest mean final loss among the tasks it ran to the end) is the final winner, and the mean final loss that choice
gives up; device-steps (prune_protocol.device_steps) and recorded device-seconds (prune_replay.device_seconds: a
task's start to the evaluation that stopped it, or its end) beside the fixed design's. A fused group's process time
is counted once per member, so a member's seconds are its share of the group's; pruning a member of a fused group
shortens the group's steps rather than freeing a device. The curves' crossing: per evaluation step, the runs whose
leader there (lowest mean loss) is the final winner, and the share of variant pairs ordered there as at the end.
prune_replay.py's docstring says what a replay cannot show.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import RESULTS, check, fields, header, write  # noqa: E402
from prune_protocol import device_steps, require_optuna, run_rules  # noqa: E402
from prune_replay import device_seconds, recording, replay_input  # noqa: E402

from slurm_router.verdict import GRACE  # noqa: E402
from slurm_router.verdict.pruning import mean_loss  # noqa: E402

# One recording serves both sweeps: r8 (train.lr 3e-3, model.lora.r 8) is in each.
VARIANTS = {
    "lr3e-2": {"train": {"lr": 3e-2}},
    "lr1e-2": {"train": {"lr": 1e-2}},
    "r8": {},
    "lr1e-3": {"train": {"lr": 1e-3}},
    "r4": {"model": {"lora": {"r": 4}}},
    "r32": {"model": {"lora": {"r": 32}}},
    "r64": {"model": {"lora": {"r": 64}}},
}
SWEEPS = {"lr": ("lr3e-2", "lr1e-2", "r8", "lr1e-3"), "rank": ("r4", "r8", "r32", "r64")}
ABOUT = {
    "lr": "train.lr 3e-2, 1e-2, 3e-3 (r8), 1e-3 at model.lora.r 8",
    "rank": "model.lora.r 4, 8, 32, 64 at train.lr 3e-3",
}
SEEDS_PER_RUN, RUNS_PER_COMMAND = 3, 10
SETTINGS = [
    "+experiment=lora_ab",
    "base.enabled=false",
    "data=stdlib",
    "data.max_len=32",
    "model.lora.r=8",
    "model.lora.alpha=16",
    "train.lr=3e-3",
    "train.global_batch_size=8",
    "train.eval_batch_size=8",
    "train.steps=30",
    "train.warmup_steps=3",
    "train.eval_every=5",
    "train.eval_batches=8",
    "prune=false",
    f"resources.fuse_variants={SEEDS_PER_RUN * len(VARIANTS)}",
]
GRACES = (0.0, 0.25, GRACE, 0.75)
CONTESTS = tuple(f"contest (grace {g:g})" for g in GRACES)
RULES = (*CONTESTS, "ASHA", "optuna Wilcoxon", "fixed")
NAME = "prune_crossing"


def variants_arg() -> str:
    def flow(x) -> str:
        return "{" + ", ".join(f"{k}: {flow(v)}" for k, v in x.items()) + "}" if isinstance(x, dict) else f"{x:g}"

    return "+variants=" + flow(VARIANTS)


def argv(command: int, root: Path, runs: int = RUNS_PER_COMMAND) -> list[str]:
    """The real command recording `runs` runs (SEEDS_PER_RUN seeds each, from command * RUNS_PER_COMMAND *
    SEEDS_PER_RUN on) of every variant; its config seed (the eval batches) is `command`."""
    first = command * RUNS_PER_COMMAND * SEEDS_PER_RUN
    seeds = ",".join(str(first + i) for i in range(runs * SEEDS_PER_RUN))
    return [*SETTINGS, f"seed={command}", f"seeds=[{seeds}]", "~variants", variants_arg(), f"run_root={root}"]


def record(root: Path, command: int, runs: int) -> tuple[dict, float]:
    """One recording command: (its recording, its wall time)."""
    args = [sys.executable, "-m", "slurm_router", *argv(command, root, runs)]
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=7200)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    run_dir = Path(proc.stdout.strip().splitlines()[-1].removeprefix("run_dir: "))
    rec = recording(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    return rec, seconds


def split(rec: dict, sweep: str) -> list[dict]:
    """A recording's replay runs of a sweep: its variants' tasks by groups of SEEDS_PER_RUN consecutive seeds (a
    fused task's seeds), each a recording prune_replay.replay_input reads."""
    tasks = {n: t for n, t in rec["tasks"].items() if t["variant"] in SWEEPS[sweep]}
    seeds = sorted({t["seed"] for t in tasks.values()})
    groups = [seeds[i : i + SEEDS_PER_RUN] for i in range(0, len(seeds), SEEDS_PER_RUN)]
    return [{"tasks": {n: t for n, t in tasks.items() if t["seed"] in g}, "looks": []} for g in groups]


def loss_at(tabs: dict, step: int) -> dict[str, float]:
    """{variant: mean over its seeds of the per-token held-out loss at the step}."""
    return {v: mean_loss(side) for v, side in tabs[step].items()}


def crossing(tabs: dict, design) -> dict:
    """The fixed design's curves: its final winner and loser, and per evaluation step whether the leader there is
    the final winner and the share of variant pairs ordered there as at the end."""
    final = loss_at(tabs, design.final_step)
    pairs = list(itertools.combinations(sorted(final), 2))
    steps = {}
    for step in design.eval_steps:
        now = loss_at(tabs, step)
        same = sum((now[a] < now[b]) == (final[a] < final[b]) for a, b in pairs)
        steps[step] = {"leader": min(now, key=now.get), "pairs_as_at_end": same / len(pairs)}
    return {"final": final, "winner": min(final, key=final.get), "loser": max(final, key=final.get), "steps": steps}


def replay_run(rec: dict, work: Path) -> tuple[object, dict, dict]:
    """Every rule on one run: (its Design, its tables, {rule: (variants pruned, {(variant, replicate): step})}).
    The contest once per grace, on the Design with that grace (prune_protocol.contest_rule builds the Schedule from
    it); its run directories are made under `work` and removed."""
    design, events, tabs, _ = replay_input(rec)
    got = {}
    for rule, grace in zip(CONTESTS, GRACES):
        run = Path(tempfile.mkdtemp(prefix="contest-", dir=work))
        try:
            got[rule] = run_rules(run, events, tabs, dataclasses.replace(design, grace=grace), ["contest"])["contest"]
        finally:
            shutil.rmtree(run, ignore_errors=True)
    got.update(run_rules(work / "unused", events, tabs, design, ["ASHA", "optuna Wilcoxon", "fixed"]))
    return design, tabs, got


def outcome(rec: dict, design, tabs: dict, cross: dict, pruned: set, stopped: dict) -> dict:
    """One rule on one run: the final winner or loser pruned, the variant it leaves best and what that gives up,
    and its device-steps and device-seconds as shares of the fixed design's."""
    last, end = tabs[design.final_step], design.steps
    alive = {v: {s: r for s, r in side.items() if stopped.get((v, s), end) == end} for v, side in last.items()}
    pick = min((v for v in alive if alive[v]), key=lambda v: mean_loss(alive[v]))
    return {
        "pruned": sorted(pruned),
        "stopped": {f"{v}-r{s}": step for (v, s), step in sorted(stopped.items())},
        "winner_pruned": cross["winner"] in pruned,
        "loser_pruned": cross["loser"] in pruned,
        "pick": pick,
        "regret": cross["final"][pick] - cross["final"][cross["winner"]],
        "device_steps_share": device_steps(stopped, design) / design.fixed_steps,
        "device_seconds_share": device_seconds(rec, stopped) / device_seconds(rec, {}),
    }


def replay_sweep(recordings: list[dict], sweep: str, work: Path) -> tuple[list[dict], object]:
    """Every run of a sweep in the recordings replayed: [{seeds, crossing, rules: {rule: outcome}}], and the last
    run's Design."""
    runs, design = [], None
    for rec in recordings:
        for sub in split(rec, sweep):
            design, tabs, got = replay_run(sub, work)
            cross = crossing(tabs, design)
            rules = {r: outcome(sub, design, tabs, cross, *got[r]) for r in RULES}
            runs.append(
                {"seeds": sorted({t["seed"] for t in sub["tasks"].values()}), "crossing": cross, "rules": rules}
            )
            said = {r: x["pruned"] for r, x in rules.items() if x["pruned"]}
            print(f"  run {len(runs) - 1}: winner {cross['winner']}, pruned {said or 'none'}", flush=True)
    return runs, design


def share(n: int, d: int) -> str:
    return f"{n}/{d} ({n / d:.0%})" if d else "0/0"


def report(sweep: str, runs: list[dict], design, head: list[str], note: str) -> tuple[list[str], dict]:
    """The sweep's markdown lines and its figures."""
    n = len(runs)
    figures = {
        r: {
            "winner_pruned": sum(x["rules"][r]["winner_pruned"] for x in runs),
            "loser_pruned": sum(x["rules"][r]["loser_pruned"] for x in runs),
            "any_pruned": sum(bool(x["rules"][r]["pruned"]) for x in runs),
            "picked_winner": sum(x["rules"][r]["pick"] == x["crossing"]["winner"] for x in runs),
            "mean_regret": statistics.mean(x["rules"][r]["regret"] for x in runs),
            "device_steps_share": statistics.mean(x["rules"][r]["device_steps_share"] for x in runs),
            "device_seconds_share": statistics.mean(x["rules"][r]["device_seconds_share"] for x in runs),
        }
        for r in RULES
    }
    winners = {v: sum(x["crossing"]["winner"] == v for x in runs) for v in SWEEPS[sweep]}
    losers = {v: sum(x["crossing"]["loser"] == v for x in runs) for v in SWEEPS[sweep]}
    lines = [
        f"# The pruning rules on real curves that cross: the {sweep} sweep (recorded runs of the fixed design, replayed)",
        "",
        *head,
        "",
        f"{n} runs of variants {', '.join(f'`{v}`' for v in SWEEPS[sweep])} ({ABOUT[sweep]}), {design.seeds} "
        f"training seeds each, the tiny config-built model on data=stdlib, {design.steps} steps, evaluations at steps "
        f"{', '.join(map(str, design.eval_steps))} (the looks) and {design.steps} (the final loss), 8 eval batches. "
        f"The settings, the runs and the rules are in the script's docstring.{note}",
        "",
        "Final winner (lowest mean final loss over the seeds, in the fixed design): "
        + ", ".join(f"`{v}` {k}" for v, k in winners.items())
        + "; final loser: "
        + ", ".join(f"`{v}` {k}" for v, k in losers.items())
        + ".",
        "",
        "## How the curves cross",
        "",
        "| step | runs whose leader there is the final winner | pairs ordered there as at the end (mean) |",
        "|---:|---:|---:|",
    ]
    for step in design.eval_steps:
        led = sum(x["crossing"]["steps"][step]["leader"] == x["crossing"]["winner"] for x in runs)
        pairs = statistics.mean(x["crossing"]["steps"][step]["pairs_as_at_end"] for x in runs)
        lines.append(f"| {step} | {share(led, n)} | {pairs:.0%} |")
    lines += [
        "",
        "## The rules",
        "",
        "| rule | runs it pruned the final winner | pruned the final loser | pruned any | leaves the final winner "
        "best | mean final loss given up (nats/token) | device-steps vs fixed | device-seconds vs fixed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in RULES:
        f = figures[r]
        lines.append(
            f"| {r} | {share(f['winner_pruned'], n)} | {share(f['loser_pruned'], n)} | {share(f['any_pruned'], n)} | "
            f"{share(f['picked_winner'], n)} | {f['mean_regret']:.4f} | {f['device_steps_share']:.0%} | "
            f"{f['device_seconds_share']:.0%} |"
        )
    early = sum(x["crossing"]["steps"][design.eval_steps[0]]["leader"] == x["crossing"]["winner"] for x in runs)
    crossed = sum(any(s["leader"] != x["crossing"]["winner"] for s in x["crossing"]["steps"].values()) for x in runs)
    c, c0 = figures[CONTESTS[GRACES.index(GRACE)]], figures[CONTESTS[0]]
    lines += [
        "",
        "A rule prunes a variant when it stops any replicate of it. Device-steps and device-seconds: a mean of the "
        "runs' shares of the fixed design's (every task to the end).",
        "",
        f"The leader at the first evaluation (step {design.eval_steps[0]}) was the final winner in {share(early, n)} "
        f"runs; in {share(crossed, n)} the leader at some evaluation was not. The contest at the default grace "
        f"({GRACE:g}) pruned the final winner in {c['winner_pruned']} of {n} runs and some variant in "
        f"{c['any_pruned']}, at {c['device_steps_share']:.0%} of the fixed design's device-steps; looking from the "
        f"first evaluation (grace 0) it pruned the final winner in {c0['winner_pruned']} and some variant in "
        f"{c0['any_pruned']}, at {c0['device_steps_share']:.0%}. ASHA and optuna's WilcoxonPruner pruned the final "
        f"winner in {figures['ASHA']['winner_pruned']} and {figures['optuna Wilcoxon']['winner_pruned']} of {n} runs.",
    ]
    return lines, {"rates": figures, "winners": winners, "losers": losers}


def load(text: str) -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg()) if not text else text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help=f"replay runs per sweep ({SEEDS_PER_RUN} seeds each)")
    ap.add_argument("--out", type=Path, help="write here instead of benchmarks/results/ (any tree state)")
    ap.add_argument("--recordings", type=Path, help="replay an earlier recordings .json (no new run)")
    args = ap.parse_args()
    require_optuna()
    out = args.out or RESULTS
    names = [f"{NAME}_{s}.md" for s in SWEEPS] + ([] if args.recordings else [f"{NAME}_recordings.md"])
    check(*(out / x for x in names))
    t0 = time.time()
    if args.recordings:
        recorded = json.loads(args.recordings.read_text())
        command = f"python benchmarks/prune_crossing.py --recordings {args.recordings}"
        note = (
            f" Recorded by `{recorded['command']}` at commit {recorded['commit']} ({recorded['date']}, in "
            f"{recorded['seconds']:.0f} s, load {recorded['load']}) and replayed here."
        )
    else:
        command = "python benchmarks/prune_crossing.py" + (f" --runs {args.runs}" if args.runs != 20 else "")
        before, commands, recording_head = load(""), [], header(command)  # the tree the runs ran from
        with tempfile.TemporaryDirectory(prefix="prune_crossing-") as tmp:
            for c in range(-(-args.runs // RUNS_PER_COMMAND)):
                runs = min(RUNS_PER_COMMAND, args.runs - c * RUNS_PER_COMMAND)
                rec, seconds = record(Path(tmp), c, runs)
                print(f"command {c}: {runs} runs, {seconds:.0f} s", flush=True)
                commands.append({"seconds": seconds, "argv": argv(c, Path("RUN_ROOT"), runs), "tasks": rec["tasks"]})
        recorded = {"seconds": time.time() - t0, "load": f"{before} before, {load('')} after (1/5/15 min)"}
        lines = [
            "# Recorded real curves for the pruning replay on crossing curves: a learning-rate and a rank sweep",
            "",
            *recording_head,
            "",
            f"The runs `{command.replace(' --runs', '')} --recordings` (this .json) replays: the real commands "
            f"(`argv` in the .json, prune=false), each {RUNS_PER_COMMAND} runs of {SEEDS_PER_RUN} training seeds of "
            f"the variants {', '.join(f'`{v}`' for v in VARIANTS)}; per task its evaluations (per-batch held-out "
            f"sums, tokens, sources, times), its start and end. Recorded in {recorded['seconds']:.0f} s; load "
            f"{recorded['load']}.",
        ]
        write(out / f"{NAME}_recordings.md", "\n".join(lines))
        recorded = {**fields("\n".join(lines)), **recorded, "variants": VARIANTS, "commands": commands}
        (out / f"{NAME}_recordings.json").write_text(json.dumps(recorded, separators=(",", ":")) + "\n")
        note = f" Recorded by this command in {recorded['seconds']:.0f} s (load {recorded['load']})."
    head = header(command)
    origin = {k: recorded[k] for k in ("command", "commit", "date")}
    recs = [{"tasks": c["tasks"], "looks": []} for c in recorded["commands"]]
    with tempfile.TemporaryDirectory(prefix="prune_crossing-replay-") as tmp:
        for sweep in SWEEPS:
            print(f"{sweep} sweep:", flush=True)
            runs, design = replay_sweep(recs, sweep, Path(tmp))
            lines, figures = report(sweep, runs, design, head, note)
            res = {"command": command, "recorded_by": origin, **figures, "runs": runs}
            write(out / f"{NAME}_{sweep}.md", "\n".join(lines), json.loads(json.dumps(res)))
            print("\n".join(lines), flush=True)
    print(f"took {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
