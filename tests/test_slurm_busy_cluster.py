"""A busy controller, on the real single-node Slurm test cluster (scripts/slurm_test_cluster.sh): stand-ins on the
PATH answer "Socket timed out on send/recv operation" to the first calls of sbatch, squeue and sacct, then run the
real command. Each run ends with every variant's result and every job submitted once.

pytest tests/test_slurm_busy_cluster.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, run_dir_of, slowdown, wait_until

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first"
    ),
]

SMALL = [
    "+experiment=lora_ab",
    "base.steps=8",
    "train.steps=4",
    "train.eval_batches=2",
    "data.max_documents=60",
    "launcher.wait=true",
    "launcher.timeout_min=10",
]
TIMED_OUT = "Socket timed out on send/recv operation"


def stand_in(bin_dir: Path, name: str, fail_first: int, submit_then_fail: bool = False) -> Path:
    """`name` on the PATH: its first fail_first calls answer TIMED_OUT (exit 1) without reaching Slurm, or, with
    submit_then_fail, after the real command ran (a job queued whose reply was lost); then the real command. Every
    job id the real sbatch printed is appended to the returned file."""
    real, count, submitted = shutil.which(name), bin_dir / f"{name}.count", bin_dir / f"{name}.submitted"
    run_real = f'out=$("{real}" "$@"); rc=$?; echo "$out"; [ {name} = sbatch ] && echo "$out" >> "{submitted}"'
    fail = f'echo "{name}: error: Batch job submission failed: {TIMED_OUT}" >&2; exit 1'
    script = bin_dir / name
    script.write_text(
        "#!/bin/bash\n"
        f'n=$(cat "{count}" 2>/dev/null || echo 0); echo $((n+1)) > "{count}"\n'
        f'if [ "$n" -lt {fail_first} ]; then {run_real + "; " if submit_then_fail else ""}{fail}; fi\n'
        f"{run_real}; exit $rc\n"
    )
    script.chmod(0o755)
    return submitted


def env_with(bin_dir: Path) -> dict:
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_ROUTER_SLURM_RETRY_S": "0.5"}


def job_ids_of(run_dir: Path) -> list[str]:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return [j["job_id"] for j in manifest["jobs"]] + [manifest["report_job_id"]]


def results(run_dir: Path) -> list[str]:
    return sorted(p.parent.name for p in run_dir.glob("tasks/*/result.json"))


def submitted_ids(path: Path) -> list[str]:
    return [line.split(";")[0].split()[-1] for line in path.read_text().split("\n") if line.strip()]


def test_sbatch_squeue_sacct_time_out_then_answer(tmp_path):
    """launcher=sbatch: two timed-out sbatch calls, then the submission; --wait's squeue and sacct time out too."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    submitted = stand_in(bin_dir, "sbatch", 2)
    stand_in(bin_dir, "squeue", 2)
    stand_in(bin_dir, "sacct", 2)
    proc = run_cli(
        *SMALL, "launcher=sbatch", f"base.cache_dir={tmp_path / 'cache'}", f"run_root={tmp_path}",
        cwd=tmp_path, env=env_with(bin_dir), timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    retries = [line.split(":")[0] for line in proc.stderr.splitlines() if "the controller is busy; try" in line]
    assert sorted(retries) == ["sacct", "sacct", "sbatch", "sbatch", "squeue", "squeue"], proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    assert results(run_dir) == ["base", "r32", "r8"]
    assert submitted_ids(submitted) == job_ids_of(run_dir), "a stage was submitted twice (or not recorded)"


def test_an_sbatch_that_queued_the_job_and_timed_out_is_not_repeated(tmp_path):
    """launcher=slurm: submitit's sbatch (through slurm_router.backends.slurm.commands) queues the base stage, then
    says it timed out: the job is found by its comment and not submitted again."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    submitted = stand_in(bin_dir, "sbatch", 1, submit_then_fail=True)
    proc = run_cli(
        *SMALL, "launcher=slurm", f"base.cache_dir={tmp_path / 'cache'}", f"run_root={tmp_path}",
        cwd=tmp_path, env=env_with(bin_dir), timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (found,) = [line for line in proc.stderr.splitlines() if "found by its comment" in line]
    assert found.startswith(f"sbatch: {TIMED_OUT}, but job ") and "not submitting it again" in found, found
    run_dir = run_dir_of(proc)
    assert results(run_dir) == ["base", "r32", "r8"]
    ids = submitted_ids(submitted)
    assert len(ids) == 3 and ids == job_ids_of(run_dir), f"submitted {ids}, the run's {job_ids_of(run_dir)}"


def test_a_controller_that_never_answers_fails_in_one_line_and_resume_submits(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "sbatch", 10_000)
    env = {**env_with(bin_dir), "SLURM_ROUTER_SLURM_TRIES": "2"}
    args = [*SMALL, "launcher=sbatch", f"base.cache_dir={tmp_path / 'cache'}", f"run_root={tmp_path}"]
    proc = run_cli(*args, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 75, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith("error: sbatch failed 2 time(s)") and TIMED_OUT in error, error
    assert f"resume={run_dir}" in error and "Slurm rejected" not in proc.stderr, error
    status = run_cli(str(run_dir), "--json", module="slurm_router.status", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    tasks = json.loads(status.stdout)["tasks"]
    assert sorted((t["variant"], t["state"]) for t in tasks) == [
        ("base", "INTERRUPTED"),
        ("r32", "INTERRUPTED"),
        ("r8", "INTERRUPTED"),
    ], tasks
    resumed = run_cli(f"resume={run_dir}", cwd=tmp_path, timeout=900)  # the real sbatch: the controller is back
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert results(run_dir) == ["base", "r32", "r8"]


def rows_of(events: Path) -> list[dict]:
    text = events.read_text() if events.is_file() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def test_a_task_requeued_in_held_state_waits_for_release_then_resumes(tmp_path):
    """`scontrol requeuehold` of a running variant: status says it waits for `scontrol release JOB` (not ended,
    not failed); once released it resumes from its checkpoint and the run completes."""
    args = [*SMALL, "launcher.wait=false", "launcher=sbatch"]
    proc = run_cli(
        *args,
        f"base.cache_dir={tmp_path / 'cache'}",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        env=slowdown("r8=15"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    job = next(t["job_id"] for j in manifest["jobs"] for t in j["tasks"] if t["variant"] == "r8")
    events = run_dir / "tasks" / "r8" / "events-rank0.jsonl"
    wait_until(lambda: any(r["event"] == "step" for r in rows_of(events)), "r8 training", timeout=600)
    subprocess.run(["scontrol", "requeuehold", job], check=True)

    def r8() -> dict:
        status = run_cli(str(run_dir), "--json", module="slurm_router.status", cwd=tmp_path)
        return next(t for t in json.loads(status.stdout)["tasks"] if t["variant"] == "r8")

    held = wait_until(lambda: (t := r8())["state"] == "PENDING" and "held" in (t["reason"] or "") and t, "r8 held", 60)
    assert f"`scontrol release {job}` lets it run again" in held["reason"], held
    subprocess.run(["scontrol", "release", job], check=True)
    status = run_cli(str(run_dir), "--wait", "--json", module="slurm_router.status", cwd=tmp_path, timeout=600)
    assert status.returncode == 0, status.stdout[-3000:] + status.stderr[-3000:]
    tasks = {t["variant"]: t for t in json.loads(status.stdout)["tasks"]}
    assert {v: t["state"] for v, t in tasks.items()} == {"base": "COMPLETED", "r8": "COMPLETED", "r32": "COMPLETED"}
    assert tasks["r8"]["requeues"] >= 1, tasks["r8"]
    rows = rows_of(events)
    assert any(r["event"] == "checkpoint_loaded" and r["attempt"] >= 1 for r in rows) or any(
        r["event"] == "start" and r["attempt"] >= 1 for r in rows
    ), "r8 did not start again"
    assert sorted({r["step"] for r in rows if r["event"] == "step"}) == list(range(4))


@pytest.mark.parametrize("array", [False, True], ids=["job", "array"])
def test_a_job_that_starts_at_once_finds_its_log_folder(tmp_path, array):
    """submitit writes each job's output under logs/<job id>/, a folder it makes only after sbatch returns; an idle
    cluster starts the job within milliseconds, and a job that cannot open its output fails (signal 53: CI saw a
    base stage fail so). The runner submits it held, makes the folders, then releases it. Here nothing else makes
    them: without that, every job below fails."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = tmp_path / "logs" / "%j"
    script = tmp_path / "job.sh"
    script.write_text(
        _make_sbatch_string(command="echo ran-$SLURM_JOB_ID", folder=str(folder), **({"map_count": 2} if array else {}))
    )
    proc = subprocess.run(
        [sys.executable, "-m", "slurm_router.backends.slurm.commands", "sbatch", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.split()[-1]
    outs = (
        [tmp_path / "logs" / f"{job}_{i}" / f"{job}_{i}_0_log.out" for i in range(2)]
        if array
        else [tmp_path / "logs" / job / f"{job}_0_log.out"]
    )

    def ended() -> list[str] | None:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True, text=True)
        states = out.stdout.split()
        return states if len(states) == len(outs) and not {"PENDING", "RUNNING"} & set(states) else None

    states = wait_until(ended, f"job {job} to end", 120)
    assert states == ["COMPLETED"] * len(outs), states
    assert all(p.is_file() and "ran-" in p.read_text() for p in outs), [p for p in outs if not p.is_file()]
