"""prune=true and the final verdict on simulated runs that behave as real ones: the same seeds and eval batches at
every step (their effects persist over steps), variants with their own train.steps, tasks at their own paces. The
decisions are the production pure functions: verdict/schedule.py Schedule, verdict/contest.py next_look, take and
decision_for at each evaluation as it arrives (as worker/prune.decide_after calls them), and at the end
verdict/stats.compare over every pair of the variants left with verdict/sentences.decide_rows (verdict/judge.py:
Holm over every ordered pair, 5%). Writes benchmarks/results/verdict_sim.md (and .json).

    python benchmarks/verdict_sim.py [--runs 2000] [--power-runs 500] [--out DIR] [--quick]

The model of the eval tables, its noise sizes (benchmarks/verdict_calibration.py's, lora_ab's) and the tasks'
paces: benchmarks/verdict_sim_model.py. A pruned variant's replicates stop: the one whose evaluation took the look
at that step, the others at the step they are in then (0 if not started); a replicate that ended is `ended` for the
looks from then on. Device-steps are the steps the tasks ran, beside the fixed design's (every task to its end).

1. A/A (--runs per k, k = 2, 4, 8, 16 equally good variants, 3 seeds, 32 eval batches, the variants' plan cycling
   (100, 10), (100, 10), (80, 10) as (train.steps, eval_every); the curves are flat, so that a variant trained
   80 steps is as good at its end as one trained 100): (a) runs where a look pruned a variant, (b) runs where the
   final verdict over the variants left declared a difference, (c) either. Then k = 4 under two other plans
   (eval_every 10 and 20; one variant of 50 steps): which of the planned look steps the runs could take.
2. Curves that cross (k = 4, every variant (100, 10)): two fast learners that plateau higher, two late bloomers
   that cross them (at step 39, or 63) and win; for grace 0, 0.25, 0.5, 0.75 how often a pruned variant was the
   final winner (the best true final mean, and the fixed design's observed best) and the device-steps. The same
   for a clear loser (0.02 and 0.05 nats worse at every step) without crossing: the power and the savings.
3. The old model (every step's tables drawn afresh) beside the persistent one, for one setting.
--quick: a smoke run of every section with few runs, printed only (~10 s of CPU). The defaults take ~8 minutes of
CPU time in one process (most of it k = 16's 120 pairs per look); the file says the time it took.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import check, header, write  # noqa: E402
from prune_protocol import clopper_pearson  # noqa: E402
from verdict_sim_model import (  # noqa: E402
    END,
    FRESH,
    TOKENS,
    Curve,
    Design,
    Noise,
    draw_losses,
    events,
    row,
    tasks,
)

from slurm_router.verdict import GRACE, stats  # noqa: E402
from slurm_router.verdict.contest import decision_for, next_look, pruned_in, take  # noqa: E402
from slurm_router.verdict.sentences import decide_rows  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "verdict_sim.md"
AA_KS = (2, 4, 8, 16)
AA_PLAN = ((100, 10), (100, 10), (80, 10))  # cycled over the variants
OTHER_PLANS = {  # k = 4, A/A: plans whose looks the schedule cannot all take
    "eval_every 10 and 20": ((100, 10), (100, 20), (100, 10), (100, 20)),
    "one variant of 50 steps": ((100, 10), (100, 10), (50, 10), (100, 10)),
}
GRACES = (0.0, 0.25, 0.5, 0.75)
FLAT = Curve()
# learning-rate-like: two fast learners plateau higher; two late bloomers (tau 14 or 20 steps) cross them and win
FAST, FAST2 = Curve(0.02, 0.5, 10.0), Curve(0.025, 0.5, 10.0)
SLOW = Curve(0.0, 0.5, 20.0)
CROSSINGS = {tau: (FAST, FAST2, Curve(0.0, 0.5, tau), Curve(0.005, 0.5, tau)) for tau in (14.0, 20.0)}
LOSERS = (0.02, 0.05)


def aa_design(k: int, noise: Noise = Noise(), plan: tuple[tuple[int, int], ...] = AA_PLAN) -> Design:
    """k equally good variants (flat curves), their (train.steps, eval_every) cycling `plan`."""
    return Design((FLAT,) * k, tuple(plan[i % len(plan)] for i in range(k)), noise=noise)


def loser_design(effect: float, grace: float, noise: Noise = Noise()) -> Design:
    """k = 4 on one curve shape, the last worse by `effect` at every step."""
    curves = (SLOW, SLOW, SLOW, Curve(effect, SLOW.height, SLOW.tau))
    return Design(curves, ((100, 10),) * 4, grace=grace, noise=noise)


def crossing_design(tau: float, grace: float) -> Design:
    """k = 4, every variant (100, 10): v0, v1 learn fast and plateau higher; v2, v3 (tau) win at the end."""
    return Design(CROSSINGS[tau], ((100, 10),) * 4, grace=grace)


def crossing_step(design: Design) -> int:
    """The last step at which a late bloomer (v2) is still worse than the first fast learner (v0)."""
    fast, slow = design.curves[0], design.curves[2]
    return max(t for t in range(design.plan[0][0] + 1) if slow.at(t) > fast.at(t))


def contest(design: Design, x: np.ndarray, run_tasks) -> tuple[list[dict], dict[tuple[str, int], int]]:
    """The run's looks and {(variant, seed): steps run} of the replicates a look stopped: each evaluation as it
    arrives is recorded and the run's next look taken if one is due (worker/prune.decide_after)."""
    schedule, names = design.schedule, design.names
    tokens = np.full(design.batches, float(TOKENS))
    tables: dict[int, dict[str, dict[int, dict]]] = {}
    ended: dict[tuple[str, int], int] = {}
    looks: list[dict] = []
    stopped: dict[tuple[str, int], int] = {}
    for t, kind, v, s, step in events(run_tasks):
        if (v, s) in stopped:
            continue
        if kind == END:
            ended[v, s] = max((k for k in tables if s in tables[k].get(v, {})), default=0)
            continue
        tables.setdefault(step, {}).setdefault(v, {})[s] = row(x, design, step, names.index(v), s, tokens)
        at = next_look(tables, ended, looks, schedule=schedule)
        if at is not None:
            looks.append(take(tables, at, looks, schedule.n_looks))
            for other in run_tasks:  # a pruned variant's replicates stop at the step they are in (LookWatch)
                key = (other.variant, other.seed)
                if other.variant in looks[-1]["pruned"] and key not in ended and key not in stopped:
                    stopped[key] = other.step_at(t)
        if decision_for(looks, v, step) is not None:
            stopped[v, s] = step  # this replicate stops after the evaluation that learned it
    return looks, stopped


