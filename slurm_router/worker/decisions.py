"""What the run decided about this task, as each rank of it learns it (prune=true; docs/design/pruning.md): after
an in-training evaluation, before the first step, and after any step in which the run took a look (LookWatch, its
flag riding the step's gathered stats). A pruned variant's task ends `pruned`; a seeds=auto reserve whose contest
was decided for its variant ends `not_needed` at the step it reached (worker/auto_seeds.py decided_reserve). Rank 0
asks; every rank learns its answer in one gather and ends the same way."""

from __future__ import annotations

from slurm_router.rundir import events as ev
from slurm_router.worker.auto_seeds import NOT_NEEDED, decided_reserve
from slurm_router.worker.prune import LookWatch, Pruned
from slurm_router.worker.setup import WorkerSetup
from slurm_router.worker.step_stats import StepStats

PRUNED, NOT_NEEDED_NOW = 1.0, 2.0  # what rank 0 learned, gathered so every rank ends the same way


class RunDecisions(WorkerSetup):
    """The Worker's half that asks the run's decisions (worker.py trains; fused.py asks per member)."""

    last_eval: tuple[list[float], list[int]]  # the latest evaluation's per-batch loss sums and tokens
    last_metrics: dict  # its task metrics (eval.metrics; empty without)

    def watch_looks(self) -> LookWatch | None:
        """prune=true, rank 0: the run's looks, asked about after every step (worker/prune.py LookWatch); made
        before the first check of the run's decisions, so no look falls between the two."""
        if self.rank != 0 or not self.cfg.get("prune") or self.spec.save_weights:
            return None
        return LookWatch(self.spec.run_dir)

    def look_taken(self, step: int, stats: list[StepStats]) -> bool:
        """Whether, after `step`, the run's decisions are worth asking without an evaluation: a look was taken since
        the step before (rank 0's LookWatch flag, gathered with the step's stats) and steps remain."""
        return step + 1 < self.spec.steps and any(s.new_look for s in stats)

    def prune(self, step: int, evaluated: bool = True) -> Pruned | None:
        """prune=true, after an in-training evaluation (or, evaluated=False, before the first step and after a step
        in which the run took a look): a seeds=auto reserve whose contest was decided for its variant ends
        not_needed (worker/auto_seeds.py decided_reserve); otherwise rank 0 learns
        the run's decision about its variant (prune.py) and every rank learns it; a pruned variant's task ends
        here, its result says why."""
        if not self.cfg.get("prune") or self.spec.save_weights:
            return None
        decision = None
        if self.rank == 0 and not evaluated:
            from slurm_router.worker.prune import decided

            decision = decided(self.spec, step)
        elif self.rank == 0:
            from slurm_router.worker.prune import after_eval

            decision = after_eval(
                self.spec, step, *self.last_eval, sources=self.eval_sources, metrics=self.last_metrics
            )
        unneeded = decided_reserve(self.spec) if self.rank == 0 and decision is None else None
        flag = self.gather([PRUNED if decision else NOT_NEEDED_NOW if unneeded else 0.0])[0][0]
        if not flag:
            return None
        if flag == NOT_NEEDED_NOW:  # a seeds=auto reserve of the variant the contest was decided for
            self.events.write(ev.EndRow(exit_state=NOT_NEEDED, step=step, detail=unneeded, steps=self.spec.steps))
            self.close()
            if self.rank == 0:
                print(f"{self.spec.name}: {unneeded} (step {step})", flush=True)
            result = {"exit_state": NOT_NEEDED, "reason": unneeded, "step": step, "steps": self.spec.steps}
            return Pruned(step, result if self.rank == 0 else None)
        self.events.write(ev.EndRow(exit_state="pruned", step=step, detail=decision.reason if decision else None))
        self.close()
        if self.rank != 0:
            return Pruned(step)
        assert decision is not None
        print(decision.reason, flush=True)
        return Pruned(step, {"exit_state": "pruned", **decision.as_dict(), "steps": self.spec.steps})
