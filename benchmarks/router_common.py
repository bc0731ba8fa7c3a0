"""Shared pieces of the router benchmarks: workloads, device fleets, the cost-model metrics, machine info.

Cost model (no processes, no GPU): a device's time for a step is the padded tokens of its micro-batches
divided by its speed, and a step lasts as long as its slowest device. From that:
  balance ratio        = max / mean planned cost over devices (idle devices count in the mean)
  useful-token fraction = real tokens / (D * max_d padded tokens_d): 1.0 = no padding and no device waiting
  throughput fraction   = ideal step time / achieved step time, ideal = total cost / sum of speeds
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from workloads import lognormal_lengths, sample_batches, stdlib_lengths  # noqa: E402

from slurm_router.router import Assignment, DeviceState, MemoryModel  # noqa: E402

POLICIES = ("round_robin", "least_loaded", "affinity", "balanced")
GIB = 1 << 30


def pools() -> dict[str, tuple[int, ...]]:
    return {
        "stdlib (512 B pieces)": stdlib_lengths(),
        "lognormal (mean 96, sigma 0.8, 8-512)": tuple(lognormal_lengths(50_000, seed=1234)),
    }


def gpt2_small_memory() -> MemoryModel:
    """Full fine-tune of GPT-2 small in fp32: the prior the router starts from (see MemoryModel)."""
    return MemoryModel.from_model_sizes(124_000_000, 124_000_000, 768, 12, 50257)


def fleet(
    speeds: list[float], total_bytes: int = 80 * GIB, headroom: float = 0.85, free_bytes: int | None = None
) -> list[DeviceState]:
    """Equal H100-like devices (80 GiB) unless told otherwise; free memory = total minus ~10% in use."""
    free = int(total_bytes * 0.9) if free_bytes is None else free_bytes
    return [DeviceState(d, s, int(headroom * total_bytes), free) for d, s in enumerate(speeds)]


def useful_fraction(a: Assignment, speeds: list[float] | None = None) -> float:
    padded = a.n_padded_tokens()
    speeds = speeds or [1.0] * len(padded)
    step = max(p / s for p, s in zip(padded, speeds))
    if step <= 0:
        return 1.0
    return sum(a.n_tokens()) / (step * sum(speeds))


def throughput_fraction(a: Assignment, speeds: list[float]) -> float:
    cost = a.planned_cost()
    achieved = max(c / s for c, s in zip(cost, speeds))
    return (sum(cost) / sum(speeds)) / achieved if achieved > 0 else 1.0


def microbatches_per_device(a: Assignment) -> float:
    return sum(len(m) for m in a.per_device) / len(a.per_device)


def machine_info() -> dict:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
    }


def busy_wait_ns(ns: int) -> None:
    """Spin for ns nanoseconds: time.sleep cannot resolve tens of us reliably (scheduler granularity)."""
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


__all__ = [
    "POLICIES",
    "pools",
    "gpt2_small_memory",
    "fleet",
    "useful_fraction",
    "throughput_fraction",
    "microbatches_per_device",
    "machine_info",
    "busy_wait_ns",
    "median",
    "mean",
    "sample_batches",
]