def finals(design: Design, x: np.ndarray, variants: list[str]) -> dict[str, dict[int, dict]]:
    """Each variant's replicates' final evaluations (at its train.steps)."""
    tokens = np.full(design.batches, float(TOKENS))
    names = design.names
    return {
        v: {s: row(x, design, design.plan[names.index(v)][0], names.index(v), s, tokens) for s in range(design.seeds)}
        for v in variants
    }


def verdict(groups: dict[str, dict[int, dict]]) -> list[dict]:
    """The final verdict's rows over every pair of `groups` (as analysis/abtest.compare_all builds them), decided
    by verdict/sentences.decide_rows."""
    names = list(groups)
    rows = [
        {"a": a, "b": b, **stats.compare(groups[a], groups[b]).as_dict()}
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    ]
    decide_rows(rows)
    return rows


def declared(rows: list[dict]) -> bool:
    """The verdict names a winner of some pair: decided at 5% with training noise in the interval."""
    return any(r["significant"] and r["training_noise"] for r in rows)


def best_of(groups: dict[str, dict[int, dict]]) -> str:
    """The variant with the lowest observed mean final loss (what a user keeps)."""
    return min(groups, key=lambda v: np.mean([r["loss_sums"].sum() for r in groups[v].values()]))


def one_run(rng: np.random.Generator, design: Design) -> dict:
    """One simulated run under prune=true, and the fixed design on the very same draws."""
    x, run_tasks = draw_losses(rng, design), tasks(rng, design)
    looks, stopped = contest(design, x, run_tasks)
    pruned = pruned_in(looks)
    everyone = finals(design, x, design.names)
    left = {v: side for v, side in everyone.items() if v not in pruned}
    rows = verdict(left) if len(left) >= 2 else []
    fixed_rows = rows if not pruned else verdict(everyone)
    true = design.true_final()
    return {
        "pruned": pruned,
        "looks": len(looks),
        "look_steps": [line["step"] for line in looks],
        "declared": declared(rows),
        "fixed_declared": declared(fixed_rows),
        "true_best": {v for v, m in zip(design.names, true) if m <= min(true) + 1e-12},
        "fixed_best": best_of(everyone),
        "pick": best_of(left) if left else None,
        "device_steps": sum(stopped.get((t.variant, t.seed), t.steps) for t in run_tasks),
    }


