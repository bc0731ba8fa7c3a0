"""Tokens/s of a task: the one definition, shared by `status` (rundir/progress.py) and the report
(analysis/metrics.py), so that a task shows one number under that name wherever it is shown.

    tokens/s = the real (non-padding) tokens of the steps after warm-up
               / the summed step time (t_step_s) of those same steps

over rank 0's step rows (its n_tokens counts the samples of every device), one row per step: a step that a
requeued task ran again counts once, as its last attempt ran it. Warm-up is the first WARMUP_FRACTION of the
steps so far (at least one; none of a one-step task): it pays start-up costs (allocator, caches, kernel
selection) that later steps do not. Time between steps (evaluations, checkpoints) is not step time, so it is not
in tokens/s; status's pace (the wall time of the newest steps, which the ETA needs) is another figure, under its
own name (`pace_tokens_per_s`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

WARMUP_FRACTION = 0.1


def warmup_steps(n_steps: int) -> int:
    """How many of the first of n_steps steps are warm-up: WARMUP_FRACTION of them, at least one (none of one)."""
    return max(1, int(n_steps * WARMUP_FRACTION)) if n_steps > 1 else 0


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def steps_after_warmup(step_rows: Iterable[Mapping]) -> list[Mapping]:
    """Rank 0's step rows (in the order written) as one row per step, the last attempt's (of one attempt, the
    last written), without the warm-up steps; rows without a numeric step, n_tokens or t_step_s are left out."""
    last: dict[int, Mapping] = {}
    for row in step_rows:
        if not all(_number(row.get(f)) for f in ("step", "n_tokens", "t_step_s")):
            continue
        step, kept = int(row["step"]), last.get(int(row["step"]))
        if kept is None or int(row.get("attempt") or 0) >= int(kept.get("attempt") or 0):
            last[step] = row
    first = warmup_steps(max(last) + 1) if last else 0
    return [last[s] for s in sorted(last) if s >= first]


def per_s(step_rows: Iterable[Mapping], field: str = "n_tokens") -> float | None:
    """`field` (n_tokens: tokens/s, n_samples: samples/s) summed over the steps after warm-up, over the summed
    t_step_s of those same steps (see the module's docstring); None before a step after warm-up has a time."""
    rows = steps_after_warmup(step_rows)
    seconds = sum(float(r["t_step_s"]) for r in rows)
    if seconds <= 0 or not all(_number(r.get(field)) for r in rows):
        return None
    return sum(float(r[field]) for r in rows) / seconds


def tokens_per_s(step_rows: Iterable[Mapping]) -> float | None:
    """A task's tokens/s from rank 0's step rows, as the module's docstring defines it."""
    return per_s(step_rows, "n_tokens")
