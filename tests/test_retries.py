"""launcher.max_failures: a task that failed for a reason not its own runs again from its checkpoint, away from
the node it failed on, up to N times; its own error never does (slurm_router.supervise.retry).

Unit tests for the decisions (which failures count, the budget in attempts.json, which nodes to exclude, NODE_FAIL
found in sacct), then the real single-node Slurm cluster: a worker killed with SIGKILL mid-run makes its task
requeue itself once and end with the losses of an uninterrupted copy; a task whose worker raised is not retried.

    pytest tests/test_retries.py                       # the cluster test needs scripts/slurm_test_cluster.sh
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import event_rows, memory_cap, run_cli, run_dir_of, slowdown

from slurm_router.backends.slurm import job as slurm_job
from slurm_router.backends.slurm.config import SbatchLauncherConfig, SubmititLauncherConfig
from slurm_router.backends.slurm.job import SlurmJobEnvironment
from slurm_router.rundir.spec import TaskSpec
from slurm_router.supervise import retry


def test_only_a_worker_killed_by_a_signal_is_not_its_own_error():
    assert retry.signal_death("r8: worker rank 1 (pid 4242) killed by SIGKILL") == "SIGKILL of worker rank 1"
    assert retry.signal_death("worker rank 0 (pid 7) killed by SIGSEGV") == "SIGSEGV of worker rank 0"
    assert retry.signal_death("worker rank 0 (pid 7) raised RuntimeError: boom") is None
    assert retry.signal_death("worker rank 0 (pid 7) exit code 3") is None
    assert retry.signal_death("worker rank(s) [1] did not end in time after a stop or after their peers ended") is None
    assert SubmititLauncherConfig.max_failures == SbatchLauncherConfig.max_failures == 0


@pytest.mark.parametrize(
    "failed, nodes, exclude, kept",
    [
        (["vm"], {"vm": "mix"}, [], ["vm"]),  # the test cluster: its only node stays
        (["n1"], {"n1": "alloc", "n2": "idle"}, ["n1"], []),
        (["n1"], {"n1": "alloc", "n2": "down*"}, [], ["n1"]),  # the other node cannot run it
        (["n1"], {"n1": "alloc", "n2": "drain"}, [], ["n1"]),
        (["n1", "n2"], {"n1": "mix", "n2": "mix", "n3": "idle"}, ["n1", "n2"], []),
        (["n1", "n2"], {"n1": "mix", "n2": "mix"}, ["n2"], ["n1"]),  # the newest failure is excluded first
        (["gone", "n1"], {"n1": "idle", "n2": "idle"}, ["n1"], []),  # not in sinfo: not a node to name
        (["n1"], {}, [], []),  # sinfo said nothing
    ],
)
def test_nodes_to_exclude_leave_a_node_to_run_on(failed, nodes, exclude, kept):
    usable = {node: slurm_job.usable(state) for node, state in nodes.items()}
    assert retry.nodes_to_exclude(failed, usable) == (exclude, kept)


def test_sinfo_and_sacct_outputs():
    assert slurm_job.parse_sinfo("vm|mix\nn2|down*\nvm|mix\n\n") == {"vm": "mix", "n2": "down*"}
    assert slurm_job.usable("idle") and slurm_job.usable("mix") and slurm_job.usable("alloc")
    assert not slurm_job.usable("down*") and not slurm_job.usable("idle*") and not slurm_job.usable("drain")
    sacct = (
        "42|NODE_FAIL|n3|2024-01-01T10:00:00\n42|REQUEUED|n1|2024-01-01T11:00:00\n42|RUNNING|n2|2024-01-01T12:00:00\n"
    )
    assert slurm_job.parse_node_failures(sacct) == [("42@2024-01-01T10:00:00", "n3")]


@pytest.fixture
def spec(tmp_path, monkeypatch):
    """A task as its job process sees it under Slurm (array task 7_0 on node n1), with launcher.max_failures=1;
    Slurm's commands answered by a fake (two usable nodes), the requeue recorded instead of run."""
    task_dir = tmp_path / "tasks" / "r8"
    task_dir.mkdir(parents=True)
    s = TaskSpec(
        run_id="r",
        run_dir=str(tmp_path),
        experiment="e",
        name="r8",
        stage="variants",
        variant="r8",
        index=0,
        devices=1,
        config={"launcher": {"kind": "sbatch", "max_failures": 1}},
        steps=10,
        lr=1e-3,
        global_batch_size=4,
        lora=True,
    )
    for key, value in {
        "SLURM_JOB_ID": "8",
        "SLURM_ARRAY_JOB_ID": "7",
        "SLURM_ARRAY_TASK_ID": "0",
        "SLURMD_NODENAME": "n1",
        "SLURM_JOB_PARTITION": "gpu",
    }.items():
        monkeypatch.setenv(key, value)
    for key in (
        "SLURM_RESTART_COUNT",
        "SLURM_ROUTER_COLOCATED",
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "SLURM_ROUTER_REQUEUE_REQUEST",
    ):
        monkeypatch.delenv(key, raising=False)
    requeued = []
    monkeypatch.setattr(
        retry, "requeue_self", lambda spec, decision, step, now=True: requeued.append((decision, step, now))
    )
    s.requeued = requeued
    return s


