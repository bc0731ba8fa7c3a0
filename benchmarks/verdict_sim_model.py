"""The runs benchmarks/verdict_sim.py simulates: eval tables that behave as a real run's (the same seeds and the same
eval batches at every step, so their effects persist over steps), variants with their own train.steps and
eval_every, and tasks arriving at their own paces. Pure numpy; the decisions are made by verdict_sim.py through the
production functions.

A replicate (variant v, seed s) evaluated at step t gives, on eval batch i, the per-token loss
    x[t, v, s, i] = m_v(t) + a[v, s](t) + b[i](t) + c[v, i] + e[t, v, s, i]
- m_v(t) = 2.5 + plateau_v + height_v * exp(-t / tau_v): the variant's mean curve (Curve);
- a[v, s](t): training noise (LoRA init, data order), sd `seed`; a share `seed_shared` of its variance is common to
  every variant run with seed s (the same data order), the rest is the variant's own; each part is a share
  `seed_fixed` fixed for the run plus an AR(1) part with correlation `ar` per 10 steps;
- b[i](t): the eval batch's difficulty, shared by every task (the same batches), sd `batch`: fixed for the run but
  for a drift of sd `batch_drift`, AR(1) as above (the real runs recorded in benchmarks/results/prune_replay.json:
  per-batch sd 0.081, a batch's loss relative to the others moves by 0.0014 between evaluations);
- c[v, i]: which eval samples favour variant v, sd `variant_batch`, fixed for the run;
- e: a replicate's per-batch noise at one evaluation, sd `fresh`, drawn afresh at every step.
The sizes are benchmarks/verdict_calibration.py's (lora_ab's); `persistent=False` is the model that simulation
used for every look: each step's a, b, c and e drawn afresh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from verdict_calibration import Noise as CalibrationNoise

from slurm_router.verdict import GRACE
from slurm_router.verdict.schedule import Schedule

LORA_AB = CalibrationNoise()
TOKENS = 1000  # target tokens per eval batch, the same in every batch: loss_sums = x * TOKENS
EVAL, END = 0, 1  # event kinds: an in-training evaluation recorded; a task's end (its result written)


@dataclass(frozen=True)
class Noise:
    """The sizes of the model's parts (nats per token) and how long each persists."""

    batch: float = LORA_AB.difficulty
    batch_drift: float = 0.002  # sd of the eval-batch effect's slowly varying part (AR(1))
    seed: float = LORA_AB.train
    seed_shared: float = LORA_AB.seed_corr  # share common to the variants run with the same seed
    seed_fixed: float = 0.5  # share of the seed effect fixed for the run (the rest AR(1))
    ar: float = 0.8  # AR(1) correlation of the slowly varying parts per 10 steps
    variant_batch: float = LORA_AB.variant_batch
    fresh: float = LORA_AB.replicate_batch
    persistent: bool = True  # False: every step's a, b, c and e drawn afresh (the old simulation)

    @property
    def look_to_look(self) -> float:
        """The correlation of a seed effect between evaluations 10 steps apart."""
        return self.seed_fixed + (1 - self.seed_fixed) * self.ar if self.persistent else 0.0


FRESH = Noise(persistent=False)


@dataclass(frozen=True)
class Curve:
    """m(t) = 2.5 + plateau + height * exp(-t / tau): held-out loss against training steps."""

    plateau: float = 0.0
    height: float = 0.0
    tau: float = 20.0

    def at(self, t: float) -> float:
        return 2.5 + self.plateau + self.height * math.exp(-t / self.tau)


@dataclass(frozen=True)
class Design:
    """A run: each variant's curve and (train.steps, eval_every), seeds per variant, eval batches, the looks'
    grace (verdict/schedule.py Schedule) and the noise."""

    curves: tuple[Curve, ...]
    plan: tuple[tuple[int, int], ...]
    seeds: int = 3
    batches: int = 32
    grace: float = GRACE
    noise: Noise = field(default_factory=Noise)

    @property
    def names(self) -> list[str]:
        return [f"v{i}" for i in range(len(self.curves))]

    @cached_property
    def schedule(self) -> Schedule:
        """The run's looks as the plan fixes them: every task's (train.steps, eval_every)."""
        return Schedule.of([p for p in self.plan for _ in range(self.seeds)], grace=self.grace)

    @cached_property
    def grid(self) -> tuple[int, ...]:
        """Every step some task evaluates at: in training, and at its end (its final evaluation)."""
        return tuple(sorted({s for steps, every in self.plan for s in [*evals(steps, every), steps]}))

    @property
    def fixed_steps(self) -> int:
        """Device-steps of the fixed design: every replicate to its end."""
        return self.seeds * sum(steps for steps, _ in self.plan)

    def true_final(self) -> list[float]:
        return [c.at(steps) for c, (steps, _) in zip(self.curves, self.plan)]


def evals(steps: int, every: int) -> list[int]:
    """A task's in-training evaluations (the worker's: every eval_every-th step before its last)."""
    return list(range(every, steps, every)) if every > 0 else []