def share(k: int, n: int) -> dict:
    lo, hi = clopper_pearson(k, n)
    return {"rate": k / n, "ci": [lo, hi], "count": k, "runs": n}


def aa(k: int, n: int, seed: int, noise: Noise = Noise(), plan=AA_PLAN) -> dict:
    """A/A with k equally good variants over n runs: (a) a look pruned one, (b) the final verdict declared a
    difference, (c) either; the fixed design's verdict; looks taken (and the share of runs that looked at each
    step); device-steps against the fixed design."""
    design, rng = aa_design(k, noise, plan), np.random.default_rng(seed)
    runs = [one_run(rng, design) for _ in range(n)]
    looked = [s for r in runs for s in r["look_steps"]]
    return {
        "k": k,
        "plan": [list(p) for p in design.plan],
        "looked_at": {str(s): looked.count(s) / n for s in design.schedule.look_steps},
        "looks_planned": design.schedule.n_looks,
        "look_steps": list(design.schedule.look_steps),
        "a_looks": share(sum(bool(r["pruned"]) for r in runs), n),
        "b_final": share(sum(r["declared"] for r in runs), n),
        "c_either": share(sum(bool(r["pruned"]) or r["declared"] for r in runs), n),
        "fixed_final": share(sum(r["fixed_declared"] for r in runs), n),
        "looks_taken": float(np.mean([r["looks"] for r in runs])),
        "device_steps_share": float(np.mean([r["device_steps"] for r in runs])) / design.fixed_steps,
    }


def contested(design: Design, n: int, seed: int, loser: str | None = None) -> dict:
    """Curves that differ: how often a pruned variant was the winner (the best true final mean; the fixed design's
    observed best), how often the pick is the true best with and without pruning, the loser's power, device-steps."""
    rng = np.random.default_rng(seed)
    runs = [one_run(rng, design) for _ in range(n)]
    out = {
        "grace": design.grace,
        "looks_planned": design.schedule.n_looks,
        "pruned_true_best": share(sum(bool(r["true_best"] & r["pruned"]) for r in runs), n),
        "pruned_fixed_best": share(sum(r["fixed_best"] in r["pruned"] for r in runs), n),
        "any_pruned": share(sum(bool(r["pruned"]) for r in runs), n),
        "pick_true_best": share(sum(r["pick"] in r["true_best"] for r in runs), n),
        "fixed_pick_true_best": share(sum(r["fixed_best"] in r["true_best"] for r in runs), n),
        "looks_taken": float(np.mean([r["looks"] for r in runs])),
        "device_steps_share": float(np.mean([r["device_steps"] for r in runs])) / design.fixed_steps,
    }
    if loser is not None:
        out["loser_pruned"] = share(sum(loser in r["pruned"] for r in runs), n)
        out["equal_pruned"] = share(sum(bool(r["pruned"] - {loser}) for r in runs), n)
    return out


