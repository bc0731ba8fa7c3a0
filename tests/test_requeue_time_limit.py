"""A real one-minute Slurm time limit, twice (tests/test_requeue_slurm.py's helpers; a file of its own so that
it runs beside that file's tests: its minutes are mostly Slurm's clock).

    sudo scripts/slurm_test_cluster.sh && pytest -m slurm tests/test_requeue_time_limit.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli, slowdown
from test_requeue_slurm import (
    SMALL,
    _losses,
    _rows,
    _sacct_state,
    _submit,
    _task_jobs,
    _wait,
    pytestmark,  # noqa: F401  (slurm marker, skipped without sbatch)
)


def test_real_time_limit_requeues_then_stops_at_the_budget(tmp_path, base_cache):
    """A real two-minute time limit (no mocked clock): Slurm's USR2 before it makes the task checkpoint after the
    step in flight and requeue itself as a time-out; the second time-out exceeds launcher.max_requeues=1, so the
    task fails with one line saying what to do, keeping its checkpoint; resume= finishes it from there."""
    # Only the variants meet the time limit: the base stage is trained first (here when no earlier test of this
    # pytest worker did; under the suite's first minutes its 10 steps can outlast both attempts).
    local = [a for a in SMALL if not a.startswith("launcher.")]
    warm = run_cli(
        *local,
        "launcher=local",
        "train.steps=1",
        "train.eval_batches=1",
        f"base.cache_dir={base_cache}",
        f"run_root={tmp_path / 'warm_base'}",
        cwd=tmp_path,
        timeout=600,
    )
    assert warm.returncode == 0, warm.stdout[-3000:] + warm.stderr[-3000:]
    # Slurm checks time limits every 30 s and sends --signal=B:USR2@50 at the first check within 30 s of its time:
    # 40-70 s after the job starts, so each attempt has at least 40 s to start and train (a one-minute limit with
    # USR2@20 gave 10-40 s, which a loaded machine's start-up can take whole: seen here 30 s from the job's start to
    # its first step), and ends then (it requeues itself). Steps of 1.7-2.4 s here (slowed 14x): the 80
    # need more than two attempts can train (2 x 65 s).
    run_dir = _submit(
        tmp_path,
        base_cache,
        "launcher=sbatch",
        "train.steps=80",
        "launcher.timeout_min=2",
        "launcher.signal_delay_s=50",
        "launcher.max_requeues=1",
        env=slowdown("14"),
    )
    jobs = _task_jobs(run_dir)
    # two attempts of about a minute each, and Slurm's queue: over 300 s with the suite's first files beside it
    _wait(
        lambda: all(_sacct_state(jobs[t]) == "FAILED" for t in ("r8", "r32")),
        [jobs["r8"], jobs["r32"]],
        "both tasks to exceed their time-out budget",
        timeout=900,
    )
    rows = _rows(run_dir, "r8")
    requeues = [r for r in rows if r["event"] == "requeue"]
    assert len(requeues) == 1 and requeues[0]["reason"] == "timeout" and requeues[0]["attempt"] == 0, requeues
    end = [r for r in rows if r["event"] == "end"][-1]
    assert end["exit_state"] == "failed" and "launcher.max_requeues=1" in end["error"] and end["attempt"] == 1
    errors = [l for l in (run_dir / "logs" / f"{jobs['r8']}.err").read_text().splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "raise launcher.timeout_min" in errors[0], errors
    # each attempt trained before its time limit, and the limit's USR2 saved a checkpoint at the step it stopped
    # after (reason "signal", not a periodic one), from which the next attempt went on
    for attempt, stopped_at in ((0, requeues[0]["step"]), (1, end["step"])):
        trained = [r["step"] for r in rows if r["event"] == "step" and r["attempt"] == attempt]
        assert trained, f"attempt {attempt} trained no step before its time limit"
        saved = [
            r for r in rows if r["event"] == "checkpoint_saved" and r["attempt"] == attempt and r["reason"] == "signal"
        ]
        assert [r["step"] for r in saved] == [max(trained) + 1] == [stopped_at], (attempt, trained, saved)
    loaded = [r for r in rows if r["event"] == "checkpoint_loaded"]
    assert [(r["attempt"], r["step"]) for r in loaded] == [(1, requeues[0]["step"])], loaded
    last_saved = [r for r in rows if r["event"] == "checkpoint_saved"][-1]
    assert last_saved["step"] == end["step"] and Path(last_saved["path"]).is_file(), last_saved
    assert end["step"] < 80, "the time limit never interrupted training"
    assert not (run_dir / "tasks" / "r8" / "result.json").exists()

    # the resume trains what both attempts left (up to ~75 steps each, two tasks side by side), no longer slowed (its
    # command sets no SLURM_ROUTER_TEST_DEVICE_SLOWDOWN); at 14x CI (4 pytest workers on 2 cores) took over 600 s here
    proc = run_cli(f"resume={run_dir}", "launcher=local", cwd=tmp_path, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(run_dir, "r8")
    loaded = [r for r in rows if r["event"] == "checkpoint_loaded"][-1]
    assert (loaded["attempt"], loaded["step"], loaded["path"]) == (2, end["step"], last_saved["path"]), loaded
    assert sorted(_losses(run_dir, "r8")) == list(range(80))
    # the same curve as r32, which hit its limits at other steps: up to float reduction order (the local resume runs
    # both tasks side by side, and a worker's thread count follows how many run at once)
    r8, r32 = _losses(run_dir, "r8"), _losses(run_dir, "r32")
    assert sorted(r8) == sorted(r32) and [r8[s] for s in sorted(r8)] == pytest.approx(
        [r32[s] for s in sorted(r32)], rel=1e-5
    )
