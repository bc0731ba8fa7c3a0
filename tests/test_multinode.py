"""One task across two nodes, on the real multi-node Slurm test cluster (scripts/slurm_multinode_cluster.sh:
slurmd mn1 and mn2, each in its own network namespace, partition mn; clients pick it with SLURM_CONF).
launcher.srun_workers=true resources.devices_per_task=2 resources.nodes_per_task=2, one srun task per node
(issue 16; launcher=sbatch, and launcher=slurm for the balanced-router test):
- the two ranks train with gloo across the namespaces and match the same task on one device, step by step;
- USR2 mid-run: both ranks stop after the same step, one checkpoint, the task requeues itself and ends with the
  uninterrupted copy's losses;
- the worker on mn2 is SIGKILLed: rank 0 on mn1 stops within seconds, the task fails naming the rank, and
  resume=RUN_DIR finishes it.

    sudo scripts/slurm_test_cluster.sh && sudo scripts/slurm_multinode_cluster.sh --nodes 2
    pytest -m slurm tests/test_multinode.py -s        # -s prints the per-step losses side by side
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
from conftest import run_cli, run_dir_of, slowdown, wait_until

from slurm_router.supervise.srun_worker import wait_for_master
from slurm_router.supervise.supervisor import TaskFailed


def cluster_test(fn):
    """A real run on the multi-node cluster (the mn_env fixture skips it unless the cluster is up)."""
    return pytest.mark.slurm(
        pytest.mark.timeout(func_only=True)(  # the mn_env fixture's wait for the cluster is not the test's time
            pytest.mark.skipif(
                shutil.which("sbatch") is None,
                reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first",
            )(fn)
        )
    )


MN_CONF = Path("/etc/slurm-multinode/slurm.conf")
MN_LOCK = Path(tempfile.gettempdir()) / "slurm_router-mn-cluster.lock"
NODES = 2
# Fast settings (tests/test_slurm_launch.py); 12 steps so that a signal lands mid-run.
SMALL = [
    "base.enabled=false",
    "train.steps=12",
    "train.checkpoint_every=4",
    "train.eval_batches=1",
    "data.max_documents=40",
]
# One worker per node (resources.nodes_per_task): 2 fake GPUs per node would otherwise fit both on mn1.
TWO_NODES = [
    "launcher.srun_workers=true",
    "resources.devices_per_task=2",
    f"resources.nodes_per_task={NODES}",
    "launcher.partition=mn",
    "launcher.timeout_min=10",
]
TIMEOUT_S = 240


@pytest.fixture
def mn_env() -> Iterator[dict[str, str]]:
    """The environment that points Slurm's clients at the multi-node cluster (skips unless it is up), held by this
    test alone: tests that set a node down, stop the controller or preempt jobs (test_slurm_node_lost.py,
    test_slurm_controller_restart.py, test_slurm_preempt.py) would disturb another test's jobs there, and pytest-xdist
    runs test files side by side. An exclusive flock; its wait is not counted in the test's time limit (cluster_test:
    func_only)."""
    with MN_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield _mn_cluster_env()  # asked once the lock is held: never while another test holds a node down


@functools.cache
def _mn_cluster_env() -> dict[str, str]:
    if not MN_CONF.is_file():
        pytest.skip(f"no {MN_CONF}: run scripts/slurm_multinode_cluster.sh --nodes 2 (root) first")
    env = {"SLURM_CONF": str(MN_CONF)}
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-p", "mn", "-o", "%t %D"],
            capture_output=True,
            text=True,
            timeout=20,
            env={**os.environ, **env},
        ).stdout
    except subprocess.TimeoutExpired:
        pytest.skip("the multi-node cluster's slurmctld does not answer: run scripts/slurm_multinode_cluster.sh")
    usable = sum(
        int(n)
        for state, n in (l.split() for l in out.splitlines() if l.strip())
        if state.rstrip("*~#") in ("idle", "mix", "alloc")
    )
    if usable < NODES:
        pytest.skip(f"partition mn has {usable} usable nodes, not {NODES}: sinfo says {out.strip()!r}")
    return env


def _slurm(env: dict, *argv: str) -> str:
    return subprocess.run(list(argv), capture_output=True, text=True, env={**os.environ, **env}, timeout=60).stdout


def _rows(task_dir: Path, rank: int = 0) -> list[dict]:
    path = task_dir / f"events-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.is_file() else []


def _losses(task_dir: Path) -> dict[int, float]:
    """step -> loss, the newest attempt's value for each step (a resumed task repeats none)."""
    out = {}
    for r in sorted((r for r in _rows(task_dir) if r["event"] == "step"), key=lambda r: (r["attempt"], r["time"])):
        out[r["step"]] = r["loss"]
    return out


