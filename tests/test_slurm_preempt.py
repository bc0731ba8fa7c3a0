"""Preemption, for real, on the 2-node test cluster (scripts/slurm_multinode_cluster.sh configures it as a site
does: PreemptType=preempt/partition_prio, PreemptMode=REQUEUE, a job of partition mnurgent preempts those of mn
after GraceTime=30 s). A 2-node task is preempted mid-run by an urgent job that takes both nodes whole:
- its workers get SIGTERM at once; the task reads that Slurm chose it (scontrol's PreemptTime), checkpoints and
  requeues itself: without that it ended on its own within GraceTime, FAILED, and never came back;
- while it is out, `status` counts it waiting, never ended;
- it comes back under its own job id once the urgent job ends, resumes from its checkpoint and ends with every
  step's loss equal to the same task on one device (tests/test_slurm_node_lost.py's comparison).

    pytest tests/test_slurm_preempt.py
"""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, slowdown
from test_multinode import (  # noqa: F401 (mn_env: the fixture)
    TIMEOUT_S,
    _at_step,
    _rows,
    _slurm,
    _submit,
    _task_jobs,
    _wait,
    cluster_test,
    mn_env,
)
from test_slurm_node_lost import assert_losses_of_one_device, waited_task

URGENT = "mnurgent"


def _status(run_dir, env: dict, *args: str) -> dict:
    proc = run_cli(str(run_dir), "--json", *args, module="slurm_router.status", env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _sacct_states(env: dict, job_id: str) -> list[str]:
    """Every attempt's state of the job, oldest first (-D: a requeued job keeps a row per attempt)."""
    out = _slurm(env, "sacct", "-X", "-D", "-n", "--parsable2", "-o", "JobID,State", "-j", job_id)
    return [l.split("|")[1] for l in out.splitlines() if l.split("|")[0] == job_id]


@cluster_test
def test_a_preempted_task_waits_then_resumes_with_the_same_losses(tmp_path, mn_env):  # noqa: F811
    if URGENT not in _slurm(mn_env, "sinfo", "-h", "-o", "%P"):
        pytest.skip(f"no partition {URGENT}: rerun scripts/slurm_multinode_cluster.sh (it configures preemption)")
    # slower steps so that the task is still training when the preemption lands
    run_dir = _submit(tmp_path, {**mn_env, **slowdown("3")})
    task = run_dir / "tasks" / "main"
    (job,) = _task_jobs(run_dir).values()
    _wait(lambda: _at_step(task, 5), "main at step 5")
    urgent = _slurm(
        mn_env, "sbatch", "--parsable", "-p", URGENT, "-N2", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 10"
    ).strip()
    assert urgent, "the urgent job was not submitted"
    try:
        # the workers' SIGTERM: the task sees Slurm chose it (PreemptTime), checkpoints and requeues itself
        # (REQUEUED); one slower than GraceTime would be killed and requeued by Slurm (PREEMPTED)
        _wait(
            lambda: {"PREEMPTED", "REQUEUED"} & set(_sacct_states(mn_env, job)), "the task out", timeout=120, poll_s=1
        )
        (main,) = _status(run_dir, mn_env)["tasks"]
        assert main["state"] not in ("COMPLETED", "FAILED", "CANCELLED", "INTERRUPTED"), main
    finally:
        _slurm(mn_env, "scancel", urgent)  # it ends by itself in 10 s; never left holding the nodes
    main = waited_task(run_dir, mn_env)
    assert main["state"] == "COMPLETED" and main["requeues"] >= 1, main
    assert len(_task_jobs(run_dir)) == 1  # back under its own id: nothing submitted twice
    requeues = [r for r in _rows(task) if r["event"] == "requeue"]
    assert requeues and requeues[0]["reason"] == "preempted", requeues  # not a failure, not a time-out
    loaded = [r for r in _rows(task) if r["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["attempt"] >= 1 and loaded[-1]["step"] > 0, loaded
    assert (task / "result.json").is_file()

    assert_losses_of_one_device(task, tmp_path, steps=12)


def test_preempt_time_read_from_scontrol():
    from slurm_router.backends.slurm.job import parse_preempt_time

    row = "JobId=69 JobName=wrap JobState=RUNNING Reason=None PreemptEligibleTime=2026-11-28T09:28:51 PreemptTime=%s"
    assert parse_preempt_time(row % "2026-11-28T09:28:56") == "2026-11-28T09:28:56"
    assert parse_preempt_time(row % "None") is None
    assert parse_preempt_time("") is None  # scontrol unreachable: not a preemption (the stop is an interruption)
