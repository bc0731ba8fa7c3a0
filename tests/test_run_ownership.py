"""One owner of a run's processes, one writer of its directory (issue 12, findings 1 and 2), with real processes:
kill -9 of the launcher leaves nothing of the run alive 10 s later (by the pids the run recorded) and resume=
finishes it with the uninterrupted run's losses; status tells a dead local run from a live one and --wait
returns; two resumes at once: one trains, the other exits 2 naming it; a stale lock is taken over with one line;
concurrent manifest writers never lose each other's fields."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import event_rows, pid_alive, read_json, run_cli, run_dir_of, slowdown, start_cli, wait_until

pytestmark = pytest.mark.integration

# Two workers, steps of ~0.5-1 s (SLOW), a checkpoint every 2 steps.
STEPS = 8
COMMON = [
    "base.enabled=false",
    f"train.steps={STEPS}",
    "train.checkpoint_every=2",
    "data.max_documents=60",
    "train.eval_batches=2",
    "launcher.cpu_slots=2",
    "resources.devices_per_task=2",
]
SLOW = slowdown("4")  # every command of a run here, resume= too


def losses(task_dir: Path) -> dict[int, float]:
    """Per step, the last attempt's loss (what the report keeps)."""
    rows = sorted((r for r in event_rows(task_dir) if r["event"] == "step"), key=lambda r: (r["attempt"], r["time"]))
    return {r["step"]: r["loss"] for r in rows}


def same_run(got: dict[int, float], want: dict[int, float]) -> bool:
    """The uninterrupted run's losses. Two workers route by measured speed, so the float reduction order (not
    the math) differs from run to run: the routing invariant's tolerance (tests/test_invariant.py)."""
    return sorted(got) == sorted(want) and all(got[s] == pytest.approx(want[s], rel=2e-5) for s in want)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, started at once (it overlaps the first test) and read when first needed."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = start_cli(*COMMON, f"run_root={tmp}", cwd=tmp, env=SLOW)
    cache = {}

    def get() -> dict[int, float]:
        if not cache:
            out, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, out[-2000:] + err[-2000:]
            cache.update(losses(run_dir_of(subprocess.CompletedProcess([], 0, out, err)) / "tasks" / "main"))
            assert sorted(cache) == list(range(STEPS))
        return cache

    yield get
    if proc.poll() is None:
        proc.kill()


def _run_dir(tmp_path: Path) -> Path | None:
    found = list(tmp_path.glob("default/*/manifest.json"))
    return found[0].parent if found else None


def _after_step(tmp_path: Path, step: int):
    """The run dir once both ranks have logged step `step` (checkpoint step-2 exists after step 1)."""

    def ready():
        run_dir = _run_dir(tmp_path)
        task = run_dir / "tasks" / "main" if run_dir else None
        return (
            run_dir
            if task
            and all(any(r["event"] == "step" and r["step"] >= step for r in event_rows(task, k)) for k in (0, 1))
            else None
        )

    return wait_until(ready, f"step {step} on both ranks")


def _recorded_pids(run_dir: Path) -> dict[str, int]:
    """What the run recorded: the launcher (manifest owner), the task's job process, each worker (start rows)."""
    manifest = read_json(run_dir / "manifest.json")
    task = run_dir / "tasks" / "main"
    pids = {"launcher": manifest["owner"]["pid"], "job": manifest["tasks"]["main"]["pid"]}
    for rank in (0, 1):
        pids[f"worker{rank}"] = [r for r in event_rows(task, rank) if r["event"] == "start"][-1]["pid"]
    return pids


