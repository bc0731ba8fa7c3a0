"""A node lost under a 2-node task, on the 2-node test cluster (scripts/slurm_multinode_cluster.sh): mn2 set DOWN
mid-run (`scontrol update state=down`), then back. Slurm fails the job (NODE_FAIL) and, as the launchers submit
with --requeue, queues it again; the task resumes from its checkpoint once both nodes are back and ends with every
step's loss equal to the same task on one device; the report names the node lost.

pytest tests/test_slurm_node_lost.py
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_cli, run_dir_of
from test_multinode import (  # noqa: F401 (mn_env: the fixture)
    SMALL,
    TIMEOUT_S,
    TWO_NODES,
    _at_step,
    _hosts,
    _losses,
    _rows,
    _submit,
    _task_jobs,
    _wait,
    cluster_test,
    mn_env,
)


def scontrol(env: dict, *args: str, check: bool = True) -> None:
    subprocess.run(["scontrol", *args], env={**os.environ, **env}, check=check, capture_output=True, timeout=60)


def node_state(env: dict, node: str) -> str:
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-p", "mn", "-n", node, "-o", "%T"], env={**os.environ, **env}, capture_output=True
    )
    return out.stdout.decode().strip()


def wait_in_service(env: dict, node: str, timeout: float) -> None:
    _wait(lambda: node_state(env, node).rstrip("*~#") in ("idle", "mixed", "allocated"), f"{node} back", timeout)


def waited_task(run_dir: Path, env: dict) -> dict:
    """`status --wait --json` of a one-task run, once it has ended: its task."""
    proc = run_cli(
        str(run_dir), "--wait", "--poll-s", "1", "--json", module="slurm_router.status", env=env, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    (task,) = json.loads(proc.stdout)["tasks"]
    return task


def report_md(run_dir: Path, tmp_path: Path, env: dict) -> str:
    """The run's report.md, written to a folder of its own (the run's report job may rewrite RUN_DIR/report)."""
    proc = run_cli(
        str(run_dir), "--out", str(tmp_path / "report"), module="slurm_router.analysis", env=env, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return (tmp_path / "report" / "report.md").read_text()


def assert_losses_of_one_device(task_dir: Path, tmp_path: Path, steps: int) -> None:
    """Every step's loss equals the same task's run locally on one device, up to float reduction order (as the
    undisturbed 2-node task's does: tests/test_multinode.py)."""
    local = run_cli(
        *SMALL,
        "launcher=local",
        "resources.devices_per_task=1",
        f"train.steps={steps}",
        f"run_root={tmp_path / 'local'}",
        cwd=tmp_path,
    )
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    one_device = _losses(run_dir_of(local) / "tasks" / "main")
    assert sorted(_losses(task_dir)) == sorted(one_device) == list(range(steps))
    assert _losses(task_dir) == pytest.approx(one_device, rel=1e-5)


@cluster_test
def test_a_node_set_down_mid_run_requeues_and_resumes_with_the_same_losses(tmp_path, mn_env):  # noqa: F811
    run_dir = _submit(tmp_path, mn_env)
    task = run_dir / "tasks" / "main"
    _wait(lambda: _at_step(task, 5), "main at step 5")
    try:
        scontrol(mn_env, "update", "nodename=mn2", "state=down", "reason=test_slurm_node_lost")
        time.sleep(5)
    finally:  # always bring the node back (the other tests on this cluster need it); ReturnToService=2 may have
        scontrol(mn_env, "update", "nodename=mn2", "state=resume", check=False)  # already: then this is refused
        wait_in_service(mn_env, "mn2", 60)
    main = waited_task(run_dir, mn_env)
    assert (main["state"], main["requeues"]) == ("COMPLETED", 1), main
    loaded = [r for r in _rows(task) if r["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["attempt"] == 1 and loaded[-1]["step"] > 0, loaded
    assert _hosts(task, attempt=1) == {0: "mn1", 1: "mn2"}
    assert len(_task_jobs(run_dir)) == 1  # requeued under its own id: nothing submitted twice
    # the report says which node was lost, and why (slurmdbd's node event: sacct records no failed node)
    md = report_md(run_dir, tmp_path, mn_env)
    assert "lost node mn2 down at" in md and "test_slurm_node_lost" in md, md[-3000:]
    assert_losses_of_one_device(task, tmp_path, steps=12)
