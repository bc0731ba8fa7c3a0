"""When a run may look (prune=true), fixed by its plan: docs/design/pruning.md, "When the run looks"."""

from __future__ import annotations

from dataclasses import dataclass

from slurm_router.verdict import GRACE


@dataclass(frozen=True)
class Schedule:
    """The run's looks, fixed when the run is planned (docs/design/pruning.md, "When the run looks"): every planned
    task's in-training evaluation steps and training steps (variants may set their own train.steps and
    train.eval_every). A look is taken only at one of these steps, and only from GRACE of the longest training on
    (ASHA's grace period, as a share of training): what users decide by is the end of training, and curves that
    cross (learning rates, ranks) are still crossing early. L, the looks every look's level is a share of, is the
    number of such steps: the same for every task, whichever one takes a look, so no schedule overspends."""

    eval_steps: tuple[int, ...]
    steps: int
    grace: float = GRACE

    @classmethod
    def of(cls, tasks: list[tuple[int, int]], grace: float = GRACE) -> Schedule:
        """From each planned task's (train.steps, train.eval_every): a task evaluates at every eval_every-th step
        before its last (the worker's; eval_every 0: never). A look needs every replicate still training there to
        have its row, so only the steps every evaluating task still training evaluates at can be looked at: those
        are the run's eval steps, and L counts only them (with eval_every 10 and 20 side by side, the steps 10, 30,
        50 ... can never hold a look, and counting them would spend level no look can use)."""
        evaluating = [(steps, every) for steps, every in tasks if every > 0]
        evals = {s for steps, every in evaluating for s in range(every, steps, every)}
        common = {s for s in evals if all(s % every == 0 for steps, every in evaluating if steps > s)}
        return cls(tuple(sorted(common)), max((steps for steps, _ in tasks), default=0), grace)

    @property
    def look_steps(self) -> tuple[int, ...]:
        return tuple(s for s in self.eval_steps if s >= self.grace * self.steps)

    @property
    def n_looks(self) -> int:
        return max(1, len(self.look_steps))
