"""prune=true's protocol, pure: when the run looks, what each look spends, and what a replicate learns from the
looks so far (docs/design/pruning.md, "One decision per contest"). worker/prune.py holds the run's looks in
RUN_DIR/decisions.jsonl and calls these under one lock; benchmarks/prune_protocol.py drives the same calls with
simulated tasks arriving at their own pace.

A look is taken at an evaluation step when every replicate seen so far (a task with any evaluation recorded) of a
variant still in the contest has its row there, a replicate that ended before the step excepted, and at least two
such variants have two seeds there (training noise must be in the interval). Looks go forward: a look is at a later
step than the run's last one, the latest such step when several are ready. So a run takes at most L looks, L being
the evaluations a task makes, whichever task arrives when, however many replicates each variant has, requeues and
fused groups included: which rows a look holds depends on the order tasks arrive, never on their losses.

A look is taken only at the run's look steps (verdict/schedule.py Schedule: fixed by the plan, from half of
training on). At each look the one judgement (verdict/judge.py: Holm over every ordered pair) runs over the variants
left, on the primary metric, and a variant some other one is decided better than is pruned, at the look's share of
the level: (1 - LEVEL) / L at each of the first L looks, nothing after. Holm bounds the chance of pruning any
variant as good as the best at one look by that share, for any number of variants; the shares sum to 5% over
the looks, so by the union bound the chance of ever pruning one is at most 5% however the replicates arrive
(Bonferroni spending over looks: a group-sequential rule with a flat spending function). A look is recorded
once for the run; every replicate of a pruned variant stops after the step it is in (worker/prune.py LookWatch)
with that look's reason, and no later look sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_router.verdict import AUTO_FIRST, LEVEL
from slurm_router.verdict.pruning import Decision, equivalent, look_at, reason
from slurm_router.verdict.schedule import Schedule  # noqa: F401  (the run's looks: callers name it here)

Tables = dict[int, dict[str, dict[int, dict]]]  # {step: {variant: {seed: row}}}, worker/prune.py read_steps


@dataclass(frozen=True)
class Auto:
    """seeds=auto's contest (docs/design/pruning.md, "seeds=auto"): replicates come in rounds, the first with
    AUTO_FIRST seeds per variant, each later one adding a seed to every variant still in the contest, up to `cap`.
    A look is then keyed by (depth, step), depth being the fewest seeds a compared variant has there, and taken
    when that key is past the last look's: at most L looks per depth. Half the level goes to depth 2's looks, the
    other half in equal parts to depths 3..cap: L looks at each depth, so the shares still sum to 1 - LEVEL.
    min_effect (auto_seeds.min_effect): a look whose variants left are all within it of the best settles the
    contest (verdict/pruning.equivalent), and no reserve runs after it."""

    cap: int
    min_effect: float | None = None
    first_round: tuple[tuple[str, int], ...] = ()  # (variant, seed) of the AUTO_FIRST replicates a look waits for

    def spending(self, depth: int, n_looks: int) -> str:
        """How a look at `depth` seeds got its level, in words: 'half of 5% / 2 looks at 2 seeds'."""
        if depth <= AUTO_FIRST or self.cap == AUTO_FIRST + 1:
            return f"half of 5% / {n_looks} looks at {min(depth, self.cap)} seeds"
        return f"half of 5% / {self.cap - AUTO_FIRST} depths (3-{self.cap} seeds) / {n_looks} looks"


def spend(look: int, n_looks: int, level: float = LEVEL, depth: int = 0, auto: Auto | None = None) -> float:
    """The level the run's `look`-th look may use: an equal share of 1 - level for each of the L planned looks;
    with seeds=auto, the share of the look's depth (Auto)."""
    if auto is not None:
        if depth <= AUTO_FIRST:
            return (1 - level) / 2 / n_looks
        return (1 - level) / 2 / max(1, auto.cap - AUTO_FIRST) / n_looks if depth <= auto.cap else 0.0
    return (1 - level) / n_looks if 1 <= look <= n_looks else 0.0


