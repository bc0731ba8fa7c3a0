"""What the run decided about the members of a task (prune=true; docs/design/pruning.md), as rank 0 asks it: after
an in-training evaluation, before the first step, and after any step in which the run took a look (a LookWatch,
its flag riding the step's gathered stats). A pruned member ends `pruned`; a seeds=auto reserve whose contest was
decided for its variant ends `not_needed` at the step it reached (the reserve's rule: decided_reserve). Rank 0
asks; the worker gathers its answers so that every rank ends the same members the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from slurm_router.worker.auto_seeds import NOT_NEEDED, decided_reserve
from slurm_router.worker.members import Member
from slurm_router.worker.prune import LookWatch

PRUNED, NOT_NEEDED_NOW = 1.0, 2.0  # a member's answer, gathered so every rank ends the same way


@dataclass
class Ending:
    """How a member leaves the group after a decision: its end row's exit_state and detail, its result (rank 0's;
    other ranks know only the exit_state)."""

    exit_state: str
    detail: str | None
    result: dict
    steps_in_row: bool = False  # not_needed: its end row says how many steps it was planned for

    @property
    def flag(self) -> float:
        return NOT_NEEDED_NOW if self.exit_state == NOT_NEEDED else PRUNED


def prunes(cfg, save_weights: str | None) -> bool:
    """Whether the run's decisions concern this task: prune=true and a variant (a base stage is never pruned)."""
    return bool(cfg.get("prune")) and not save_weights


def watch_looks(cfg, spec, rank: int) -> LookWatch | None:
    """prune=true, rank 0: the run's looks, asked about after every step; made before the first check of the run's
    decisions, so no look falls between the two."""
    if rank != 0 or not prunes(cfg, spec.save_weights):
        return None
    return LookWatch(spec.run_dir)


def ask(members: list[Member], step: int, evaluated: bool, sources: list) -> list[Ending | None]:
    """Rank 0: each member's ending, if the run decided one. After an in-training evaluation (evaluated) every
    member's evaluation is recorded before any is decided, and the run's next look is taken when one is due."""
    from slurm_router.worker import prune

    if evaluated:
        for m in members:
            seed = cast(int, m.spec.seed)
            prune.record(m.spec.task_dir, step, m.spec.variant, seed, *m.last_eval, sources, m.last_metrics)
        schedule = prune.run_schedule(members[0].spec.run_dir)  # the run's, as its plan fixed it: one for all
        decisions = [prune.decide_after(m.spec, step, schedule) for m in members]
    else:
        decisions = [prune.decided(m.spec, step) for m in members]
    out: list[Ending | None] = []
    for m, d in zip(members, decisions):
        if d is not None:
            print(d.reason, flush=True)
            out.append(Ending("pruned", d.reason, {"exit_state": "pruned", **d.as_dict(), "steps": m.spec.steps}))
            continue
        unneeded = decided_reserve(m.spec)  # a seeds=auto reserve of the variant the contest was decided for
        if unneeded is None:
            out.append(None)
            continue
        print(f"{m.spec.name}: {unneeded} (step {step})", flush=True)
        result = {"exit_state": NOT_NEEDED, "reason": unneeded, "step": step, "steps": m.spec.steps}
        out.append(Ending(NOT_NEEDED, unneeded, result, steps_in_row=True))
    return out


def learned(flag: float) -> Ending:
    """A rank other than 0: the ending its gathered flag says (no detail: rank 0 holds the decision)."""
    state = NOT_NEEDED if flag == NOT_NEEDED_NOW else "pruned"
    return Ending(state, None, {"exit_state": state}, steps_in_row=state == NOT_NEEDED)
