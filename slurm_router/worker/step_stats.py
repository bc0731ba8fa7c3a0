"""A step's records: the router's plan of it (StepPlan); what every worker tells every other after it
(StepStats: one row of one small all-gather, float64, not a poll per routing decision; the router learns from
every device's row, and the stop flag and prune=true's new-look flag ride along so every rank sees every flag
and all stop after the same step); and its event row (step_row), which the worker writes for each member of its task."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from slurm_router.router import Assignment, MicroBatch
from slurm_router.rundir import events as ev

if TYPE_CHECKING:
    from slurm_router.worker.microbatch import DeviceStep
    from slurm_router.worker.telemetry import Telemetry


@dataclass
class StepPlan:
    """The step's global batches (one per member of the task still training) and the router's split of them."""

    ids: list[int]  # every sample's key: k * N + its id (member k, N training samples; a task alone's: its ids)
    lengths: list[int]
    speeds: list[float]
    assignment: Assignment
    mine: list[MicroBatch]
    batches: dict[int, list[int]]  # each member's global batch (sample ids), by k
    targets: dict[int, int]  # each member's global target count: what its loss divides by (data.Split: completions)

    @property
    def target_tokens(self) -> int:
        return sum(self.targets.values())


@dataclass(frozen=True)
class StepStats:
    busy_s: float = 0.0  # wall time from the step's start to the end of this device's micro-batches
    compute_s: float = 0.0  # forward+backward time of its micro-batches
    cost: float = 0.0  # the router's cost of the samples it computed
    peak_bytes: int = 0  # memory peak of its micro-batches (0: unknown)
    free_bytes: int = 0  # device memory free after the step
    oom_count: int = 0  # out-of-memory halvings this step
    oom_padded: int = 0  # the largest micro-batch that did not fit: padded tokens ...
    oom_n: int = 0  # ... and samples
    stop: int = 0  # the stop signal this worker received (0: none)
    new_look: int = 0  # prune=true: rank 0 saw the run take a look since its last step (worker/prune.py LookWatch)
    plan_digest: int = 0  # plan_digest of the router's assignment this rank computed: every rank's must agree

    def pack(self) -> list[float]:
        """The gathered row: the fields in declaration order (exact in float64 for ints below 2**53)."""
        return [float(getattr(self, f.name)) for f in dataclasses.fields(self)]

    @classmethod
    def unpack(cls, row) -> "StepStats":
        fields = dataclasses.fields(cls)
        if len(row) != len(fields):
            raise ValueError(f"a StepStats row has {len(fields)} values, got {len(row)}")
        return cls(
            **cast(
                "dict[str, Any]",
                {f.name: (int(v) if f.type in ("int", int) else float(v)) for f, v in zip(fields, row)},
            )
        )

    @classmethod
    def width(cls) -> int:
        return len(dataclasses.fields(cls))


def plan_digest(per_device) -> int:
    """A 32-bit digest of an assignment's sample ids per device and micro-batch: the router runs on every rank
    over the same gathered state, so every rank's digest of a step must be the same (else a sample would be
    trained twice or never: docs/design/router.md, "The router's invariant")."""
    import zlib

    return zlib.crc32(repr([[mb.sample_ids for mb in mbs] for mbs in per_device]).encode())


def step_row(plan: StepPlan, mine: DeviceStep, telemetry: Telemetry, **fields: Any) -> ev.StepRow:
    """A step's event row: the plan's costs, micro-batch counts and speeds, this device's OOM halvings and
    memory peak, its telemetry; `fields` are the caller's own (step, loss, lr, token and sample counts, padding,
    times)."""
    assignment = plan.assignment
    return ev.StepRow(
        planned_cost=assignment.planned_cost(),
        n_micro=[len(p) for p in assignment.per_device],
        speed=plan.speeds,
        cost_balance_ratio=assignment.cost_balance_ratio(),
        oom_retries=mine.oom_count,
        mem_peak_bytes=mine.peak_bytes,
        mem_total_bytes=telemetry.total_bytes(),
        util=telemetry.util(),
        **fields,
    )