class FakeSlurm:
    def __init__(self, sacct: str = ""):
        self.calls, self.excluded, self.sacct = [], "", sacct

    def __call__(self, argv: list[str]) -> str:
        self.calls.append(argv)
        if argv[0] == "sinfo":
            return "n1|mix\nn2|idle\n"
        if argv[:2] == ["scontrol", "update"]:
            self.excluded = argv[-1]
        if argv[:2] == ["scontrol", "show"]:
            return f"JobId=8 ArrayJobId=7 ArrayTaskId=0\n   ReqNodeList=(null) {self.excluded}\n"
        return self.sacct if argv[0] == "sacct" else ""


def _failures(spec) -> list[dict]:
    return json.loads((Path(spec.task_dir) / "attempts.json").read_text())["failures"]


def test_a_signal_death_is_retried_within_the_budget_and_its_own_error_never(spec):
    slurm = FakeSlurm()
    assert (
        retry.after_failure(spec, "worker rank 0 (pid 9) raised ValueError: bad data", 4, SlurmJobEnvironment(slurm))
        is None
    )
    assert not (Path(spec.task_dir) / "attempts.json").exists() and spec.requeued == [] and slurm.calls == []

    retried = retry.after_failure(spec, "worker rank 0 (pid 9) killed by SIGKILL", 4, SlurmJobEnvironment(slurm))
    said = str(retried)
    assert "retried after SIGKILL of worker rank 0 on node n1 (1/1)" in said and "excluding n1" in said
    assert retried.exit_code == 75
    ((decision, step, by_scontrol),) = spec.requeued
    assert (decision.requeue, decision.reason, step, by_scontrol) == (True, "failure", 4, True)
    assert ["scontrol", "update", "jobid=7_0", "ExcNodeList=n1"] in slurm.calls
    (first,) = _failures(spec)
    assert (first["node"], first["retried"], first["excluded"], first["job_id"]) == ("n1", True, ["n1"], "7_0")

    # the second one is over launcher.max_failures=1: the task fails as before, and says why
    assert (
        retry.after_failure(spec, "worker rank 0 (pid 11) killed by SIGKILL", 6, SlurmJobEnvironment(FakeSlurm()))
        is None
    )
    assert len(spec.requeued) == 1
    newest = _failures(spec)[-1]
    assert newest["retried"] is False and "launcher.max_failures=1 used up" in newest["detail"]

    retry.renew(Path(spec.task_dir))  # resume=: the budget starts over, the records stay
    assert retry.after_failure(spec, "worker rank 0 (pid 12) killed by SIGBUS", 8, SlurmJobEnvironment(FakeSlurm()))
    assert len(spec.requeued) == 2 and len(_failures(spec)) == 3