def unit_paths(rng: np.random.Generator, n: int, grid: tuple[int, ...], fixed: float, noise: Noise) -> np.ndarray:
    """(steps, n) unit-variance processes over the grid: a share `fixed` of the variance drawn once, the rest AR(1)
    with correlation noise.ar per 10 steps; independent at every step when the noise is not persistent."""
    if not noise.persistent:
        return rng.standard_normal((len(grid), n))
    z = np.empty((len(grid), n))
    z[0] = rng.standard_normal(n)
    for j in range(1, len(grid)):
        r = noise.ar ** ((grid[j] - grid[j - 1]) / 10)
        z[j] = r * z[j - 1] + math.sqrt(1 - r * r) * rng.standard_normal(n)
    return math.sqrt(fixed) * rng.standard_normal(n) + math.sqrt(1 - fixed) * z


def draw_losses(rng: np.random.Generator, design: Design) -> np.ndarray:
    """x[t, v, s, i]: per-token loss of every replicate on every eval batch at every grid step (the model above)."""
    nz, grid = design.noise, design.grid
    G, k, S, B = len(grid), len(design.curves), design.seeds, design.batches
    mean = np.array([[c.at(t) for c in design.curves] for t in grid])  # (G, k)
    shared = unit_paths(rng, S, grid, nz.seed_fixed, nz)[:, None, :]  # (G, 1, S): the seed's data order
    own = unit_paths(rng, k * S, grid, nz.seed_fixed, nz).reshape(G, k, S)
    a = nz.seed * (math.sqrt(nz.seed_shared) * shared + math.sqrt(1 - nz.seed_shared) * own)
    b = nz.batch * unit_paths(rng, B, grid, 1 - (nz.batch_drift / nz.batch) ** 2, nz)  # (G, B)
    c = nz.variant_batch * (rng.standard_normal((1, k, B)) if nz.persistent else rng.standard_normal((G, k, B)))
    e = nz.fresh * rng.standard_normal((G, k, S, B))
    return mean[:, :, None, None] + a[..., None] + b[:, None, None, :] + c[:, :, None, :] + e


@dataclass
class Task:
    """One replicate's pace: it starts at `start` and trains a step every `per_step` (time units: one
    evaluation period of 10 steps is about 1)."""

    variant: str
    seed: int
    steps: int
    every: int
    start: float
    per_step: float

    def time_of(self, step: int) -> float:
        return self.start + step * self.per_step

    def step_at(self, t: float) -> int:
        """The steps it has run when it learns at time t that its variant was pruned: the step it is in, finished
        (0 before it starts)."""
        if t < self.start:
            return 0
        return min(self.steps, int((t - self.start) / self.per_step) + 1)


def tasks(rng: np.random.Generator, design: Design) -> list[Task]:
    """Every replicate, starting at random within 1.5 evaluation periods and running at its own pace (an
    evaluation period of 0.7-1.4), as benchmarks/prune_protocol.py's tasks."""
    out = []
    for v, (steps, every) in zip(design.names, design.plan):
        for s in range(design.seeds):
            out.append(Task(v, s, steps, every, rng.uniform(0, 1.5), rng.uniform(0.07, 0.14)))
    return out


def events(run_tasks: list[Task]) -> list[tuple[float, int, str, int, int]]:
    """(time, kind, variant, seed, step) of every evaluation and every task's end, in time order."""
    out = []
    for t in run_tasks:
        out += [(t.time_of(step), EVAL, t.variant, t.seed, step) for step in evals(t.steps, t.every)]
        out.append((t.time_of(t.steps), END, t.variant, t.seed, t.steps))
    return sorted(out)


def row(x: np.ndarray, design: Design, step: int, v: int, s: int, tokens: np.ndarray) -> dict:
    """One replicate's eval row at `step`, as worker/prune.read_steps gives it: per-batch loss sums and tokens."""
    return {"loss_sums": x[design.grid.index(step), v, s] * TOKENS, "tokens": tokens}


def step_tables(
    rng: np.random.Generator, effects: tuple[float, ...], names: tuple[str, ...], seeds: int, eval_steps: tuple[int, ...],
    steps: int, noise: Noise | None = None,
) -> dict[int, dict[str, dict[int, dict]]]:  # fmt: skip
    """{step: {variant: {seed: {loss_sums, tokens}}}} at each in-training evaluation of one run under this model:
    variant j worse than the first by effects[j] nats per token at every step, the same seeds and eval batches
    throughout (their token counts drawn once, lora_ab's 2,000-3,200 per batch). The shape benchmarks/prune_protocol.py
    and auto_seeds.py's rules read."""
    every = eval_steps[0]
    assert tuple(evals(steps, every)) == tuple(eval_steps), "evaluations every `every` steps before the last"
    plan = ((steps, every),) * len(effects)
    design = Design(tuple(Curve(plateau=e) for e in effects), plan, seeds=seeds, noise=noise or Noise())
    x = draw_losses(rng, design)
    tokens = rng.integers(*LORA_AB.tokens, size=design.batches)
    return {
        step: {
            v: {
                s: {
                    "loss_sums": [float(y) for y in x[design.grid.index(step), j, s] * tokens],
                    "tokens": tokens.tolist(),
                }
                for s in range(seeds)
            }
            for j, v in enumerate(names)
        }
        for step in eval_steps
    }