def depth_at(here: dict[str, dict[int, dict]], variants: set[str] | list[str]) -> int:
    """The fewest seeds any of `variants` with 2 or more seeds has at a step (0: none)."""
    counts = [len(here.get(v, {})) for v in variants if len(here.get(v, {})) >= AUTO_FIRST]
    return min(counts, default=0)


def pruned_in(looks: list[dict]) -> set[str]:
    return {v for line in looks for v in line["pruned"]}


def settled_by(looks: list[dict]) -> dict | None:
    """The look that settled seeds=auto's contest (its variants left all within auto_seeds.min_effect), if any."""
    return next((line for line in looks if line.get("equivalent")), None)


def settled_words(line: dict) -> str:
    """'r8 and r32 are within auto_seeds.min_effect=0.02 of each other at look 3 (step 20, 3 seeds): r8 - r32 =
    0.004 (90% CI -0.011 to 0.018)'."""
    pairs = line["equivalent"]
    best = next(iter(pairs.values()))["best"]
    names = sorted([best, *pairs])
    diffs = "; ".join(
        f"{v} - {c['best']} = {c['diff']:.3g} ({100 * c['confidence']:.3g}% CI {c['ci_low']:.3g} to {c['ci_high']:.3g})"
        for v, c in sorted(pairs.items())
    )
    return (
        f"{', '.join(names[:-1])} and {names[-1]} are within auto_seeds.min_effect={line['min_effect']:g} of "
        f"{'each other' if len(names) == 2 else best} at look {line['look']} (step {line['step']}, "
        f"{line.get('depth', 0)} seeds): {diffs}"
    )


def next_look(
    tables: Tables,
    ended: dict[tuple[str, int], int],
    looks: list[dict],
    auto: Auto | None = None,
    schedule: Schedule | None = None,
) -> int | None:
    """The step the run looks at now, or None. ended: {(variant, seed): last step recorded} of replicates that
    ended (its result written, or it failed): one is waited for only at steps it reached. schedule: the run's
    (Schedule): only its look steps are looked at (None: any step, as a table alone). auto: seeds=auto, where a
    step is looked at again once a later round has added seeds there, and every variant's first round
    (Auto.first_round) is waited for, seen yet or not."""
    out = set(pruned_in(looks))
    after = max((line["step"] for line in looks), default=-1)
    last = max(((line.get("depth", 0), line["step"]) for line in looks), default=(0, -1))
    seen: dict[str, set[int]] = {}
    for step_rows in tables.values():
        for variant, side in step_rows.items():
            if variant not in out:
                seen.setdefault(variant, set()).update(side)
    ready = []
    planned = [(v, s) for v, s in auto.first_round if v not in out] if auto is not None else []
    allowed = set(schedule.look_steps) if schedule is not None else set(tables)
    for step in sorted(s for s in tables if (auto is not None or s > after) and s in allowed):
        here = tables[step]
        due = {(v, s) for v, seeds in seen.items() for s in seeds} | set(planned)
        due = {(v, s) for v, s in due if not ((v, s) in ended and ended[v, s] < step)}
        if not all(v in here and s in here[v] for v, s in due):
            continue
        if sum(1 for v in seen if len(here.get(v, {})) >= 2) < 2:
            continue
        if auto is None or (depth_at(here, list(seen)), step) > last:
            ready.append(step)
    if auto is not None and ready:  # the deepest, then latest, step: the most rows a look can hold
        return max(ready, key=lambda s: (depth_at(tables[s], list(seen)), s))
    return ready[-1] if ready else None