def test_in_a_container_the_batch_script_is_asked_to_requeue(spec, monkeypatch, tmp_path):
    """Inside a container (no scontrol there) the task writes the request file its batch script acts on and
    ends with exit 76; the node is not excluded then."""
    from slurm_router.rundir.lifecycle import EXIT_REQUEUE
    from slurm_router.supervise.requeue import REQUEUE_REQUEST_ENV

    monkeypatch.setenv(REQUEUE_REQUEST_ENV, str(tmp_path / "requeue.json"))
    slurm = FakeSlurm()
    retried = retry.after_failure(spec, "worker rank 0 (pid 9) killed by SIGKILL", 4, SlurmJobEnvironment(slurm))
    assert retried.exit_code == EXIT_REQUEUE and spec.requeued[0][2] is False and slurm.calls == []
    assert "retried after SIGKILL" in json.loads((tmp_path / "requeue.json").read_text())["why"]
    assert _failures(spec)[0]["excluded"] == []


def test_no_retry_outside_slurm_or_for_a_colocated_task(spec, monkeypatch):
    from slurm_router.supervise.colocate import COLOCATED_ENV

    monkeypatch.setenv(COLOCATED_ENV, "1")  # a co-located task: a requeue would restart the other co-located tasks
    assert (
        retry.after_failure(spec, "worker rank 0 (pid 9) killed by SIGKILL", 4, SlurmJobEnvironment(FakeSlurm()))
        is None
    )
    monkeypatch.delenv(COLOCATED_ENV)
    monkeypatch.delenv("SLURM_JOB_ID")
    assert (
        retry.after_failure(spec, "worker rank 0 (pid 9) killed by SIGKILL", 4, SlurmJobEnvironment(FakeSlurm()))
        is None
    )
    assert spec.requeued == []