def pct(x: dict) -> str:
    """'2.3% (1.7-3.0%)': a rate with its Clopper-Pearson 95% interval."""
    lo, hi = x["ci"]
    return f"{x['rate']:.1%} ({lo:.1%}-{hi:.1%})"


def model_lines(noise: Noise) -> list[str]:
    """The model and its sizes, in the results file."""
    return [
        "## The model",
        "",
        "Per step t, variant v, seed s, eval batch i the per-token held-out loss is "
        "`x = m_v(t) + a[v,s](t) + b[i](t) + c[v,i] + e[t,v,s,i]` (benchmarks/verdict_sim_model.py); every task "
        f"evaluates the same {Design.batches} eval batches of {TOKENS} target tokens.",
        "",
        "| part | what | size (nats per token) | over steps |",
        "|---|---|---:|---|",
        "| m_v(t) | the variant's curve, 2.5 + plateau + height exp(-t / tau) | - | - |",
        f"| a[v,s](t) | training noise (seed) | sd {noise.seed:g}, {noise.seed_shared:.0%} of its variance common to "
        f"the variants run with seed s | {noise.seed_fixed:.0%} fixed, the rest AR(1) {noise.ar:g} per 10 steps: "
        f"correlation {noise.look_to_look:.2f} between evaluations 10 steps apart |",
        f"| b[i](t) | eval batch difficulty, shared by every task | sd {noise.batch:g} | fixed but a drift of sd "
        f"{noise.batch_drift:g}, AR(1) {noise.ar:g} per 10 steps |",
        f"| c[v,i] | which eval samples favour variant v | sd {noise.variant_batch:g} | fixed |",
        f"| e | a replicate's per-batch noise at one evaluation | sd {noise.fresh:g} | fresh at every step |",
        "",
        "Sizes: benchmarks/verdict_calibration.py's (lora_ab's report; its training noise an assumption); the batch "
        "drift: the real runs recorded in benchmarks/results/prune_replay.json (a batch's loss relative to the "
        "others moves by ~0.0014 between evaluations); the persistence of the seed effect is an assumption. The old "
        "model (section 3) draws every step's a, b, c and e afresh. Tasks start at random within 1.5 evaluation "
        "periods and run at their own pace (an evaluation period of 0.7-1.4), all at once, as in "
        "benchmarks/prune_protocol.py.",
    ]


def aa_lines(rows: list[dict], n: int) -> list[str]:
    plan = ", ".join(f"({s}, {e})" for s, e in AA_PLAN)
    out = [
        "",
        f"## 1. A/A: k equally good variants, {n} runs each",
        "",
        f"3 seeds, the variants' (train.steps, eval_every) cycling {plan}, the production grace (looks at "
        f"steps {', '.join(map(str, rows[0]['look_steps']))}: L = {rows[0]['looks_planned']}). Every decision is "
        "false: (a) a look pruned a variant; (b) the final verdict over the variants left (every pair, Holm over "
        "the ordered pairs, 5%, training noise in the interval) declared a difference; (c) either. Rates with "
        "their Clopper-Pearson 95% interval.",
        "",
        "| k | (a) a look pruned | (b) final verdict declared | (c) either | fixed design's verdict declared "
        "| looks taken (mean) | device-steps vs fixed |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['k']} | {pct(r['a_looks'])} | {pct(r['b_final'])} | {pct(r['c_either'])} | "
            f"{pct(r['fixed_final'])} | {r['looks_taken']:.2f} | {r['device_steps_share']:.1%} |"
        )
    worst = {key: max(rows, key=lambda r: r[key]["rate"]) for key in ("a_looks", "b_final", "c_either")}
    either = sum(r["c_either"]["count"] for r in rows)
    both = sum(r["a_looks"]["count"] + r["b_final"]["count"] for r in rows) - either
    out += [
        "",
        f"At most: (a) {pct(worst['a_looks']['a_looks'])} (k = {worst['a_looks']['k']}), (b) "
        f"{pct(worst['b_final']['b_final'])} (k = {worst['b_final']['k']}), (c) {pct(worst['c_either']['c_either'])} "
        f"(k = {worst['c_either']['k']}). The looks and the final verdict each spend 5%; a run can be wrong at "
        f"either, so the combined bound is their sum, and (c) is what it measures here. Over every k, {both} of the "
        f"{either} runs wrong at either were wrong at both: the two errors rarely fall in the same run, so they "
        "add up (a variant a look pruned is not in the final verdict).",
    ]
    return out


