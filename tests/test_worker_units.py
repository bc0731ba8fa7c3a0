"""The worker's pure parts: StepStats round-trips through the gathered float64 tensor, the CPU thread count
comes from the one rule in slurm_router.worker.cpu, and the loop's functions stay short.

    pytest tests/test_worker_units.py
"""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from slurm_router.worker import cpu
from slurm_router.worker.step_stats import StepStats

REPO = Path(__file__).resolve().parents[1]


def test_step_stats_round_trip_through_the_gathered_tensor():
    s = StepStats(
        busy_s=0.123456789,
        compute_s=0.1,
        cost=1234.5,
        peak_bytes=81 * 2**30 + 7,
        free_bytes=2**52 + 1,
        oom_count=2,
        oom_padded=4096,
        oom_n=8,
        stop=15,
        new_look=1,
        plan_digest=2**32 - 1,
    )
    row = s.pack()
    assert len(row) == StepStats.width() == len(dataclasses.fields(StepStats))
    gathered = torch.tensor(row, dtype=torch.float64).tolist()  # what all_gather hands back
    back = StepStats.unpack(gathered)
    assert back == s
    assert all(type(getattr(back, f.name)) is (int if f.type == "int" else float) for f in dataclasses.fields(back))
    assert StepStats.unpack(StepStats().pack()) == StepStats()
    with pytest.raises(ValueError, match="11 values, got 10"):
        StepStats.unpack(row[:-1])


def test_a_plan_digest_tells_two_plans_of_one_batch_apart():
    """The ranks' digests of a step are compared after the gather (worker.observe): the one divergence seen (the
    same 16 samples, one sample placed differently) must change it."""
    from slurm_router.router import MicroBatch
    from slurm_router.worker.step_stats import plan_digest

    def plan(first: tuple[int, ...], second: tuple[int, ...]):
        return ((MicroBatch(first, 10, 10, 10.0),), (MicroBatch(second, 10, 10, 10.0),))

    a, b = plan((1, 2, 3), (4, 5)), plan((1, 2), (3, 4, 5))
    assert plan_digest(a) == plan_digest(plan((1, 2, 3), (4, 5))) != plan_digest(b)
    assert (
        plan_digest(a)
        != plan_digest(
            plan(
                (1, 2),
                (3,),
            )
        )
        and 0 <= plan_digest(a) < 2**32
    )


def test_cpu_threads_come_from_the_launcher_else_the_workers_share(monkeypatch):
    monkeypatch.delenv(cpu.THREADS_ENV, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "1")  # inside a Slurm job: its job environment gives the CPUs per task
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "12")
    assert cpu.worker_threads(3) == 4 and cpu.worker_threads(1) == 12
    monkeypatch.setenv(cpu.THREADS_ENV, "5")
    assert cpu.worker_threads(3) == 5
    # the worker asks the one rule, nothing else of its own
    src = (REPO / "slurm_router" / "worker" / "setup.py").read_text()
    assert "worker_threads(" in src and "SLURM_CPUS_PER_TASK" not in src and "SLURM_ROUTER_THREADS" not in src


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


@pytest.mark.parametrize(
    "name",
    [
        "worker/worker.py",
        "worker/setup.py",
        "worker/members.py",
        "worker/evaluation.py",
        "worker/microbatch.py",
        "worker/step_stats.py",
        "rundir/events.py",
    ],
)
def test_worker_functions_stay_short(name):
    """A function of the loop's files reads on one screen (a module's length is a review warning: scripts/lint.sh)."""
    path = REPO / "slurm_router" / name
    text = path.read_text()
    for fn in _functions(ast.parse(text)):
        assert fn.end_lineno - fn.lineno + 1 <= 80, f"{name}:{fn.name} is {fn.end_lineno - fn.lineno + 1} lines"


def test_worker_names_its_steps():
    from slurm_router.worker.worker import Worker, train

    for step in ("setup", "plan", "sync", "learn", "observe", "evaluate", "checkpoint", "run", "finish"):
        assert callable(getattr(Worker, step))
    assert list(__import__("inspect").signature(train).parameters) == ["spec", "rank", "world", "master", "resume"]