def take(
    tables: Tables, step: int, looks: list[dict], n_looks: int, metric: str = "loss", auto: Auto | None = None
) -> dict:
    """The run's next look, at `step`: one line of decisions.jsonl (what was compared, at which level, who is
    pruned)."""
    out = pruned_in(looks)
    groups = {v: side for v, side in tables[step].items() if v not in out}
    number = len(looks) + 1
    depth = depth_at(groups, list(groups))
    threshold = spend(number, n_looks, depth=depth, auto=auto)
    decisions = look_at(groups, step, threshold, n_looks, metric=metric) if threshold > 0 else {}
    for v, d in decisions.items():
        d.look = number
        if auto is not None:
            d.spending = auto.spending(depth, n_looks)
        d.reason = reason(v, d)
    left = {v: side for v, side in groups.items() if v not in decisions}
    margin = auto.min_effect if auto is not None else None
    settled = equivalent(left, threshold, margin) if margin else None
    return {
        "look": number,
        "step": step,
        "threshold": threshold,
        "looks": n_looks,
        **({"depth": depth, "cap": auto.cap} if auto is not None else {}),
        **({"min_effect": margin, "equivalent": settled} if settled else {}),
        "metric": metric,
        "rows": {v: sorted(side) for v, side in sorted(groups.items())},
        "pruned": sorted(decisions),
        "decisions": {v: d.as_dict() for v, d in sorted(decisions.items())},
    }


def decision_for(looks: list[dict], variant: str, step: int, task: str | None = None) -> Decision | None:
    """What the run decided about `variant` so far, as its replicate `task` stopping at `step` says it."""
    for line in looks:
        if variant in line["pruned"]:
            d = Decision.from_dict({**line["decisions"][variant], "step": step, "compared_step": line["step"]})
            d.look = line["look"]
            d.reason = reason(task if task and task != variant else variant, d)
            return d
    return None


def looks_line(looks: list[dict]) -> str | None:
    """The report's one line on the run's looks: 'prune=true looked 2 times (steps 10, 20), each at 1.25% = 5% /
    4 looks: r8 pruned at look 1 (step 10)'."""
    if not looks:
        return None
    steps = ", ".join(str(line["step"]) for line in looks)
    last = looks[-1]
    out = [f"{v} pruned at look {line['look']} (step {line['step']})" for line in looks for v in line["pruned"]]
    if "depth" in last:  # seeds=auto: the level depends on the look's depth
        steps = ", ".join(f"{line['step']} ({line['depth']} seeds)" for line in looks)
        spending = f"at {last['looks']} looks per depth, half of 5% at 2 seeds and half over 3-{last['cap']} seeds"
    else:
        spending = f"each at {last['threshold']:.3g} = 5% / {last['looks']} looks"
    return (
        f"prune=true looked {len(looks)} time{'s' if len(looks) != 1 else ''} (step{'s' if len(looks) != 1 else ''} "
        f"{steps}), {spending}: " + ("; ".join(out) if out else "no variant pruned")
    )


@dataclass(frozen=True)
class Replicate:
    """A task of the contest, as a seeds=auto reserve sees it: its variant, its place among that variant's seeds
    (0-based), and whether it has ended (its result written, or failed)."""

    variant: str
    index: int
    ended: bool
    diverged: bool = False  # it ended with a non-finite loss


RUN, WAIT, SKIP = "run", "wait", "skip"


def diverged_out(replicates: list[Replicate]) -> set[str]:
    """The variants out of the contest because they diverged: every first-round replicate has ended and every
    replicate that ended diverged. Such a variant is never the best (its numbers never reach a test), and none of
    its reserves runs."""
    by_variant: dict[str, list[Replicate]] = {}
    for r in replicates:
        by_variant.setdefault(r.variant, []).append(r)
    return {
        v
        for v, reps in by_variant.items()
        if all(r.ended for r in reps if r.index < AUTO_FIRST)
        and all(r.diverged for r in reps if r.ended)
        and any(r.ended for r in reps)
    }


