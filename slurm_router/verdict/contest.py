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

At each look every variant but the best (the lowest mean on the primary metric) is compared with the best by the
verdict's interval over seeds and eval batches (verdict/stats.compare), p-values Holm-adjusted over those compared,
and pruned when worse by more than the negligible with an adjusted p below the look's share of the level:
(1 - LEVEL) / L at each of the first L looks, nothing after. Holm bounds the chance of pruning any equally good
variant at one look by that share; the shares sum to 5% over the looks, so by the union bound the chance of ever
pruning one is at most 5% however the replicates arrive (Bonferroni spending over looks: a group-sequential rule
with a flat spending function). A look is recorded once for the run; every replicate of a pruned variant stops at
its next evaluation with that look's reason, and no later look sees it.
"""

from __future__ import annotations

from slurm_router.verdict import LEVEL
from slurm_router.verdict.pruning import Decision, look_at, reason

Tables = dict[int, dict[str, dict[int, dict]]]  # {step: {variant: {seed: row}}}, worker/prune.py read_steps


def spend(look: int, n_looks: int, level: float = LEVEL) -> float:
    """The level the run's `look`-th look may use: an equal share of 1 - level for each of the L planned looks."""
    return (1 - level) / n_looks if 1 <= look <= n_looks else 0.0


def pruned_in(looks: list[dict]) -> set[str]:
    return {v for line in looks for v in line["pruned"]}


def next_look(tables: Tables, ended: dict[tuple[str, int], int], looks: list[dict]) -> int | None:
    """The step the run looks at now, or None. ended: {(variant, seed): last step recorded} of replicates that
    finished (their result is written): one is waited for only at steps it reached."""
    out = set(pruned_in(looks))
    after = max((line["step"] for line in looks), default=-1)
    seen: dict[str, set[int]] = {}
    for step_rows in tables.values():
        for variant, side in step_rows.items():
            if variant not in out:
                seen.setdefault(variant, set()).update(side)
    ready = []
    for step in sorted(s for s in tables if s > after):
        here = tables[step]
        due = [(v, s) for v, seeds in seen.items() for s in seeds if not ((v, s) in ended and ended[v, s] < step)]
        if not all(v in here and s in here[v] for v, s in due):
            continue
        if sum(1 for v in seen if len(here.get(v, {})) >= 2) >= 2:
            ready.append(step)
    return ready[-1] if ready else None


def take(tables: Tables, step: int, looks: list[dict], n_looks: int, metric: str = "loss") -> dict:
    """The run's next look, at `step`: one line of decisions.jsonl (what was compared, at which level, who is
    pruned)."""
    out = pruned_in(looks)
    groups = {v: side for v, side in tables[step].items() if v not in out}
    number = len(looks) + 1
    threshold = spend(number, n_looks)
    decisions = look_at(groups, step, threshold, n_looks, metric=metric) if threshold > 0 else {}
    for v, d in decisions.items():
        d.look = number
        d.reason = reason(v, d)
    return {
        "look": number,
        "step": step,
        "threshold": threshold,
        "looks": n_looks,
        "metric": metric,
        "rows": {v: sorted(side) for v, side in sorted(groups.items())},
        "pruned": sorted(decisions),
        "decisions": {v: d.as_dict() for v, d in sorted(decisions.items())},
    }


def decision_for(looks: list[dict], variant: str, step: int, task: str | None = None) -> Decision | None:
    """What the run decided about `variant` so far, as its replicate `task` stopping at `step` says it."""
    for line in looks:
        if variant in line["pruned"]:
            d = Decision(**{**line["decisions"][variant], "step": step, "compared_step": line["step"]})
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
    return (
        f"prune=true looked {len(looks)} time{'s' if len(looks) != 1 else ''} (step{'s' if len(looks) != 1 else ''} "
        f"{steps}), each at {last['threshold']:.3g} = 5% / {last['looks']} looks: "
        + ("; ".join(out) if out else "no variant pruned")
    )