def test_node_fail_is_counted_once_at_the_next_start_and_refused_beyond_the_budget(spec, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    one = FakeSlurm("8|NODE_FAIL|n3|2024-01-01T10:00:00\n8|RUNNING|n1|2024-01-01T10:05:00\n")
    assert retry.count_node_failures(spec, SlurmJobEnvironment(one)) is None
    assert retry.count_node_failures(spec, SlurmJobEnvironment(one)) is None  # the same attempt is not counted twice
    (record,) = _failures(spec)
    assert record["detail"] == "retried after NODE_FAIL on node n3 (1/1)"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    two = FakeSlurm(one.sacct + "8|NODE_FAIL|n1|2024-01-01T10:05:00\n")
    refused = retry.count_node_failures(spec, SlurmJobEnvironment(two))
    assert refused and "NODE_FAIL on node n1" in refused and "launcher.max_failures=1" in refused
    assert f"resume={spec.run_dir}" in refused and "\n" not in refused
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")  # a first start asks nothing of sacct
    quiet = FakeSlurm()
    assert retry.count_node_failures(spec, SlurmJobEnvironment(quiet)) is None and quiet.calls == []


# ---------------------------------------------------------------- the real cluster

# r32 is a copy of r8 (the uninterrupted reference); `bad` fails with its own error at its first step (a single
# sample over its simulated memory cap). ~0.5 s steps, a checkpoint every 2.
SMALL = [
    "+experiment=lora_ab",
    "base.steps=10",
    "train.steps=12",
    "train.checkpoint_every=2",
    "train.eval_batches=2",
    "data.max_documents=60",
    "launcher.timeout_min=10",
    "variants.r32.model.lora.r=8",
    "variants.r32.model.lora.alpha=16",
    "+variants.bad.model.lora.r=8",
    "launcher.max_failures=1",
]
AIDS = {**slowdown("4"), **memory_cap("bad=1000")}


def _losses(task_dir: Path) -> dict[int, float]:
    rows = sorted((r for r in event_rows(task_dir) if r["event"] == "step"), key=lambda r: (r["attempt"], r["time"]))
    return {r["step"]: r["loss"] for r in rows}


def _wait(cond, what: str, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh")
def test_a_killed_worker_is_retried_once_and_an_own_error_never(tmp_path, base_cache):
    proc = run_cli(
        *SMALL,
        "launcher=sbatch",
        f"base.cache_dir={base_cache}",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        env=AIDS,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    tasks = {name: run_dir / "tasks" / name for name in ("r8", "r32", "bad")}
    jobs = {
        t["variant"]: t["job_id"]
        for j in json.loads((run_dir / "manifest.json").read_text())["jobs"]
        for t in j["tasks"]
    }
    try:
        _wait(lambda: sum(r["event"] == "step" for r in event_rows(tasks["r8"])) >= 3, "r8 at step 3")
        pid = next(r["pid"] for r in event_rows(tasks["r8"]) if r["event"] == "start")
        os.kill(pid, signal.SIGKILL)
        follow = run_cli(
            str(run_dir), "--follow", "--poll-s", "1", "--timeout-s", "400", module="slurm_router.status", timeout=500
        )
    finally:
        subprocess.run(["scancel", *set(j.split("_")[0] for j in jobs.values())], capture_output=True)
    assert follow.returncode == 1, follow.stdout[-2000:] + follow.stderr[-2000:]  # `bad` did not complete
    lines = follow.stdout.splitlines()
    assert all(line.startswith(("[r8", "[r32", "[bad")) for line in lines), lines[:5]
    assert any(line.startswith("[r8:err] warning: r8: worker rank 0") for line in lines), lines
    status = run_cli(str(run_dir), "--json", module="slurm_router.status", timeout=60)
    states = {t["task"]: t for t in json.loads(status.stdout)["tasks"]}

    # r8: requeued itself once (same array task), from its checkpoint, with the uninterrupted copy's losses
    r8 = states["r8"]
    assert (r8["state"], r8["job_id"], r8["attempts"], r8["step"], r8["steps"]) == ("COMPLETED", jobs["r8"], 2, 12, 12)
    assert r8["retry"] == "retried after SIGKILL of worker rank 0 on node vm (1/1)" and r8["retry"] in r8["reason"]
    (record,) = r8["retries"]
    assert (record["node"], record["retried"], record["excluded"]) == ("vm", True, [])
    assert record["exclude_note"] == "vm not excluded: no other node of partition debug can run it"
    rows = event_rows(tasks["r8"])
    requeue = [r for r in rows if r["event"] == "requeue"]
    assert len(requeue) == 1 and requeue[0]["reason"] == "failure" and requeue[0]["attempt"] == 0
    loaded = [r for r in rows if r["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["attempt"] == 1 and loaded[-1]["step"] >= 2
    assert len(_losses(tasks["r32"])) == 12 and _losses(tasks["r8"]) == _losses(tasks["r32"])
    err = (run_dir / "logs" / f"{jobs['r8']}.err").read_text()
    assert f"worker rank 0 (pid {pid}) killed by SIGKILL; retried after" in err
    assert not [line for line in err.splitlines() if line.startswith("error:")], err

    # bad: its worker raised; never retried, and status says how it failed
    bad = states["bad"]
    assert (bad["state"], bad["attempts"], bad["retries"], bad["requeues"]) == ("FAILED", 1, [], 0)
    assert "raised slurm_router.worker.microbatch.SimulatedOOM" in (run_dir / "logs" / f"{jobs['bad']}.err").read_text()


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh")
def test_a_requeued_array_task_gets_its_exclusion_from_slurm(monkeypatch):
    """The exclusion the retry sets after its requeue, against the real scontrol: an array task requeued while it
    ran is held again, and its ExcNodeList names the node (excluding the cluster's only node is what the retry
    never does; here the held task is cancelled at once)."""
    node = slurm_job.job_command(["sinfo", "-h", "-N", "-o", "%N"]).split()[0]
    job = (
        subprocess.run(
            ["sbatch", "--parsable", "--requeue", "--array=0", "-o", "/dev/null", "--wrap", "sleep 120"],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .split(";")[0]
    )
    try:
        _wait(
            lambda: "RUNNING" in slurm_job.job_command(["squeue", "-h", "-j", f"{job}_0", "-o", "%T"]),
            "the job to run",
            timeout=60,
        )
        monkeypatch.setenv("SLURM_ARRAY_JOB_ID", job)
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
        subprocess.run(["scontrol", "requeue", f"{job}_0"], check=True)
        assert retry.exclude_nodes([node], [], SlurmJobEnvironment()) == f"excluding {node}"
        assert f"ExcNodeList={node}" in slurm_job.job_command(["scontrol", "show", "job", f"{job}_0"])
    finally:
        subprocess.run(["scancel", job], capture_output=True)
