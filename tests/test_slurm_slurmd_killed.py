"""A node's slurmd killed under a 2-node task, on the 2-node test cluster (scripts/slurm_multinode_cluster.sh):
the daemon dies, the task's processes on the node do not. Slurm stops hearing from mn2 (not responding after about
20 s, DOWN after SlurmdTimeout), fails the job (NODE_FAIL) and, as the launchers submit with --requeue, queues it
again; the daemon is started again (the cluster script), mn2 returns to service (ReturnToService=2), and the task
resumes from its checkpoint and ends with every step's loss equal to the same task on one device. The report names
the node lost.

    pytest tests/test_slurm_slurmd_killed.py
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import slowdown
from test_multinode import (  # noqa: F401 (mn_env: the fixture)
    _at_step,
    _rows,
    _submit,
    _task_jobs,
    _wait,
    cluster_test,
    mn_env,
)
from test_slurm_node_lost import assert_losses_of_one_device, node_state, report_md, wait_in_service, waited_task

CLUSTER_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm_multinode_cluster.sh"
SLURMD_PID = Path("/run/slurm-mn/slurmd-mn2.pid")
# long enough that the job still runs when Slurm gives up on mn2: SlurmdTimeout=60 puts it DOWN 45-100 s after the
# kill on a quiet machine, later under CI's load; 60 steps (80 s) once lost that race, so the task ended first
N_STEPS = 100
STEPS = [f"train.steps={N_STEPS}"]
SLOW = slowdown("12")  # about 1.4 s a step here


@cluster_test
def test_a_killed_slurmd_fails_the_node_and_the_task_resumes_with_the_same_losses(tmp_path, mn_env):  # noqa: F811
    if not SLURMD_PID.is_file():
        pytest.skip(f"no {SLURMD_PID}: the cluster was not started by {CLUSTER_SCRIPT}")
    run_dir = _submit(tmp_path, {**mn_env, **SLOW}, *STEPS)
    task = run_dir / "tasks" / "main"
    _wait(lambda: _at_step(task, 3), "main at step 3")
    try:
        os.kill(int(SLURMD_PID.read_text()), signal.SIGKILL)
        _wait(lambda: node_state(mn_env, "mn2").startswith("down"), "mn2 down", timeout=240, poll_s=2)
    finally:  # always start it again (the other tests on this cluster need mn2)
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "--nodes", "2"], capture_output=True, timeout=120)
        wait_in_service(mn_env, "mn2", 120)
    main = waited_task(run_dir, mn_env)
    first_end = next(r for r in _rows(task) if r["event"] == "end" and r["attempt"] == 0)
    assert first_end["exit_state"] == "interrupted", f"the task ended before Slurm gave up on mn2: {first_end}"
    assert main["state"] == "COMPLETED" and main["requeues"] >= 1, main
    assert len(_task_jobs(run_dir)) == 1  # requeued under its own id: nothing submitted twice
    loaded = [r for r in _rows(task) if r["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["attempt"] >= 1 and loaded[-1]["step"] > 0, loaded
    assert "lost node mn2" in report_md(run_dir, tmp_path, mn_env)
    assert_losses_of_one_device(task, tmp_path, steps=N_STEPS)