def _status(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli(str(run_dir), *args, module="slurm_router.status", timeout=300)


def test_kill_9_of_the_launcher_leaves_nothing_alive_and_resume_finishes_the_run(tmp_path, reference):
    proc = start_cli(*COMMON, f"run_root={tmp_path}", cwd=tmp_path, env=SLOW)
    try:
        run_dir = _after_step(tmp_path, 2)
        pids = _recorded_pids(run_dir)
        assert pids["launcher"] == proc.pid
        # everything the launcher started, the multiprocessing resource tracker included
        tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert {pids["job"], pids["worker0"], pids["worker1"]} <= tree, (pids, tree)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and any(pid_alive(p) for p in tree):
        time.sleep(0.2)
    alive = {p: psutil.Process(p).cmdline() for p in tree if pid_alive(p)}
    assert not alive, f"alive 10 s after kill -9 of the launcher: {alive} (recorded: {pids})"

    # the job process recorded its own end: interrupted, exit 75, and why
    manifest = read_json(run_dir / "manifest.json")
    task = manifest["tasks"]["main"]
    assert manifest["state"] == "interrupted" and task["state"] == "interrupted" and task["exit_code"] == 75, task
    status = _status(run_dir, "--json")
    row = json.loads(status.stdout)["tasks"][0]
    assert row["terminal"] and row["state"] == "INTERRUPTED", row  # the run list says interrupted too
    assert f"launcher pid {pids['launcher']} gone" in row["reason"], row
    log = (run_dir / "logs" / "main.log").read_text()
    assert f"the launcher (pid {pids['launcher']}) is gone" in log and "Traceback" not in log, log

    resumed = run_cli(f"resume={run_dir}", cwd=tmp_path, env=SLOW, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    note = [line for line in resumed.stderr.splitlines() if "gone without releasing it" in line]
    assert len(note) == 1 and f"pid {pids['launcher']}" in note[0], resumed.stderr
    assert same_run(losses(run_dir / "tasks" / "main"), reference()), "resume after kill -9: not the uninterrupted run"
    assert read_json(run_dir / "manifest.json")["state"] == "completed"


def test_status_tells_a_dead_local_run_and_two_resumes_at_once_run_it_once(tmp_path, reference):
    proc = start_cli(*COMMON, f"run_root={tmp_path}", cwd=tmp_path, env=SLOW)
    try:
        run_dir = _after_step(tmp_path, 0)
        pids = _recorded_pids(run_dir)
        tree = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        for pid in tree:  # every process of the run at once: nothing is left to record anything
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_until(lambda: not any(pid_alive(p) for p in tree), "end of the killed processes", timeout=30)
    assert read_json(run_dir / "manifest.json")["tasks"]["main"]["state"] == "running"  # as it was left

    row = json.loads(_status(run_dir, "--json").stdout)["tasks"][0]
    assert row["state"] == "INTERRUPTED" and row["terminal"], row
    assert row["reason"] == f"interrupted: launcher pid {pids['launcher']} gone", row
    t0 = time.monotonic()
    waited = _status(run_dir, "--wait", "--poll-s", "1", "--timeout-s", "300")
    assert waited.returncode == 1 and time.monotonic() - t0 < 120, waited.stdout + waited.stderr
    assert "INTERRUPTED" in waited.stdout and "Traceback" not in waited.stdout + waited.stderr

    first, second = (start_cli(f"resume={run_dir}", cwd=tmp_path, env=SLOW) for _ in range(2))
    outs = {}
    try:
        for p in (first, second):
            outs[p.pid] = p.communicate(timeout=900)
    finally:
        for p in (first, second):
            if p.poll() is None:
                p.kill()
    codes = sorted((p.returncode, p.pid) for p in (first, second))
    assert [c for c, _ in codes] == [0, 2], {pid: (out[-1500:], err[-1500:]) for pid, (out, err) in outs.items()}
    winner, loser = codes[0][1], codes[1][1]
    errors = [line for line in outs[loser][1].splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"error: {run_dir} is in use by pid {winner} on "), errors
    assert f"resume={run_dir}" in errors[0] and f"kill {winner}" in errors[0], errors
    assert read_json(run_dir / "tasks" / "main" / "attempts.json")["attempts"] == 2  # the first run + the winner
    assert same_run(losses(run_dir / "tasks" / "main"), reference())


def test_status_cancel_stops_a_live_local_run_as_ctrl_c_does(tmp_path):
    proc = start_cli(*COMMON, f"run_root={tmp_path}", cwd=tmp_path, env=SLOW)
    try:
        run_dir = _after_step(tmp_path, 0)
        cancel = _status(run_dir, "--cancel")
        assert cancel.returncode == 0, cancel.stderr
        assert f"stopping the local run of pid {proc.pid} on " in cancel.stderr, cancel.stderr
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and f"resume={run_dir}" in out and "Traceback" not in out + err, out + err
    manifest = read_json(run_dir / "manifest.json")
    assert manifest["state"] == "interrupted" and manifest["tasks"]["main"]["exit_code"] == 75, manifest["tasks"]
    assert list((run_dir / "tasks" / "main" / "checkpoints").glob("step-*.pt")), "no checkpoint at the stop"
    again = _status(run_dir, "--cancel")  # nothing of it runs any more: nothing to stop
    assert "nothing to cancel" in again.stderr, again.stderr


HOLDER = textwrap.dedent("""
    import sys, time
    from slurm_router.rundir.lock import acquire
    acquire(sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
""")


def test_a_second_writer_is_refused_by_name_and_a_stale_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "manifest.json").write_text(json.dumps({"stages": [], "tasks": {}}))  # config.yaml missing
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = run_cli(f"resume={run_dir}", cwd=tmp_path, timeout=120)
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert refused.returncode == 2 and len(lines) == 1, refused.stderr
        assert lines[0].startswith(f"error: {run_dir} is in use by pid {holder.pid} on ") and "python" in lines[0]
        assert f"stop it with kill {holder.pid}" in lines[0], lines[0]
        holder.kill()
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    taken = run_cli(f"resume={run_dir}", cwd=tmp_path, timeout=120)
    lines = [line for line in taken.stderr.splitlines() if line.strip()]
    assert lines[0].startswith(f"note: {run_dir}: its last holder, pid {holder.pid} on ") and lines[0].endswith(
        "is gone without releasing it: taking it over"
    ), lines
    assert taken.returncode == 2 and lines[1:] == [f"error: resume={run_dir}: config.yaml is missing or damaged"], lines
    assert read_json(run_dir / "run.lock")["released"]  # a clean end says so: no note next time
    again = run_cli(f"resume={run_dir}", cwd=tmp_path, timeout=120)
    assert "note:" not in again.stderr and again.returncode == 2, again.stderr


WRITER = textwrap.dedent("""
    import sys
    from slurm_router.rundir.manifest import Manifest
    manifest = Manifest.load(sys.argv[1])
    for i in range(150):
        manifest.set_task(sys.argv[2], count=i)
""")


def test_concurrent_manifest_writers_never_lose_each_others_fields(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"stages": [], "tasks": {"a": {}, "b": {}}}))
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), name]) for name in "ab"]
    assert [w.wait(timeout=300) for w in writers] == [0, 0]
    tasks = read_json(tmp_path / "manifest.json")["tasks"]
    assert tasks == {"a": {"count": 149}, "b": {"count": 149}}

    from slurm_router.rundir.manifest import Manifest

    mine, theirs = Manifest.load(tmp_path), Manifest.load(tmp_path)
    theirs.set_task("b", pid=123)  # another process's field, after `mine` was read
    mine.data["tasks"]["a"]["state"] = "running"  # a change made in place, then saved whole
    mine.save()
    assert read_json(tmp_path / "manifest.json")["tasks"] == {
        "a": {"count": 149, "state": "running"},
        "b": {"count": 149, "pid": 123},
    }


