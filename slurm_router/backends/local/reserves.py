"""The local queue's view of seeds=auto's reserves: a reserve starts only once its call is made
(worker/auto_seeds.py call_now), so one waiting for the earlier rounds holds no device and is charged nothing
(docs/design/pruning.md, "seeds=auto"). A Slurm array task is submitted with its array and waits in its job."""

from __future__ import annotations

import math
import time

from slurm_router.rundir.spec import TaskSpec


class ReserveCalls:
    """Which waiting task may start now; the reserves' calls asked at most once every `every_s` seconds (each
    takes the run's decisions lock and reads every task's end)."""

    def __init__(self, every_s: float = 1.0):
        self.every_s, self.asked = every_s, -math.inf

    def startable(self, waiting: list[TaskSpec]) -> TaskSpec | None:
        """The first waiting task that may start: the queue's order, a reserve whose round is not called yet passed
        over (launch/plan.py queue_order puts the reserves last)."""
        from slurm_router.worker.auto_seeds import call_now, reserve_index

        ask = time.monotonic() - self.asked >= self.every_s
        for spec in waiting:
            if reserve_index(spec) is None:
                return spec
            if ask and call_now(spec) is not None:
                return spec
        if ask:
            self.asked = time.monotonic()
        return None
