"""A real one-minute Slurm time limit, twice (tests/test_requeue_slurm.py's helpers; a file of its own so that
it runs beside that file's tests: its minutes are mostly Slurm's clock).

    sudo scripts/slurm_test_cluster.sh && pytest -m slurm tests/test_requeue_time_limit.py
"""
from __future__ import annotations

from conftest import run_cli
from test_requeue_slurm import SMALL, _losses, _rows, _sacct_state, _submit, _task_jobs, _wait
from test_requeue_slurm import pytestmark  # noqa: F401  (slurm marker, skipped without sbatch)


def test_real_time_limit_requeues_then_stops_at_the_budget(tmp_path, base_cache):
    """A real one-minute time limit (no mocked clock): Slurm's USR2 20 s before it makes the task checkpoint and
    requeue itself as a time-out; the second time-out exceeds launcher.max_requeues=1, so the task fails with
    one line saying what to do, keeping its checkpoint; resume= finishes it from there."""
    # Only the variants meet the time limit: the base stage is trained first (here when no earlier test of this
    # pytest worker did; under the suite's first minutes its 10 steps can outlast two one-minute attempts).
    local = [a for a in SMALL if not a.startswith("launcher.")]
    warm = run_cli(*local, "launcher=local", "train.steps=1", "train.eval_batches=1", f"base.cache_dir={base_cache}",
                   f"run_root={tmp_path / 'warm_base'}", cwd=tmp_path, timeout=600)
    assert warm.returncode == 0, warm.stdout[-3000:] + warm.stderr[-3000:]
    run_dir = _submit(tmp_path, base_cache, "launcher=sbatch", "train.steps=80", "router.device_slowdown=[8.0]",
                      "launcher.timeout_min=1", "launcher.signal_delay_s=20", "launcher.max_requeues=1")
    jobs = _task_jobs(run_dir)
    # two attempts of about a minute each, and Slurm's queue: over 300 s with the suite's first files beside it
    _wait(lambda: all(_sacct_state(jobs[t]) == "FAILED" for t in ("r8", "r32")), [jobs["r8"], jobs["r32"]],
          "both tasks to exceed their time-out budget", timeout=900)
    rows = _rows(run_dir, "r8")
    requeues = [r for r in rows if r["event"] == "requeue"]
    assert requeues and requeues[0]["reason"] == "timeout" and requeues[0]["attempt"] == 0, requeues
    end = [r for r in rows if r["event"] == "end"][-1]
    assert end["exit_state"] == "failed" and "launcher.max_requeues=1" in end["error"] and end["attempt"] == 1
    errors = [l for l in (run_dir / "logs" / f"{jobs['r8']}.err").read_text().splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "raise launcher.timeout_min" in errors[0], errors
    # how far it got depends on the machine's load (the suite runs test files side by side): none at all
    # when two 40 s attempts went on start-up, which the resume below then starts from scratch
    done_steps = max((r["step"] for r in rows if r["event"] == "step"), default=-1)
    assert done_steps < 79, "the time limit never interrupted training"
    assert not (run_dir / "tasks" / "r8" / "result.json").exists()

    proc = run_cli(f"resume={run_dir}", "launcher=local", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(run_dir, "r8")
    loaded = [r for r in rows if r["event"] == "checkpoint_loaded"]
    if done_steps > 0:
        assert loaded and loaded[-1]["attempt"] == 2 and loaded[-1]["step"] >= done_steps - 1
    assert sorted(_losses(run_dir, "r8")) == list(range(80))
    assert _losses(run_dir, "r8") == _losses(run_dir, "r32")