@pytest.mark.slurm
@pytest.mark.skipif(
    shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first"
)
def test_two_resumes_of_a_slurm_run_at_once_submit_it_once(tmp_path):
    """The second resume= either finds the run in use (the first holds its lock while it submits) or, after,
    reads the first's jobs from the manifest and refuses while they are in Slurm: never a second submission."""
    small = [
        "base.enabled=false",
        "train.steps=2",
        "data.max_documents=60",
        "train.eval_batches=2",
        "launcher=sbatch",
        "launcher.timeout_min=10",
    ]
    first = run_cli(*small, f"run_root={tmp_path}", cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    run_dir = run_dir_of(first)
    try:
        assert _status(run_dir, "--cancel").returncode == 0
        _status(run_dir, "--wait", "--poll-s", "1", "--timeout-s", "120")
        resumes = [start_cli(f"resume={run_dir}", cwd=tmp_path) for _ in range(2)]
        outs = [p.communicate(timeout=300) for p in resumes]
        codes = [p.returncode for p in resumes]
        assert sorted(codes) == [0, 2], outs
        err = outs[codes.index(2)][1]
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and ("is in use by pid" in errors[0] or "still in Slurm" in errors[0]), err
        jobs = read_json(run_dir / "manifest.json")["jobs"]
        assert len(jobs) == 2, jobs  # the run's own array job and one resubmission
        from slurm_router.backends.slurm.queries import query_slurm

        squeue, _ = query_slurm(jobs[0]["job_id"] + "," + jobs[1]["job_id"])
        live = {k: r.state for k, r in squeue.items() if r.state in ("PENDING", "RUNNING")}
        assert all(k.startswith(jobs[1]["job_id"]) for k in live), live
        third = run_cli(f"resume={run_dir}", cwd=tmp_path, timeout=300)  # after: the manifest names them
        assert third.returncode == 2 and "still in Slurm" in third.stderr, third.stdout + third.stderr
    finally:
        _status(run_dir, "--cancel")
