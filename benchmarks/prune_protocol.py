"""prune=true under the protocol the tasks run: simulated tasks at their own paces drive the production code
(worker/prune.after_eval: the evaluation files, the run's decisions.jsonl and its lock, verdict/contest.py), and
on the very same arrivals and tables the rules it replaces or that users reach for instead.
Writes benchmarks/results/prune_protocol.md (and .json).

    python benchmarks/prune_protocol.py [--runs 2000] [--power-runs 500]    (needs optuna: pip install -e .[bench])

A run: 3 variants x 3 seeds (9 tasks), 4 in-training evaluations each (steps 10, 20, 30, 40 of 50). Each task
starts at a random time in [0, 1.5) evaluation periods and evaluates every 0.7-1.4 periods (its own pace), so
the tasks' evaluations interleave in every order. The eval tables are benchmarks/verdict_calibration.py's
model (lora_ab's noise sizes; 32 eval batches) as benchmarks/verdict_sim_model.py lets it persist: the same seeds on
the same eval batches at every evaluation, their effects fixed for the run or slowly varying, as a real run's are
(--fresh: each step drawn afresh, the model these figures used before; it hands every look fresh evidence).
A/A: the three variants are equally good; power: the third is worse by 0.01, 0.02 or 0.05 nats per token.

Rules, on the same arrivals and tables:
- **contest** (prune=true today): one decision per contest, looks recorded once for the run (production code);
- **per replicate** (prune=true before): each task, at each evaluation, decides on its own at the step with the
  most rows so far, at 5% / 4 with Holm (its own copy below, as verdict/pruning.py had it);
- **ASHA** (Ray Tune's ASHAScheduler defaults: reduction factor 4, grace period 1, its rule as
  ray.tune.schedulers.async_hyperband's _Bracket has it): at rungs 1 and 4 (evaluations), a task stops when its
  loss is above the 25th percentile (1/4) of the losses other tasks recorded at that rung before it; then its own
  is recorded. The first task at a rung always goes on. It controls no error: it is shown for its false-prune
  rate;
- **optuna Wilcoxon** (optuna.pruners.WilcoxonPruner through optuna itself, its defaults: p_threshold 0.1,
  n_startup_steps 2): one in-memory study per run (direction minimize), one trial per task, asked at the task's
  first evaluation; events in arrival order, so the trials run concurrently as with optuna's ask/tell interface.
  Each evaluation reports the task's per-token loss on each eval batch as an intermediate value, at step
  eval_index * 1000 + batch, then asks should_prune(); a pruned trial is told PRUNED and its task stops, a task
  that finishes its evaluations is told its last evaluation's mean loss. The mapping is the one optuna's docs
  give this pruner: a "step" is a problem instance (here one eval batch at one evaluation, the same id in every
  trial so the pruner pairs them), and the pruner tests the running trial's values against the best completed
  trial's on the instances both have (one-sided signed-rank test). Nothing is pruned before a first task
  completes. It treats the paired batches as independent and the best trial as fixed, so a seed's training noise
  (a shift over all batches) reads as a difference, and it corrects for neither looks nor trials (its docs say a
  Pocock-corrected threshold gives the nominal rate over looks; the defaults are what a user gets): it controls
  no error and is shown, like ASHA, for its false-prune rate;
- **fixed**: every task to the end (never prunes).
Device-steps: the training steps the tasks ran (a task stops at the evaluation that pruned it; under the contest
its variant's other replicates stop at the step they are in then, as the workers do), beside the
fixed design's 9 x 50. benchmarks/prune_replay.py runs the same rule functions (a Design instead of the constants
below) on real runs' recorded curves.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from scipy import stats as sps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import check, header, write  # noqa: E402
from verdict_calibration import simulate  # noqa: E402
from verdict_sim_model import step_tables  # noqa: E402

from slurm_router.rundir.layout import RESULT_FILE  # noqa: E402
from slurm_router.verdict import AUTO_FIRST, GRACE  # noqa: E402
from slurm_router.verdict.contest import Schedule, decided_stop  # noqa: E402
from slurm_router.verdict.pruning import decide, mean_loss  # noqa: E402
from slurm_router.worker import prune  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "prune_protocol.md"
VARIANTS = ("v0", "v1", "v2")
SEEDS = 3
EVAL_STEPS = (10, 20, 30, 40)
STEPS = 50
LEVEL = 0.05


@dataclass(frozen=True)
class Design:
    """What the rules need to know of a run: its variants, its replicates per variant (seeds 0..seeds-1), the
    steps of its in-training evaluations, its training steps, and the step whose table names the winner (the last
    in-training evaluation unless a final one is recorded: prune_replay.py's real tasks evaluate at `steps`)."""

    variants: tuple[str, ...] = VARIANTS
    seeds: int = SEEDS
    eval_steps: tuple[int, ...] = EVAL_STEPS
    steps: int = STEPS
    final: int | None = None
    grace: float = GRACE  # the production default (verdict/contest.py Schedule): looks from half of training on

    @property
    def final_step(self) -> int:
        return self.eval_steps[-1] if self.final is None else self.final

    @property
    def fixed_steps(self) -> int:
        """The fixed design's device-steps: every replicate of every variant to the end."""
        return len(self.variants) * self.seeds * self.steps


PROTOCOL = Design()  # the simulated runs below


def arrivals(rng: np.random.Generator) -> list[tuple[float, str, int, int]]:
    """(time, variant, seed, step) of every evaluation, in time order."""
    out = []
    for v in VARIANTS:
        for s in range(SEEDS):
            start, period = rng.uniform(0, 1.5), rng.uniform(0.7, 1.4)
            out += [(start + period * (i + 1), v, s, step) for i, step in enumerate(EVAL_STEPS)]
    return sorted(out)


def tables(
    rng: np.random.Generator, effects: tuple[float, ...], design: Design = PROTOCOL, persistent: bool = True
) -> dict[int, dict[str, dict[int, dict]]]:
    """{step: {variant: {seed: {loss_sums, tokens}}}}. persistent (the default): benchmarks/verdict_sim_model.py's
    model, as a real run evaluates (the same seeds on the same eval batches at every step, so their effects persist
    over steps); False: the design's seeds drawn afresh at each evaluation step (the model these figures used before:
    it hands every look fresh evidence)."""
    if persistent:
        return step_tables(rng, effects, design.variants, design.seeds, design.eval_steps, design.steps)
    out = {}
    for step in design.eval_steps:
        sides = simulate(rng, design.seeds, effects=effects)
        out[step] = {
            v: {
                s: {"loss_sums": [float(x) for x in r["loss_sums"]], "tokens": [int(t) for t in r["tokens"]]}
                for s, r in side.items()
            }
            for v, side in zip(design.variants, sides)
        }
    return out


def contest_rule(
    run: Path, events, tabs, design: Design = PROTOCOL, config: dict | None = None
) -> tuple[set[str], dict[tuple[str, int], int]]:
    """The production code: worker/prune.after_eval for each evaluation as it arrives; a pruned task stops and
    writes its result (as the worker does); a task that reaches its last step ends the same way. A look that prunes
    a variant stops its other replicates where they are then (the worker checks the run's looks after every step:
    worker/prune.py LookWatch): at the step they are in, `step_at` on their own pace; one not started yet at 0.
    Under seeds=auto a look that decides the contest stops the winner's running reserves the same way
    (verdict/contest.py decided_stop, as worker/auto_seeds.py decided_reserve asks it). A
    table row's `sources` (eval batches' files: the verdict's clusters), when recorded, go in as the worker passes
    them. config: the tasks' config, as task.json holds it (seeds=auto's contest: auto_seeds.py)."""
    stopped: dict[tuple[str, int], int] = {}
    paces = replicate_paces(events)
    auto = (config or {}).get("seeds") == "auto"
    pruned_so_far = {x for line in prune.read_looks(run) for x in line["pruned"]}  # an earlier round's too

    def end(v: str, s: int, at: int) -> None:
        stopped[v, s] = at
        (run / "tasks" / f"{v}-s{s}").mkdir(parents=True, exist_ok=True)
        (run / "tasks" / f"{v}-s{s}" / RESULT_FILE).write_text("{}")

    for t, v, s, step in events:
        if (v, s) in stopped:
            continue
        name = f"{v}-s{s}"
        spec = SimpleNamespace(task_dir=run / "tasks" / name, run_dir=run, variant=v, seed=s, name=name, config=config)
        spec.task_dir.mkdir(parents=True, exist_ok=True)
        row = tabs[step][v][s]
        schedule = Schedule(tuple(design.eval_steps), design.steps, grace=design.grace)
        if prune.after_eval(spec, step, row["loss_sums"], row["tokens"], schedule, row.get("sources")) is not None:
            end(v, s, step)
        elif step == design.eval_steps[-1]:
            end(v, s, design.steps)
        looks = prune.read_looks(run)
        newly = {x for line in looks for x in line["pruned"]} - pruned_so_far
        pruned_so_far |= newly
        if not newly:
            continue
        for rv, rs in paces:
            if (rv, rs) in stopped:
                continue
            if rv in newly or (auto and rs >= AUTO_FIRST and decided_stop(rv, rs, set(design.variants), looks)):
                end(rv, rs, step_at(paces[rv, rs], t, design.steps))  # a decided contest's running reserve too
    return pruned_so_far, stopped


def replicate_paces(events) -> dict[tuple[str, int], list[tuple[float, int]]]:
    """{(variant, seed): [(time, step), ...]}: each replicate's evaluations in time order."""
    out: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for t, v, s, step in events:
        out.setdefault((v, s), []).append((t, step))
    return out


def step_at(evals: list[tuple[float, int]], t: float, steps: int) -> int:
    """The steps a replicate with these evaluations has trained when it learns, at time t, that its variant was
    pruned: the step it is in, finished (linear between its evaluations; from its start, one period before its
    first, and on at its last pace after its last), at most `steps`; 0 when it has not started."""
    points = sorted(evals)
    if len(points) == 1:
        return min(steps, points[0][1])
    (t0, s0), (t1, s1) = points[0], points[1]
    start = t0 - (t1 - t0) * s0 / max(1, s1 - s0)
    points = [(start, 0), *points]
    if t <= start:
        return 0
    for (ta, sa), (tb, sb) in zip(points, points[1:]):
        if t <= tb:
            return min(steps, int(sa + (sb - sa) * (t - ta) / max(tb - ta, 1e-12)) + 1)
    (ta, sa), (tb, sb) = points[-2], points[-1]
    return min(steps, int(sb + (sb - sa) * (t - tb) / max(tb - ta, 1e-12)) + 1)


def per_replicate_rule(events, tabs, design: Design = PROTOCOL) -> tuple[set[str], dict[tuple[str, int], int]]:
    """prune=true before: each task decides on its own view at each evaluation (the step with the most rows)."""
    seen: dict[int, dict[str, dict[int, dict]]] = {}
    stopped: dict[tuple[str, int], int] = {}
    pruned = set()
    for _, v, s, step in events:
        if (v, s) in stopped:
            continue
        seen.setdefault(step, {}).setdefault(v, {})[s] = tabs[step][v][s]
        ready = [k for k, g in seen.items() if k <= step and v in g and len(g) >= 2]
        at = max(ready, key=lambda k: (sum(len(x) for x in seen[k].values()), k)) if ready else None
        if at is not None and decide(seen[at], v, step, len(design.eval_steps)) is not None:
            stopped[v, s] = step
            pruned.add(v)
    return pruned, stopped


def asha_rule(
    events, tabs, design: Design = PROTOCOL, eta: int = 4, grace: int = 1
) -> tuple[set[str], dict[tuple[str, int], int]]:
    """ASHA's stopping rule over the tasks (one trial each), as Ray Tune's _Bracket.on_result: at a rung
    evaluation (grace * eta**k, counted in evaluations: 1 and 4 of 4), a task stops when its loss is above the
    (100 / eta)th percentile of the losses recorded there before it (Ray: its reward below the (1 - 1/eta)
    percentile of the rewards), and its loss is recorded either way."""
    n_evals = len(design.eval_steps)
    rungs = [grace * eta**k for k in range(n_evals) if grace * eta**k <= n_evals]
    at_rung: dict[int, list[float]] = {r: [] for r in rungs}
    stopped: dict[tuple[str, int], int] = {}
    pruned = set()
    for _, v, s, step in events:
        if (v, s) in stopped:
            continue
        k = design.eval_steps.index(step) + 1
        if k not in at_rung:
            continue
        row = tabs[step][v][s]
        loss = sum(row["loss_sums"]) / sum(row["tokens"])
        if at_rung[k] and loss > np.percentile(at_rung[k], 100 / eta):
            stopped[v, s] = step
            pruned.add(v)
        at_rung[k].append(loss)
    return pruned, stopped


def optuna_wilcoxon_rule(events, tabs, design: Design = PROTOCOL) -> tuple[set[str], dict[tuple[str, int], int]]:
    """optuna's WilcoxonPruner (defaults) over the tasks, one trial each, driven by ask/tell in arrival order."""
    import warnings

    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        pruner = optuna.pruners.WilcoxonPruner()
    study = optuna.create_study(direction="minimize", pruner=pruner)
    trials: dict[tuple[str, int], optuna.Trial] = {}
    stopped: dict[tuple[str, int], int] = {}
    pruned = set()
    for _, v, s, step in events:
        if (v, s) in stopped:
            continue
        trial = trials.setdefault((v, s), study.ask())
        row, k = tabs[step][v][s], design.eval_steps.index(step)
        for b, (loss_sum, tokens) in enumerate(zip(row["loss_sums"], row["tokens"])):
            trial.report(loss_sum / tokens, k * 1000 + b)
        if trial.should_prune():
            study.tell(trial, state=TrialState.PRUNED)
            stopped[v, s] = step
            pruned.add(v)
        elif step == design.eval_steps[-1]:
            study.tell(trial, sum(row["loss_sums"]) / sum(row["tokens"]))
    return pruned, stopped


def device_steps(stopped: dict[tuple[str, int], int], design: Design = PROTOCOL) -> int:
    return sum(stopped.get((v, s), design.steps) for v in design.variants for s in range(design.seeds))


def winner_ok(tabs, stopped, loser: str | None, design: Design = PROTOCOL) -> bool:
    """The variant with the lowest mean final loss among the tasks that ran to the end is not the loser."""
    last, end = tabs[design.final_step], design.steps
    alive = {
        v: {s: last[v][s] for s in range(design.seeds) if stopped.get((v, s), end) == end} for v in design.variants
    }
    alive = {v: side for v, side in alive.items() if side}
    return bool(alive) and min(alive, key=lambda v: mean_loss(alive[v])) != loser


RULES = ("contest", "per replicate", "ASHA", "optuna Wilcoxon", "fixed")


def run_rules(run: Path, events, tabs, design: Design = PROTOCOL, rules=RULES) -> dict[str, tuple[set[str], dict]]:
    """{rule: (variants pruned, {(variant, seed): step it stopped at})} of the rules named on one run's events
    (time, variant, seed, step) and tables {step: {variant: {seed: row}}}; `run` is the contest's run directory
    (made here, removed by the caller)."""
    rule = {
        "contest": lambda: contest_rule(run, events, tabs, design),
        "per replicate": lambda: per_replicate_rule(events, tabs, design),
        "ASHA": lambda: asha_rule(events, tabs, design),
        "optuna Wilcoxon": lambda: optuna_wilcoxon_rule(events, tabs, design),
        "fixed": lambda: (set(), {}),
    }
    return {r: rule[r]() for r in rules}


def tally(counts: dict[str, dict], got: dict[str, tuple[set[str], dict]], tabs, loser, design: Design) -> None:
    """Add one run's outcomes to counts[rule]: a false prune (any variant but the loser pruned), the loser pruned,
    the winner not the loser, device-steps."""
    for rule, (pruned, stopped) in got.items():
        c = counts.setdefault(rule, {"false": 0, "caught": 0, "winner": 0, "device_steps": 0})
        c["false"] += bool(pruned - {loser})
        c["caught"] += loser in pruned
        c["winner"] += winner_ok(tabs, stopped, loser, design)
        c["device_steps"] += device_steps(stopped, design)


def figures(counts: dict[str, dict], n_runs: int, design: Design) -> dict[str, dict]:
    """Rates of tally's counts over n_runs: the false-prune rate with its Clopper-Pearson 95% interval."""
    return {
        r: {
            "false_rate": c["false"] / n_runs,
            "false_ci": clopper_pearson(c["false"], n_runs),
            "caught_rate": c["caught"] / n_runs,
            "winner_rate": c["winner"] / n_runs,
            "device_steps_share": c["device_steps"] / (n_runs * design.fixed_steps),
        }
        for r, c in counts.items()
    }


def one_setting(
    n_runs: int, effect: float, seed: int, work: Path, rules=RULES, persistent: bool = True
) -> dict[str, dict]:
    """The rules named (all by default) on the same n_runs arrivals and tables; the draws do not depend on which
    rules run, so a rule's figures are the same alone or beside the others."""
    rng = np.random.default_rng(seed)
    effects = (0.0, 0.0, effect)
    loser = VARIANTS[2] if effect > 0 else None
    counts: dict[str, dict] = {r: {"false": 0, "caught": 0, "winner": 0, "device_steps": 0} for r in rules}
    for i in range(n_runs):
        events, tabs = arrivals(rng), tables(rng, effects, persistent=persistent)
        run = work / f"{seed}-{i}"
        got = run_rules(run, events, tabs, PROTOCOL, rules)
        shutil.rmtree(run, ignore_errors=True)
        tally(counts, got, tabs, loser, PROTOCOL)
    return figures(counts, n_runs, PROTOCOL)


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    a = (1 - level) / 2
    lo = 0.0 if k == 0 else float(sps.beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(sps.beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


def require_optuna() -> None:
    """optuna's WilcoxonPruner is one of the rules: no results file without it (exit 2, what to install)."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        print("optuna is needed for its WilcoxonPruner rule: pip install -e .[bench]")
        sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2000, help="A/A runs")
    parser.add_argument("--power-runs", type=int, default=500, help="runs per loser effect")
    parser.add_argument("--fresh", action="store_true", help="the old model: each step's tables drawn afresh")
    parser.add_argument("--out", type=Path, help="write here instead of benchmarks/results/ (any tree state)")
    args = parser.parse_args()
    require_optuna()
    out = args.out / RESULTS.name if args.out else RESULTS
    if not args.out:
        check(RESULTS)
    command = f"python benchmarks/prune_protocol.py --runs {args.runs} --power-runs {args.power_runs}"
    command += " --fresh" if args.fresh else ""
    keep = not args.fresh
    t0 = time.time()
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        settings = {0.0: one_setting(args.runs, 0.0, 1, Path(tmp), persistent=keep)}
        for i, effect in enumerate((0.01, 0.02, 0.05)):
            settings[effect] = one_setting(args.power_runs, effect, 2 + i, Path(tmp), persistent=keep)
    aa = settings[0.0]
    lines = [
        "# prune=true under the real protocol (simulated tasks at their own paces)",
        "",
        *header(command),
        "",
        f"3 variants x {SEEDS} seeds, {len(EVAL_STEPS)} evaluations of {STEPS} steps, tasks arriving at their own "
        "paces; the rules and the model are in the script's docstring. 'contest' is the production code. Eval "
        + (
            "tables drawn afresh at each step (the old model)."
            if args.fresh
            else "effects persist over steps "
            "(benchmarks/verdict_sim_model.py: the same seeds and eval batches at every evaluation)."
        ),
        "",
        f"## A/A: three equally good variants, {args.runs} runs (any variant pruned is a false decision)",
        "",
        "| rule | runs with a false prune | 95% interval | device-steps vs fixed |",
        "|---|---:|---|---:|",
    ]
    for r in RULES:
        x = aa[r]
        lo, hi = x["false_ci"]
        lines.append(f"| {r} | {x['false_rate']:.1%} | {lo:.1%}-{hi:.1%} | {x['device_steps_share']:.0%} |")
    lines += [
        "",
        f"## A loser: the third variant worse by d nats per token, {args.power_runs} runs each",
        "",
        "| d | rule | loser pruned | an equal one pruned | winner not the loser | device-steps vs fixed |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for effect in (0.01, 0.02, 0.05):
        for r in RULES:
            x = settings[effect][r]
            lines.append(
                f"| {effect} | {r} | {x['caught_rate']:.0%} | {x['false_rate']:.1%} | {x['winner_rate']:.0%} | "
                f"{x['device_steps_share']:.0%} |"
            )
    c = aa["contest"]
    lines += [
        "",
        f"The contest rule pruned an equally good variant in {c['false_rate']:.1%} of {args.runs} A/A runs (95% "
        f"interval {c['false_ci'][0]:.1%}-{c['false_ci'][1]:.1%}); the level is 5%.",
        "",
        f"Took {time.time() - t0:.0f} s.",
    ]
    write(out, "\n".join(lines) + "\n", {"settings": {str(k): v for k, v in settings.items()}})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