def reserve_call(
    variant: str,
    index: int,
    replicates: list[Replicate],
    looks: list[dict],
    spent_device_hours: float = 0.0,
    budget_device_hours: float | None = None,
) -> tuple[str, str | None]:
    """What seeds=auto's reserve replicate `index` of `variant` does now: (RUN, None) once every replicate before
    it (a lower index) of each variant still in the contest has ended undecided; (SKIP, why) when its variant was
    pruned, when the contest is decided (one variant left), or when the budget is spent; else (WAIT, None)."""
    gone = diverged_out(replicates)
    out = pruned_in(looks) | gone
    nth = f"{variant}'s replicate {index + 1}"
    if variant in gone:
        return SKIP, f"{nth} not run: every replicate of {variant} so far diverged (a non-finite loss)"
    if variant in out:
        line = next(line for line in looks if variant in line["pruned"])
        return SKIP, f"{nth} not run: {variant} was pruned at look {line['look']} (step {line['step']})"
    alive = sorted({r.variant for r in replicates} - out)
    if len(alive) <= 1:
        return SKIP, f"{nth} not run: the contest is decided, {variant} is the only variant left"
    settled = settled_by(looks)
    if settled is not None:
        return SKIP, f"{nth} not run: the contest is settled: {settled_words(settled)}"
    if budget_device_hours is not None and spent_device_hours >= budget_device_hours:
        return SKIP, (
            f"{nth} not run: auto_seeds.budget_device_hours={budget_device_hours:g} is spent "
            f"({spent_device_hours:.3g} device-hours so far); {', '.join(alive)} undecided"
        )
    if all(r.ended for r in replicates if r.variant in alive and r.index < index):
        return RUN, None
    return WAIT, None


def decided_stop(variant: str, index: int, variants: set[str], looks: list[dict]) -> str | None:
    """Why seeds=auto's running reserve replicate `index` (0-based) of `variant` stops now: the contest is decided
    and `variant` is the one left, so the replicate, which ran only to decide, has nothing left to decide. None
    otherwise (a pruned variant's replicates stop as pruned; an open or settled contest's run on)."""
    if set(variants) - pruned_in(looks) != {variant}:
        return None
    line = max((line for line in looks if line["pruned"]), key=lambda line: line["look"])
    return (
        f"{variant}'s replicate {index + 1} not needed: the contest was decided at look {line['look']} (step "
        f"{line['step']}), {variant} is the only variant left"
    )


def auto_line(
    looks: list[dict],
    ran: dict[str, int],
    not_run: list[str],
    cap: int,
    stopped: list[str] | None = None,
    diverged: set[str] | frozenset[str] = frozenset(),
) -> str:
    """The report's one line on seeds=auto: how many replicates each variant ran, and what stopped adding them
    (the contest decided, the budget spent, or the cap reached undecided); `stopped`: the reserves that were
    running when the contest was decided and stopped then (decided_stop); `diverged`: the variants out because
    every replicate diverged (diverged_out)."""
    out = pruned_in(looks) | set(diverged)
    alive = [v for v in ran if v not in out]
    seeds = ", ".join(f"{v} {n}" for v, n in ran.items())
    skipped = f"; {len(not_run)} reserve replicate{'s' if len(not_run) != 1 else ''} not run" if not_run else ""
    if stopped:
        skipped += f"; {len(stopped)} stopped once decided"
    settled = settled_by(looks)
    if len(alive) <= 1:
        why = f"the contest is decided: {alive[0]} is left" if alive else "the contest is decided"
        why += f" ({', '.join(sorted(diverged))} diverged: every replicate)" if diverged else ""
    elif settled is not None:
        why = f"the contest is settled: {settled_words(settled)}"
    elif any("budget_device_hours" in r for r in not_run):
        why = f"auto_seeds.budget_device_hours was spent with {', '.join(alive)} undecided"
    elif all(ran[v] >= cap for v in alive):
        why = f"{', '.join(alive)} reached auto_seeds.max={cap} seeds undecided"
    else:
        why = f"{', '.join(alive)} undecided so far"
    return f"seeds=auto (at most {cap} per variant): replicates run {seeds}; {why}{skipped}"