def _task_jobs(run_dir: Path) -> dict[str, str]:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return {t["variant"]: t["job_id"] for job in manifest["jobs"] for t in job["tasks"]}


def _sacct_state(env: dict, job_id: str) -> str:
    out = _slurm(env, "sacct", "-X", "-n", "--parsable2", "-o", "JobID,State", "-j", job_id)
    return next((l.split("|")[1] for l in out.splitlines() if l.split("|")[0] == job_id), "")


def _still_in_slurm(env: dict, run_dir: Path) -> list:
    """The run's tasks that Slurm still holds (what resume= refuses on: slurm_status.live_tasks), on this cluster."""
    from slurm_router.backends.slurm.queries import live_tasks

    def runner(argv: list[str]) -> str:
        proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
        return proc.stdout if proc.returncode == 0 else ""

    return live_tasks(json.loads((run_dir / "manifest.json").read_text()), runner)


def _wait(cond, what: str, timeout: float = TIMEOUT_S, poll_s: float = 0.2):
    return wait_until(cond, what, timeout=timeout, poll_s=poll_s)


def _at_step(task_dir: Path, step: int) -> bool:
    return any(r["event"] == "step" and r["step"] >= step for r in _rows(task_dir))


def _submit(tmp_path: Path, env: dict, *args: str, launcher: str = "sbatch") -> Path:
    proc = run_cli(
        *SMALL,
        f"launcher={launcher}",
        *TWO_NODES,
        *args,
        f"run_root={tmp_path / 'mn'}",
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir_of(proc)


def _hosts(task_dir: Path, attempt: int = 0) -> dict[int, str]:
    """rank -> the host its worker started on in that attempt."""
    return {
        rank: next(r["host"] for r in _rows(task_dir, rank) if r["event"] == "start" and r["attempt"] == attempt)
        for rank in range(NODES)
    }


@cluster_test
def test_two_node_task_matches_one_device_and_requeues_on_usr2(tmp_path, mn_env):
    """`ref` and `u2` are the same 2-node task (two array tasks, both spanning mn1+mn2); `u2` gets USR2 at step 3."""
    run_dir = _submit(tmp_path, mn_env, "+variants.ref.seed=0", "+variants.u2.seed=0")
    jobs = _task_jobs(run_dir)
    ref, u2 = run_dir / "tasks" / "ref", run_dir / "tasks" / "u2"
    _wait(lambda: _at_step(u2, 3), "u2 at step 3")
    subprocess.run(["scancel", "--signal=USR2", jobs["u2"]], check=True, env={**os.environ, **mn_env})  # the srun tasks

    # the same task on one device, while the two-node run goes on
    local = run_cli(
        *SMALL,
        "launcher=local",
        "resources.devices_per_task=1",
        f"run_root={tmp_path / 'local'}",
        cwd=tmp_path,
        timeout=300,
    )
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    one_device = _losses(run_dir_of(local) / "tasks" / "main")

    _wait(lambda: all((t / "result.json").is_file() for t in (ref, u2)), "both tasks to complete")
    _wait(
        lambda: all(_sacct_state(mn_env, jobs[t]) == "COMPLETED" for t in ("ref", "u2")), "sacct COMPLETED", timeout=60
    )

    # one worker per node, gloo across the namespaces, the invariant across nodes
    assert _hosts(ref) == {0: "mn1", 1: "mn2"}
    two_nodes = _losses(ref)
    print("\nstep  2 nodes (mn1+mn2)    1 device")
    for step in sorted(one_device):
        print(f"{step:4d}  {two_nodes.get(step)!r:20}  {one_device[step]!r}")
    assert sorted(two_nodes) == sorted(one_device) == list(range(12))
    assert two_nodes == pytest.approx(one_device, rel=1e-5)

    # USR2: both ranks stopped after the same step, one checkpoint for it, a requeue, the uninterrupted losses
    rows = _rows(u2)
    stopped = [r for r in rows if r["event"] == "checkpoint_saved" and r["reason"] == "signal"]
    assert len(stopped) == 1 and stopped[0]["attempt"] == 0, stopped
    for rank in range(NODES):
        rank_rows = _rows(u2, rank)
        last = max(r["step"] for r in rank_rows if r["event"] == "step" and r["attempt"] == 0)
        assert last == stopped[0]["step"] - 1, f"rank {rank} stopped after step {last}, not {stopped[0]['step'] - 1}"
        loaded = [r for r in rank_rows if r["event"] == "checkpoint_loaded"]
        assert [(r["attempt"], r["step"]) for r in loaded] == [(1, stopped[0]["step"])], (rank, loaded)
    requeue = [r for r in rows if r["event"] == "requeue"]
    assert requeue and requeue[0]["reason"] == "preempted", requeue
    assert _hosts(u2, attempt=1) == {0: "mn1", 1: "mn2"}
    assert 0 < stopped[0]["step"] < 12, "the signal did not land mid-run"
    # every rank planned every step alike (separate processes: nothing rank-local may reach the router)
    for task in (ref, u2):
        plans = [
            {(r["attempt"], r["step"]): r["planned_cost"] for r in _rows(task, rank) if r["event"] == "step"}
            for rank in range(NODES)
        ]
        assert plans[0] == plans[1], f"{task.name}: the ranks' plans differ"
    # equal up to float reduction order: router=balanced splits each batch by measured (timing-noisy) speeds
    assert _losses(u2) == pytest.approx(two_nodes, rel=1e-5), "u2's losses differ from the uninterrupted run"
    assert "requeued" in (run_dir / "logs" / f"{jobs['u2']}.out").read_text()


@cluster_test
@pytest.mark.parametrize("killed", [1, 0], ids=["rank1_on_mn2", "rank0_on_mn1"])
def test_killed_worker_on_one_node_fails_fast_and_resume_finishes(tmp_path, mn_env, killed):
    """SIGKILL to one rank's worker, in its node's network namespace: the other rank stops at once (no
    collective time-out), the task fails naming the rank and node (rank 0 records it; when rank 0 is the one
    killed, rank 1 does), and resume=RUN_DIR finishes it from its checkpoint."""
    run_dir = _submit(tmp_path, mn_env)
    job = _task_jobs(run_dir)["main"]
    task = run_dir / "tasks" / "main"
    _wait(lambda: _at_step(task, 5), "main at step 5")
    node, address = f"mn{killed + 1}", f"10.231.0.{11 + killed}"
    start = next(r for r in _rows(task, killed) if r["event"] == "start")
    in_node = subprocess.run(
        ["ip", "netns", "pids", f"slmn-n{killed + 1}"], capture_output=True, text=True
    ).stdout.split()
    assert start["host"] == node and str(start["pid"]) in in_node, (start, in_node)
    t_kill = time.time()
    os.kill(start["pid"], signal.SIGKILL)

    _wait(
        lambda: _sacct_state(mn_env, job) in ("FAILED", "CANCELLED", "COMPLETED"),
        "the task to end",
        timeout=120,
        poll_s=0.1,
    )
    seconds = time.time() - t_kill
    print(f"\nkilled rank {killed} on {node}; the task ended {seconds:.1f} s later ({_sacct_state(mn_env, job)})")
    assert seconds < 60, f"the task took {seconds:.0f} s to end after its worker on {node} was killed"
    assert _sacct_state(mn_env, job) == "FAILED"
    _wait(lambda: any(r["event"] == "end" for r in _rows(task)), "the end row", timeout=30)
    end = [r for r in _rows(task) if r["event"] == "end"]
    assert len(end) == 1 and end[0]["exit_state"] == "failed", end
    assert f"worker rank {killed} on {node} ({address}) was lost" in end[0]["error"], end
    errors = [l for l in (run_dir / "logs" / f"{job}.err").read_text().splitlines() if l.startswith("error:")]
    assert errors == [f"error: {end[0]['error']}"], errors
    assert not (task / "result.json").exists()

    # sacct says FAILED while squeue may still hold the job COMPLETING (its nodes cleaning up; seconds on a loaded
    # machine), and resume= rightly refuses a run with a task still in Slurm: wait for Slurm to let it go first,
    # as `status --wait` does for a user
    _wait(lambda: not _still_in_slurm(mn_env, run_dir), "the failed job to leave Slurm's queue", timeout=120)
    proc = run_cli(f"resume={run_dir}", cwd=tmp_path, env=mn_env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = run_cli(
        str(run_dir), "--wait", "--poll-s", "1", "--json", module="slurm_router.status", env=mn_env, timeout=TIMEOUT_S
    )
    assert status.returncode == 0, status.stdout[-3000:] + status.stderr[-2000:]
    states = {t["variant"]: t["state"] for t in json.loads(status.stdout)["tasks"]}
    assert states == {"main": "COMPLETED"}, states
    loaded = [r for r in _rows(task) if r["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["attempt"] == 1 and loaded[-1]["step"] > 0, loaded
    assert _hosts(task, attempt=1) == {0: "mn1", 1: "mn2"}
    assert sorted(_losses(task)) == list(range(12)) and (task / "result.json").is_file()


def _balance(task_dir: Path, first: int) -> dict[str, float]:
    """Means over steps >= first of rank 0's step rows: the learned speed of device 1 over device 0, the
    cost-balance ratio (max / mean planned cost: 1.0 for equal shares, 4/3 for a 2:1 split) and the time
    balance (the slowest device's busy time over the fastest's)."""
    steps = [r for r in _rows(task_dir) if r["event"] == "step" and r["step"] >= first]
    mean = lambda xs: round(sum(xs) / len(xs), 3)
    return {
        "speed_ratio": mean([r["speed"][1] / r["speed"][0] for r in steps]),
        "cost_balance": mean([r["cost_balance_ratio"] for r in steps]),
        "time_balance": mean([max(r["busy_s_all"]) / min(r["busy_s_all"]) for r in steps]),
    }


@cluster_test
def test_balanced_router_learns_a_slow_node(tmp_path, mn_env):
    """router=balanced with device 1 (rank 1, on mn2) 3x slow: across the nodes it learns the speeds and
    splits the cost as it does on one node (launcher=local, 2 workers). Submitted with launcher=slurm
    (submitit: nodes=2, tasks_per_node=1); the other tests here use launcher=sbatch.

    The signal is sized for a loaded machine (scripts/test.sh runs 4 test files at once on 2 cores): the
    robust speed model keeps a difference only as far as it stands out of the steps' noise, and a 2x device
    on 16-sample steps (~80 ms of compute) read 0.72 instead of 0.55 once under that load. A 3x device, measured
    in 5 runs (32- and 48-sample steps, quiet or beside 4-6 busy processes): 0.30-0.41 across the nodes,
    0.21-0.36 on one."""
    slow = [
        "router=balanced",
        "train.global_batch_size=32",
        "train.steps=16",
        "train.checkpoint_every=0",
    ]
    run_dir = _submit(tmp_path, {**mn_env, **slowdown("1,3")}, *slow, launcher="slurm")
    task = run_dir / "tasks" / "main"
    _wait(lambda: (task / "result.json").is_file(), "the 2-node task to complete")
    assert _hosts(task) == {0: "mn1", 1: "mn2"}
    local = run_cli(
        *SMALL,
        *slow,
        "launcher=local",
        "resources.devices_per_task=2",
        "launcher.cpu_slots=2",
        f"run_root={tmp_path / 'local'}",
        cwd=tmp_path,
        env=slowdown("1,3"),
        timeout=300,
    )
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    two_nodes, one_node = _balance(task, first=5), _balance(run_dir_of(local) / "tasks" / "main", first=5)
    print(f"\nfrom step 5 on: 2 nodes {two_nodes}\n                1 node  {one_node}")
    for where, b in (("2 nodes", two_nodes), ("1 node", one_node)):
        assert b["speed_ratio"] < 0.6, (where, b)  # learned: device 1 is slower (equal speeds read 1.0)
        assert b["cost_balance"] > 1.3, (where, b)  # so it gets well under half the cost (3:1 reads 1.5)
    # as on one node: 1.42-1.54 across the nodes, 1.48-1.66 on one (the same 5 runs)
    assert abs(two_nodes["cost_balance"] - one_node["cost_balance"]) < 0.3, (two_nodes, one_node)


def test_who_records_the_end_when_a_peer_is_lost(monkeypatch):
    """Rank 0 records a lost peer; when rank 0's node is the one lost, the lowest rank on another node does."""
    from slurm_router.supervise.srun_worker import _speaks_for_the_task

    monkeypatch.setenv("SLURM_JOB_ID", "1")  # inside a Slurm job: its job environment gives the task count
    monkeypatch.setenv("SLURM_JOB_ID", "123")  # a Slurm job (scheduler/registry.py job_environment) of 4 workers
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert _speaks_for_the_task(0, [2, 3])
    assert [r for r in range(1, 4) if _speaks_for_the_task(r, [0, 1])] == [2]
    assert [r for r in range(1, 4) if _speaks_for_the_task(r, [2, 3])] == []
    assert [r for r in range(1, 4) if _speaks_for_the_task(r, [])] == []  # a peer on this node: rank 0 says


def test_unreachable_meeting_point_is_one_line_naming_address_and_port():
    """Item 3 of issue 16: a rank that cannot reach rank 0 says where it tried, within a time-out."""
    t0 = time.monotonic()
    with pytest.raises(TaskFailed) as e:
        wait_for_master("127.0.0.1:1", "main: rank 1", timeout_s=1)  # nothing listens on port 1
    assert time.monotonic() - t0 < 30
    msg = str(e.value)
    assert msg.startswith("main: rank 1: cannot reach rank 0 at 127.0.0.1:1 within 1 s") and "\n" not in msg, msg


def test_rendezvous_timeout_is_set_through_the_environment(tmp_path):
    """SLURM_ROUTER_RENDEZVOUS_TIMEOUT_S (read when the worker module is imported): rank 1 of an srun_workers task,
    started as the batch script's srun line starts it, gives up on a meeting point nobody listens at after that
    many seconds (the default is 120), with one line naming the address, the port and the time-out."""
    import shlex
    import socket
    import sys

    proc = run_cli(
        "base.enabled=false",
        "launcher=sbatch",
        "launcher.dry_run=true",
        "launcher.srun_workers=true",
        "resources.devices_per_task=2",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run_dir = run_dir_of(proc)
    srun = next(l for l in (run_dir / "submit.sbatch").read_text().splitlines() if l.startswith("srun "))
    argv = shlex.split(srun)
    command = argv[next(i for i, a in enumerate(argv) if i > 0 and not a.startswith("-")) :]  # after srun's options
    assert command[0] == sys.executable and "--run-dir" in command, command
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank1 = {
        **os.environ,
        "PYTHONPATH": str(run_dir / "code"),
        "SLURM_JOB_ID": "1",
        "SLURM_ARRAY_TASK_ID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "SLURM_ROUTER_RENDEZVOUS_TIMEOUT_S": "4",
    }
    t0 = time.monotonic()
    worker = subprocess.run(command, cwd=run_dir, env=rank1, capture_output=True, text=True, timeout=100)
    took = time.monotonic() - t0
    assert worker.returncode == 1, worker.stdout[-2000:] + worker.stderr[-2000:]
    errors = [l for l in worker.stderr.splitlines() if l.strip()]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: main: rank 1: cannot reach rank 0 at 127.0.0.1:{port} within 4 s"
    ), worker.stderr
    assert 4 <= took < 60, f"gave up after {took:.1f} s"  # 4 s of trying (and start-up), not 120