def plan_lines(rows: list[dict], plans: dict[str, dict]) -> list[str]:
    """A/A k = 4 under other plans: which of the schedule's look steps the runs could take."""
    main = next(r for r in rows if r["k"] == 4)
    steps = list(main["looked_at"])
    out = [
        "",
        "### Other plans, k = 4: the looks the schedule plans and those taken",
        "",
        "The share of runs that looked at each planned step (L counts them all: each look spends 5% / L).",
        "",
        "| plan (train.steps, eval_every) per variant | L | "
        + " | ".join(f"step {s}" for s in steps)
        + " | (a) a look pruned | (b) final verdict declared | (c) either |",
        "|---|---:|" + "---:|" * len(steps) + "---:|---:|---:|",
    ]
    for name, r in {"section 1's": main, **plans}.items():
        plan = ", ".join(f"({s}, {e})" for s, e in r["plan"])
        looked = " | ".join(f"{r['looked_at'].get(s, 0):.0%}" for s in steps)
        out.append(
            f"| {name}: {plan} | {r['looks_planned']} | {looked} | {pct(r['a_looks'])} | {pct(r['b_final'])} | "
            f"{pct(r['c_either'])} |"
        )
    out += [
        "",
        "A look is taken at a step only when every replicate seen of a variant still in the contest has its row there "
        "(one that ended before excepted): a step that a variant still training does not evaluate at is looked at "
        "only once its replicates have ended, and a variant whose evaluations all come before the grace is in no "
        "look; L counts every planned step all the same.",
    ]
    return out


