"""Never lose work, on the real single-node Slurm cluster: requeues, preemption signals and a dead worker.

One lora_ab run per Slurm launcher, with extra variants configured exactly like r8 so that one array job
holds both the interrupted tasks and their uninterrupted reference (same config, same thread count: the
per-step losses must match bitwise):
- launcher=sbatch: r8 is requeued by an operator (`scontrol requeue`: SIGTERM, Slurm requeues); u2 gets USR2
  (`scancel --batch --signal=USR2`, what --signal=B:USR2@N sends before the time limit: the task checkpoints
  and runs `scontrol requeue` itself); k loses a worker to SIGKILL (the task fails fast with one line), its
  newest checkpoint is then damaged and the failed task is requeued: it resumes from the previous one.
- launcher=slurm: r8 gets USR2 on its job step (`scancel --signal=USR2`): submitit calls checkpoint(),
  the workers save, submitit requeues.

    sudo scripts/slurm_test_cluster.sh && pytest -m slurm tests/test_requeue_slurm.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_cli, run_dir_of, slowdown

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first"
    ),
]

# r32 becomes a copy of r8 (the uninterrupted reference); u2 and k are more copies. ~0.5 s steps.
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
]
SLOW = slowdown("4")
COPIES = ["+variants.u2.model.lora.r=8", "+variants.k.model.lora.r=8"]
TIMEOUT_S = 240


def _rows(run_dir: Path, task: str) -> list[dict]:
    path = run_dir / "tasks" / task / "events-rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.is_file() else []


def _losses(run_dir: Path, task: str) -> dict[int, float]:
    out = {}
    for r in sorted((r for r in _rows(run_dir, task) if r["event"] == "step"), key=lambda r: (r["attempt"], r["time"])):
        out[r["step"]] = r["loss"]
    return out


def _task_jobs(run_dir: Path) -> dict[str, str]:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return {t["variant"]: t["job_id"] for job in manifest["jobs"] for t in job["tasks"]}


def _squeue(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True).stdout.strip()


def _sacct_state(job_id: str) -> str:
    out = subprocess.run(
        ["sacct", "-X", "-n", "--parsable2", "-o", "JobID,State", "-j", job_id], capture_output=True, text=True
    ).stdout
    return next((l.split("|")[1] for l in out.splitlines() if l.split("|")[0] == job_id), "")


_PENDING_SINCE: dict[str, float] = {}


def _release_requeued(job_ids: list[str]) -> None:
    """A requeued job waits cred_expire seconds (scripts/slurm_test_cluster.sh sets 5; Slurm's default is 120)
    so that its previous run has ended everywhere. On a cluster with the default, start it after 20 s instead:
    sooner would race the end of the previous run (Slurm would count its exit against the new one)."""
    for job in job_ids:
        if _squeue(job) != "PENDING BeginTime":
            _PENDING_SINCE.pop(job, None)
        elif time.time() - _PENDING_SINCE.setdefault(job, time.time()) > 20:
            subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], capture_output=True)


def _wait(cond, requeued: list[str], what: str, timeout: float = TIMEOUT_S):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        _release_requeued(requeued)
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _at_step(run_dir: Path, task: str, step: int):
    rows = _rows(run_dir, task)
    return rows if any(r["event"] == "step" and r["step"] >= step for r in rows) else None


def _submit(tmp_path: Path, base_cache: Path, *args: str, env: dict = SLOW) -> Path:
    proc = run_cli(
        *SMALL, *args, f"base.cache_dir={base_cache}", f"run_root={tmp_path}", cwd=tmp_path, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir_of(proc)


def _assert_resumed_exactly(run_dir: Path, task: str, reason: str) -> None:
    rows = _rows(run_dir, task)
    requeue = [r for r in rows if r["event"] == "requeue"]
    assert requeue and requeue[0]["reason"] == reason, requeue
    loaded = [r for r in rows if r["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["attempt"] >= 1, "the requeued task did not resume from its checkpoint"
    assert any(r["event"] == "end" and r["exit_state"] == "completed" and r["attempt"] >= 1 for r in rows)
    assert _losses(run_dir, task) == _losses(run_dir, "r32"), f"{task}: losses differ from the uninterrupted run"


def test_sbatch_requeue_usr2_and_dead_worker(tmp_path, base_cache):
    run_dir = _submit(tmp_path, base_cache, "launcher=sbatch", *COPIES)
    jobs = _task_jobs(run_dir)
    for task in ("r8", "u2", "k"):
        _wait(lambda: _at_step(run_dir, task, 3), [], f"{task} at step 3")
    k_pid = next(r["pid"] for r in _rows(run_dir, "k") if r["event"] == "start")
    subprocess.run(["scontrol", "requeue", jobs["r8"]], check=True)
    subprocess.run(["scancel", "--batch", "--signal=USR2", jobs["u2"]], check=True)
    t_kill = time.time()
    os.kill(k_pid, signal.SIGKILL)

    # the dead worker: the task fails within seconds with one line naming the rank and the signal
    _wait(lambda: _sacct_state(jobs["k"]) == "FAILED", [], "k to fail", timeout=60)
    assert time.time() - t_kill < 60
    err = (run_dir / "logs" / f"{jobs['k']}.err").read_text()
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"worker rank 0 (pid {k_pid}) killed by SIGKILL" in lines[0], err
    assert _rows(run_dir, "k")[-1]["exit_state"] == "failed"
    # ... its newest checkpoint is damaged, and the failed task is requeued: it falls back to the previous one
    ckpts = sorted((run_dir / "tasks" / "k" / "checkpoints").glob("step-*.pt"))
    ckpts[-1].write_bytes(ckpts[-1].read_bytes()[:100])
    subprocess.run(["scontrol", "requeue", jobs["k"]], check=True)

    requeued = [jobs["r8"], jobs["u2"], jobs["k"]]
    done = lambda: all((run_dir / "tasks" / t / "result.json").is_file() for t in ("r8", "r32", "u2", "k"))
    _wait(done, requeued, "every task to complete")
    _wait(
        lambda: all(_sacct_state(jobs[t]) == "COMPLETED" for t in ("r8", "r32", "u2", "k")),
        requeued,
        "sacct COMPLETED",
        timeout=60,
    )

    assert len(_losses(run_dir, "r32")) == 12
    _assert_resumed_exactly(run_dir, "r8", "slurm")  # Slurm requeued it; the next attempt says so
    _assert_resumed_exactly(run_dir, "u2", "preempted")  # USR2 long before the limit: a preemption
    u2_log = (run_dir / "logs" / f"{jobs['u2']}.out").read_text()
    assert "requeued" in u2_log and "resuming from" in u2_log
    k_log = (run_dir / "logs" / f"{jobs['k']}.err").read_text()
    assert f"{ckpts[-1].name} is not usable" in k_log
    assert f"resuming from {ckpts[-2]}" in (run_dir / "logs" / f"{jobs['k']}.out").read_text()
    assert _losses(run_dir, "k") == _losses(run_dir, "r32")


def test_submitit_usr2_checkpoints_and_requeues(tmp_path, base_cache):
    run_dir = _submit(tmp_path, base_cache, "launcher=slurm")
    jobs = _task_jobs(run_dir)
    _wait(lambda: _at_step(run_dir, "r8", 3), [], "r8 at step 3")
    subprocess.run(["scancel", "--signal=USR2", jobs["r8"]], check=True)  # to the job step: submitit's signal
    done = lambda: all((run_dir / "tasks" / t / "result.json").is_file() for t in ("r8", "r32"))
    _wait(done, [jobs["r8"]], "both tasks to complete")
    _assert_resumed_exactly(run_dir, "r8", "preempted")
    saved = [r for r in _rows(run_dir, "r8") if r["event"] == "checkpoint_saved" and r["reason"] == "signal"]
    assert saved and saved[0]["attempt"] == 0


@pytest.mark.parametrize("launcher", ["slurm", "sbatch"])
def test_resume_resubmits_only_the_unfinished_task(tmp_path, base_cache, launcher):
    """A cancelled task (no requeue: an operator's scancel) is submitted again by resume=RUN_DIR, alone, into
    the same run dir; it continues from its checkpoint and ends with the uninterrupted copy's losses. While the
    run's jobs are still in Slurm, resume refuses (one line, exit 2), here or on Slurm, rather than run a task
    twice at once."""
    run_dir = _submit(tmp_path, base_cache, f"launcher={launcher}")
    jobs = _task_jobs(run_dir)
    for here in ([], ["launcher=local"]):
        early = run_cli(f"resume={run_dir}", *here, cwd=tmp_path, timeout=120)
        assert early.returncode == 2 and "still in Slurm" in early.stderr, early.stdout + early.stderr
        assert len(early.stderr.strip().splitlines()) == 1, early.stderr

    _wait(lambda: _at_step(run_dir, "r32", 3), [], "r32 at step 3")
    subprocess.run(["scancel", jobs["r32"]], check=True)
    _wait(
        lambda: _sacct_state(jobs["r32"]).startswith("CANCELLED") and _sacct_state(jobs["r8"]) == "COMPLETED",
        [],
        "r32 cancelled and r8 completed",
    )
    assert not (run_dir / "tasks" / "r32" / "result.json").exists()

    proc = run_cli(f"resume={run_dir}", cwd=tmp_path, env=SLOW, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "r8 completed" in proc.stdout and "r32 from step" in proc.stdout, proc.stdout
    assert run_dir_of(proc) == run_dir
    manifest = json.loads((run_dir / "manifest.json").read_text())
    again = manifest["jobs"][-1]
    assert [t["variant"] for t in again["tasks"]] == ["r32"] and manifest["resumed"] == 1
    if launcher == "sbatch":  # only r32's array index, so the index still names the same task
        assert re.search(r"^#SBATCH --array=1(%\d+)?$", (run_dir / "submit-resume1.sbatch").read_text(), re.M)
        assert again["tasks"][0]["job_id"] == f"{again['job_id']}_1"

    status = run_cli(str(run_dir), "--wait", "--poll-s", "1", "--json", module="slurm_router.status", timeout=TIMEOUT_S)
    assert status.returncode == 0, status.stdout[-3000:] + status.stderr[-2000:]
    states = {t["variant"]: (t["job_id"], t["state"]) for t in json.loads(status.stdout)["tasks"]}
    assert states.pop("base", ("", "COMPLETED"))[1] in ("COMPLETED", "CACHED")  # trained here or cached
    assert states == {"r8": (jobs["r8"], "COMPLETED"), "r32": (again["tasks"][0]["job_id"], "COMPLETED")}
    assert json.loads((run_dir / "tasks" / "r8" / "attempts.json").read_text())["attempts"] == 1, "r8 ran again"
    loaded = [r for r in _rows(run_dir, "r32") if r["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["attempt"] >= 1, "the resubmitted task did not continue from its checkpoint"
    assert _losses(run_dir, "r32") == _losses(run_dir, "r8"), "resumed losses differ from the uninterrupted run"
    summary = run_dir / "report" / "summary.json"
    _wait(
        lambda: summary.is_file() and json.loads(summary.read_text())["variants"].get("r32", {}).get("val_loss"),
        [],
        "the resubmitted report job",
        timeout=120,
    )
