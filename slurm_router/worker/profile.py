"""One training step under torch.profiler, for finding where a step's time goes (a developer's aid, off by
default): SLURM_ROUTER_PROFILE_STEP=N profiles step N on rank 0 and writes the top operators by self time on
the device (CPU time on a CPU worker) to SLURM_ROUTER_PROFILE_OUT (default: profile-step-N.txt in the task
directory). benchmarks/throughput.py --profile uses it.

    SLURM_ROUTER_PROFILE_STEP=20 python -m slurm_router train.steps=30
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, TypeVar

import torch

PROFILE_STEP_ENV = "SLURM_ROUTER_PROFILE_STEP"
PROFILE_OUT_ENV = "SLURM_ROUTER_PROFILE_OUT"
TOP_OPERATORS = 15
T = TypeVar("T")


def profile_step() -> int | None:
    """The step to profile, or None (the variable unset or not a number)."""
    told = os.environ.get(PROFILE_STEP_ENV, "").strip()
    return int(told) if told.isdigit() else None


def profiled(train_step: Callable[[int], T], step: int, device: torch.device, task_dir: str | os.PathLike) -> T:
    """train_step(step) under torch.profiler; its top operators written to PROFILE_OUT (default: the task
    directory's profile-step-N.txt)."""
    result, table = top_operators(lambda: train_step(step), device)
    out = os.environ.get(PROFILE_OUT_ENV) or Path(task_dir) / f"profile-step-{step}.txt"
    Path(out).write_text(table + "\n")
    return result


def top_operators(run: Callable[[], T], device: torch.device) -> tuple[T, str]:
    """run() under torch.profiler: its result, and a table of the top operators by self time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        result = run()
        if cuda:
            torch.cuda.synchronize(device)
    table = prof.key_averages().table(
        sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
        row_limit=TOP_OPERATORS,
        max_name_column_width=60,
    )
    return result, table