def contested_lines(cells: dict[str, list[dict]], n: int) -> list[str]:
    out = [
        "",
        f"## 2. Variants that differ: k = 4, every variant (100, 10), {n} runs per cell",
        "",
        "Crossing: v0, v1 learn fast and plateau 0.02 and 0.025 nats higher; v2, v3 (0.005 apart) learn slowly "
        "and cross them, v2 the true winner. Loser: v0-v2 equally good, v3 worse by d at every step. *True best "
        "pruned*: a look pruned the variant with the best true final mean; *fixed best pruned*: the variant the "
        "fixed design (every task to its end, the same draws) observes best; *pick*: the variant with the best "
        "observed final mean among those left is a true best (the fixed design's in brackets).",
        "",
        "| setting | grace | L | true best pruned | fixed best pruned | any pruned | loser pruned | an equal one "
        "pruned | pick true best (fixed) | device-steps vs fixed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rows in cells.items():
        for r in rows:
            loser = pct(r["loser_pruned"]) if "loser_pruned" in r else "-"
            equal = pct(r["equal_pruned"]) if "equal_pruned" in r else "-"
            out.append(
                f"| {name} | {r['grace']:g} | {r['looks_planned']} | {pct(r['pruned_true_best'])} | "
                f"{pct(r['pruned_fixed_best'])} | {r['any_pruned']['rate']:.0%} | {loser} | {equal} | "
                f"{r['pick_true_best']['rate']:.0%} ({r['fixed_pick_true_best']['rate']:.0%}) | "
                f"{r['device_steps_share']:.1%} |"
            )
    return out


def old_lines(old: dict, n: int, power_n: int) -> list[str]:
    out = [
        "",
        "## 3. The old model (every step drawn afresh) beside the persistent one",
        "",
        f"The same designs and driver: A/A k = 4 as in section 1 ({n} runs), and a loser worse by 0.02 at the "
        f"production grace as in section 2 ({power_n} runs).",
        "",
        "| model | A/A (a) looks | A/A (b) final | A/A (c) either | loser 0.02 pruned | an equal one pruned | "
        "device-steps vs fixed (loser 0.02) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model, r in old.items():
        a, lo = r["aa"], r["loser"]
        out.append(
            f"| {model} | {pct(a['a_looks'])} | {pct(a['b_final'])} | {pct(a['c_either'])} | "
            f"{pct(lo['loser_pruned'])} | {pct(lo['equal_pruned'])} | {lo['device_steps_share']:.1%} |"
        )
    return out


def measure(runs: int, power_runs: int, ks=AA_KS, graces=GRACES) -> dict:
    """Every section's figures (seeded: the same numbers every time)."""
    t0, cpu0 = time.time(), time.process_time()
    aa_rows = [aa(k, runs, 100 + k) for k in ks]
    plans = {name: aa(4, runs, 150 + i, plan=plan) for i, (name, plan) in enumerate(OTHER_PLANS.items())}
    t_aa = time.time() - t0
    cells: dict[str, list[dict]] = {}
    for tau in CROSSINGS:
        step = crossing_step(crossing_design(tau, 0.0))
        cells[f"crossing at step {step}"] = [contested(crossing_design(tau, g), power_runs, 200) for g in graces]
    for d in LOSERS:
        cells[f"loser {d:g}"] = [contested(loser_design(d, g), power_runs, 300, loser="v3") for g in graces]
    t_contested = time.time() - t0 - t_aa
    old = {
        label: {
            "aa": aa(4, runs, 400, noise),
            "loser": contested(loser_design(0.02, GRACE, noise), power_runs, 401, loser="v3"),
        }
        for label, noise in (("persistent (this file)", Noise()), ("fresh at every step (the old)", FRESH))
    }
    seconds = {
        "aa": t_aa,
        "contested": t_contested,
        "old": time.time() - t0 - t_aa - t_contested,
        "cpu": time.process_time() - cpu0,
    }
    return {"aa": aa_rows, "plans": plans, "contested": cells, "old_vs_persistent": old, "seconds": seconds}


def report(figures: dict, command: str, runs: int, power_runs: int) -> list[str]:
    took = figures["seconds"]
    return [
        "# prune=true and the final verdict on runs that behave as real ones (simulated)",
        "",
        *header(command),
        "",
        "The production pure functions decide (verdict/schedule.py Schedule; verdict/contest.py next_look, take, "
        "decision_for at each "
        "evaluation as it arrives; verdict/stats.compare and verdict/sentences.decide_rows at the end); "
        "benchmarks/verdict_sim.py's docstring has the designs.",
        "",
        *model_lines(Noise()),
        *aa_lines(figures["aa"], runs),
        *plan_lines(figures["aa"], figures["plans"]),
        *contested_lines(figures["contested"], power_runs),
        *old_lines(figures["old_vs_persistent"], runs, power_runs),
        "",
        f"Took {took['aa'] + took['contested'] + took['old']:.0f} s (A/A {took['aa']:.0f} s, section 2 "
        f"{took['contested']:.0f} s, section 3 {took['old']:.0f} s), {took['cpu']:.0f} s of CPU time (one process); "
        f"load average (1 min) {os.getloadavg()[0]:.1f} at the end.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2000, help="A/A runs per k (and for section 3)")
    parser.add_argument("--power-runs", type=int, default=500, help="runs per cell of section 2 (and section 3)")
    parser.add_argument("--out", type=Path, help="write here instead of benchmarks/results/ (any tree state)")
    parser.add_argument("--quick", action="store_true", help="a smoke run with few runs, printed only")
    args = parser.parse_args()
    runs, power_runs = (30, 10) if args.quick else (args.runs, args.power_runs)
    out = (args.out / RESULTS.name) if args.out else RESULTS
    if not args.quick:
        check(out)
    command = f"python benchmarks/verdict_sim.py --runs {runs} --power-runs {power_runs}"
    figures = measure(runs, power_runs)
    lines = report(figures, command + (" --quick" if args.quick else ""), runs, power_runs)
    if not args.quick:
        write(out, "\n".join(lines) + "\n", {"noise": asdict(Noise()), **figures})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
