"""seeds=auto against fixed seed counts, on simulated runs that drive the production code: worker/prune.after_eval
(the evaluation files, RUN_DIR/decisions.jsonl and its lock, verdict/contest.py's looks by depth) and
verdict/contest.reserve_call (whether a reserve replicate runs). Writes benchmarks/results/auto_seeds.md (and .json).

    python benchmarks/auto_seeds.py [--runs 2000] [--power-runs 500] [--cap 6] [--min-effect 0.02]

The model is benchmarks/prune_protocol.py's: 4 in-training evaluations (steps 10, 20, 30, 40 of 50), tasks that
start at random within 1.5 evaluation periods of their round and evaluate every 0.7-1.4 periods, eval tables from
benchmarks/verdict_sim_model.py (lora_ab's noise sizes, 32 eval batches, `cap` seeds whose effects and the eval
batches' persist over steps, as in a real run; --fresh: each step drawn afresh, the model used before).
seeds=auto: round 1 runs 2 seeds of every variant; each later round adds one seed to each variant that
reserve_call lets run, once every task of the round before has ended (the barrier worker/auto_seeds.py waits on);
a pruned task stops at that evaluation (its result written, as the worker does), its variant's other running
replicates at the step they are in then, and so does a running reserve of the variant left once a look decides the
contest (prune_protocol.contest_rule, as the workers do).

- **A/A** (--runs): three equally good variants, `cap` seeds at most: any variant pruned is a false decision.
  The contest cannot end (no variant is worse), so every run goes to the cap: its cost is the price of asking.
- **A loser** (--power-runs per effect): two variants, the second worse by d nats per token. A run *decides
  correctly* when the loser is pruned (the contest decided) and the better one never is. The fixed design with
  n seeds (every seed of both variants to the end) decides by the same rule at one look at 5% on its final
  tables (verdict/pruning.look_at); it decides correctly when it names the loser. Device-steps: training steps
  run (a pruned task stops at the evaluation that pruned it; a reserve not run costs nothing).

The comparison the issue asks for: the fixed design that decides correctly at least as often as seeds=auto, at
the fewest seeds, against seeds=auto's device-steps.

--min-effect m (auto_seeds.min_effect) writes auto_seeds_min_effect.md instead: a look whose variants are all
within m of the best settles the contest and no later round runs. A run *settles* when that happened with no
variant pruned: right in A/A runs, a miss when a loser is worse by m or more.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import check, header, write  # noqa: E402
from prune_protocol import EVAL_STEPS, STEPS, Design, clopper_pearson, contest_rule  # noqa: E402
from prune_protocol import tables as protocol_tables  # noqa: E402

from slurm_router.rundir.spec import TaskSpec  # noqa: E402
from slurm_router.verdict import AUTO_FIRST  # noqa: E402
from slurm_router.verdict.contest import RUN, Replicate, pruned_in, reserve_call, settled_by  # noqa: E402
from slurm_router.verdict.pruning import look_at  # noqa: E402
from slurm_router.worker import prune  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "auto_seeds.md"


def tables(
    rng: np.random.Generator, variants: list[str], effects: tuple[float, ...], cap: int, persistent: bool = True
) -> dict:
    """{step: {variant: {seed: {loss_sums, tokens}}}} of `cap` seeds per variant (prune_protocol.tables: effects that
    persist over steps, or drawn afresh at each step)."""
    return protocol_tables(rng, effects, Design(tuple(variants), cap), persistent)


def auto_run(
    run: Path, rng: np.random.Generator, tabs: dict, variants: list[str], cap: int, min_effect: float | None = None
) -> dict:
    """One seeds=auto run through the production code: {pruned, settled, steps, seeds} (seeds: replicates run per
    variant; settled: a look found every variant left within min_effect of the best)."""
    config = {"seed": 0, "seeds": "auto", "auto_seeds": {"max": cap, "min_effect": min_effect}}
    planned = {(v, i) for v in variants for i in range(cap)}
    for v, i in sorted(planned):  # the plan's task.json files: a look waits for every variant's first round
        spec = TaskSpec(
            run_id="r", run_dir=str(run), experiment="e", name=f"{v}-s{i}", stage="variants", variant=v, index=0,
            devices=1, config=config, steps=STEPS, lr=1e-3, global_batch_size=8, lora=True, seed=i,
        )  # fmt: skip
        spec.task_dir.mkdir(parents=True, exist_ok=True)
        spec.task_dir.joinpath("task.json").write_text(spec.to_json())
    ended: set[tuple[str, int]] = set()
    steps = 0
    ran = {v: 0 for v in variants}
    for index in range(AUTO_FIRST - 1, cap):
        if index < AUTO_FIRST:
            batch = [(v, i) for i in range(AUTO_FIRST) for v in variants]
        else:
            reps = [Replicate(v, i, (v, i) in ended) for v, i in sorted(planned)]
            looks = prune.read_looks(run)
            batch = [(v, index) for v in variants if reserve_call(v, index, reps, looks)[0] == RUN]
        if not batch:
            break
        events = []
        for v, i in batch:
            start, period = rng.uniform(0, 1.5), rng.uniform(0.7, 1.4)
            events += [(start + period * (k + 1), v, i, step) for k, step in enumerate(EVAL_STEPS)]
        _, stopped = contest_rule(run, sorted(events), tabs, Design(tuple(variants), cap), config)
        for v, i in batch:
            ended.add((v, i))
            ran[v] += 1
            steps += stopped.get((v, i), STEPS)
    looks = prune.read_looks(run)
    return {"pruned": pruned_in(looks), "settled": settled_by(looks) is not None, "steps": steps, "seeds": ran}


def fixed_decides(tabs: dict, variants: list[str], n: int) -> set[str]:
    """The fixed design with n seeds: the variants the rule prunes at one look at 5% on the final tables."""
    last = tabs[EVAL_STEPS[-1]]
    groups = {v: {s: last[v][s] for s in range(n)} for v in variants}
    return set(look_at(groups, EVAL_STEPS[-1], 0.05, 1))


def one_setting(
    n_runs: int,
    effect: float,
    seed: int,
    work: Path,
    cap: int,
    min_effect: float | None = None,
    persistent: bool = True,
) -> dict:
    rng = np.random.default_rng(seed)
    variants = ["v0", "v1", "v2"] if effect == 0 else ["v0", "v1"]
    effects = tuple(0.0 for _ in variants) if effect == 0 else (0.0, effect)
    loser = None if effect == 0 else "v1"
    fixed_n = list(range(AUTO_FIRST, cap + 1))
    out = {"false": 0, "correct": 0, "settled": 0, "steps": 0, "seeds": 0, "fixed_correct": {n: 0 for n in fixed_n}}
    for r in range(n_runs):
        tabs = tables(rng, variants, effects, cap, persistent)
        run = work / f"{seed}-{r}"
        got = auto_run(run, rng, tabs, variants, cap, min_effect)
        out["false"] += bool(got["pruned"] - {loser})
        out["settled"] += got["settled"] and not got["pruned"]
        out["correct"] += loser is not None and got["pruned"] == {loser}
        out["steps"] += got["steps"]
        out["seeds"] += sum(got["seeds"].values())
        for n in fixed_n:
            out["fixed_correct"][n] += loser is not None and fixed_decides(tabs, variants, n) == {loser}
    per_run = len(variants) * STEPS
    return {
        "variants": len(variants),
        "false_rate": out["false"] / n_runs,
        "false_ci": clopper_pearson(out["false"], n_runs),
        "correct_rate": out["correct"] / n_runs,
        "correct_ci": clopper_pearson(out["correct"], n_runs),
        "settled_rate": out["settled"] / n_runs,
        "device_steps": out["steps"] / n_runs,
        "seeds_per_variant": out["seeds"] / n_runs / len(variants),
        "fixed": {n: {"correct_rate": out["fixed_correct"][n] / n_runs, "device_steps": n * per_run} for n in fixed_n},
    }


def matching_fixed(setting: dict) -> tuple[int, float] | None:
    """(n, device-steps ratio fixed/auto) of the fixed design with the fewest seeds that decides correctly at
    least as often as seeds=auto, or None when none does."""
    for n, f in setting["fixed"].items():
        if f["correct_rate"] >= setting["correct_rate"]:
            return n, f["device_steps"] / setting["device_steps"]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2000, help="A/A runs")
    parser.add_argument("--power-runs", type=int, default=500, help="runs per loser effect")
    parser.add_argument("--cap", type=int, default=6, help="auto_seeds.max")
    parser.add_argument("--min-effect", type=float, help="auto_seeds.min_effect (writes auto_seeds_min_effect.md)")
    parser.add_argument("--fresh", action="store_true", help="the old model: each step's tables drawn afresh")
    parser.add_argument("--out", type=Path, help="write here instead of benchmarks/results/ (any tree state)")
    args = parser.parse_args()
    results = RESULTS.with_name("auto_seeds_min_effect.md") if args.min_effect else RESULTS
    out = args.out / results.name if args.out else results
    if not args.out:
        check(results)
    command = f"python benchmarks/auto_seeds.py --runs {args.runs} --power-runs {args.power_runs} --cap {args.cap}"
    command += f" --min-effect {args.min_effect:g}" if args.min_effect else ""
    command += " --fresh" if args.fresh else ""
    keep = not args.fresh
    m = args.min_effect
    t0 = time.time()
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        settings = {0.0: one_setting(args.runs, 0.0, 1, Path(tmp), args.cap, m, keep)}
        for i, effect in enumerate((0.01, 0.02, 0.05)):
            settings[effect] = one_setting(args.power_runs, effect, 2 + i, Path(tmp), args.cap, m, keep)
    aa = settings[0.0]
    lines = [
        "# seeds=auto against fixed seed counts (simulated runs, production decision code)",
        "",
        *header(command),
        "",
        f"{len(EVAL_STEPS)} evaluations of {STEPS} steps per task; seeds=auto starts at {AUTO_FIRST} seeds and adds "
        f"rounds up to {args.cap}"
        + (
            f"; auto_seeds.min_effect={m:g}: a look with every variant within {m:g} nats of the best settles"
            if m
            else ""
        )
        + "; the model and rules are in the script's docstring. Eval "
        + (
            "tables drawn afresh at each step (the old model)."
            if args.fresh
            else "effects persist over steps "
            "(benchmarks/verdict_sim_model.py: the same seeds and eval batches at every evaluation)."
        ),
        "",
        f"## A/A: three equally good variants, {args.runs} runs",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| runs with a variant pruned (a false decision) | {aa['false_rate']:.1%} "
        f"(95% interval {aa['false_ci'][0]:.1%}-{aa['false_ci'][1]:.1%}) |",
        *(
            [f"| runs settled (every variant within {m:g} of the best, none pruned) | {aa['settled_rate']:.1%} |"]
            if m
            else []
        ),
        f"| seeds run per variant (mean) | {aa['seeds_per_variant']:.2f} |",
        f"| device-steps per run (mean) | {aa['device_steps']:.0f} |",
        "",
        f"## A loser: two variants, the second worse by d nats per token, {args.power_runs} runs each",
        "",
        "| d | seeds=auto decides correctly | "
        + ("settled as equal | " if m else "")
        + "its device-steps | seeds per variant | "
        + " | ".join(f"fixed {n} seeds" for n in settings[0.02]["fixed"])
        + " | fewest fixed seeds as good | device-steps, that fixed design / seeds=auto |",
        "|---:|---:|---:|---:|" + ("---:|" if m else "") + "---:|" * len(settings[0.02]["fixed"]) + "---:|---:|",
    ]
    for effect in (0.01, 0.02, 0.05):
        s = settings[effect]
        match = matching_fixed(s)
        fixed = " | ".join(f"{f['correct_rate']:.0%} ({f['device_steps']})" for f in s["fixed"].values())
        lines.append(
            f"| {effect} | {s['correct_rate']:.0%} | "
            + (f"{s['settled_rate']:.0%} | " if m else "")
            + f"{s['device_steps']:.0f} | {s['seeds_per_variant']:.2f} | {fixed} | "
            + (f"{match[0]} | {match[1]:.2f}x |" if match else "none up to the cap | - |")
        )
    lines += [
        "",
        "A fixed column: the share of runs whose final tables decide correctly, and (in brackets) its device-steps.",
        "",
        f"Took {time.time() - t0:.0f} s.",
    ]
    write(out, "\n".join(lines) + "\n", {"settings": {str(k): v for k, v in settings.items()}})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
