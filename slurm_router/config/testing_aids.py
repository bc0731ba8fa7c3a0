"""Testing aids, never a user's setting: slow devices and small memory simulated on CPU workers, and
router.memory_headroom above 1 (real out-of-memory errors on a GPU). Set for one process tree by environment
variables, which reach local workers, sbatch jobs and srun steps alike; read here, once per process.

  SLURM_ROUTER_TEST_DEVICE_SLOWDOWN="1,3"         each rank's compute time x its multiplier (ranks cycle through)
  SLURM_ROUTER_TEST_CPU_MEMORY_CAP_BYTES=200000   a CPU worker acts as a device of this many bytes (simulated OOM)
  SLURM_ROUTER_TEST_MEMORY_HEADROOM_MAX=4         router.memory_headroom may go up to this (default 1)

The first two take VALUE (every task) or VARIANT=VALUE entries, joined by ';': "4;r32=20" slows every task 4x
and variant r32's 20x.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, TypeVar

from slurm_router.errors import UserError

PREFIX = "SLURM_ROUTER_TEST_"
DEVICE_SLOWDOWN_ENV = PREFIX + "DEVICE_SLOWDOWN"
CPU_MEMORY_CAP_ENV = PREFIX + "CPU_MEMORY_CAP_BYTES"
MEMORY_HEADROOM_MAX_ENV = PREFIX + "MEMORY_HEADROOM_MAX"
# the router.* keys these replace: a config that still sets one is told which variable to use
FORMER_KEYS = {"device_slowdown": DEVICE_SLOWDOWN_ENV, "cpu_memory_cap_bytes": CPU_MEMORY_CAP_ENV}
EVERY = ""  # the entry without a variant's name: every task's

T = TypeVar("T")


@dataclass(frozen=True)
class TestingAids:
    __test__ = False  # not a pytest test class

    device_slowdown: dict[str, tuple[float, ...]] = field(default_factory=dict)  # variant -> each rank's factor
    cpu_memory_cap_bytes: dict[str, int] = field(default_factory=dict)  # variant -> a CPU worker's bytes
    memory_headroom_max: float = 1

    def slowdown(self, variant: str, rank: int) -> float:
        """How many times slower this rank of this variant's task computes (1.0: not slowed)."""
        factors = self.device_slowdown.get(variant) or self.device_slowdown.get(EVERY) or (1.0,)
        return factors[rank % len(factors)]

    def cpu_memory_cap(self, variant: str) -> int | None:
        """The simulated memory of this variant's CPU workers in bytes; None: their real memory."""
        return self.cpu_memory_cap_bytes.get(variant, self.cpu_memory_cap_bytes.get(EVERY))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "TestingAids":
        """Raises UserError, one line naming the variable, on a value it cannot read."""
        headroom = environ.get(MEMORY_HEADROOM_MAX_ENV, "").strip()
        return cls(
            device_slowdown=_by_variant(environ, DEVICE_SLOWDOWN_ENV, _factors, "numbers > 0, e.g. 1,3 or 4;r32=20"),
            cpu_memory_cap_bytes=_by_variant(
                environ, CPU_MEMORY_CAP_ENV, _bytes, "a whole number of bytes >= 1, e.g. 200000 or bad=1000"
            ),
            memory_headroom_max=_read(MEMORY_HEADROOM_MAX_ENV, headroom, _positive, "a number > 0, e.g. 4")
            if headroom
            else 1,
        )


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise ValueError(text)
    return value


def _factors(text: str) -> tuple[float, ...]:
    return tuple(_positive(part) for part in text.split(","))


def _bytes(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _read(name: str, text: str, parse: Callable[[str], T], what: str) -> T:
    try:
        return parse(text.strip())
    except ValueError:
        raise UserError(f"environment variable {name}: {text!r} is not valid: give {what}") from None


def _by_variant(environ: Mapping[str, str], name: str, parse: Callable[[str], T], what: str) -> dict[str, T]:
    out: dict[str, T] = {}
    for entry in filter(None, (e.strip() for e in environ.get(name, "").split(";"))):
        variant, _, value = entry.rpartition("=")
        out[variant.strip()] = _read(name, value, parse, what)
    return out


@functools.cache
def testing_aids() -> TestingAids:
    """This process's aids, read from os.environ once (testing_aids.cache_clear() reads them again)."""
    return TestingAids.from_environ(os.environ)
