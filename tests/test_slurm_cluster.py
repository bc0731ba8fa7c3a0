"""Integration tests against the real single-node Slurm test cluster (8 fake GPUs, accounting on).

sudo scripts/slurm_test_cluster.sh && pytest -m slurm tests/test_slurm_cluster.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_router.backends.slurm import queries as st
from slurm_router.backends.slurm.sbatch_render import SbatchSpec, submit_sbatch, write_sbatch
from slurm_router.rundir.manifest import Manifest

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        shutil.which("sbatch") is None,
        reason="sbatch not on PATH: bring the test cluster up with scripts/slurm_test_cluster.sh",
    ),
]
REPO = Path(__file__).resolve().parents[1]
PARTITION = os.environ.get("SLURM_TEST_PARTITION", "debug")
# Prints the task's view as one JSON line: argv, array index, the GPUs Slurm gave it, its cwd.
PROBE = (
    "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'task': os.environ.get('SLURM_ARRAY_TASK_ID'), "
    "'procid': os.environ.get('SLURM_PROCID'), 'gpus': os.environ.get('CUDA_VISIBLE_DEVICES'), "
    "'cwd': os.getcwd()}), flush=True); sys.exit(int(os.environ.get('EXIT_' + os.environ['SLURM_ARRAY_TASK_ID'], 0)))"
)


def sacct_rows(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["sacct", "-X", "-n", "--parsable2", "-j", job_id, "--format=JobID,State"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line.split("|")[0]: st.normalize_state(line.split("|")[1]) for line in out.splitlines() if "|" in line}


def wait_sacct(job_id: str, expected: set[str], timeout_s: float = 60) -> dict[str, str]:
    """sacct lags the controller by a few seconds: poll until it names exactly the expected tasks, all ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = sacct_rows(job_id)
        if set(rows) == expected and all(s in st.TERMINAL_STATES for s in rows.values()):
            return rows
        if time.monotonic() > deadline:
            pytest.fail(f"sacct for job {job_id} after {timeout_s}s: {rows}, expected {sorted(expected)} ended")
        time.sleep(0.5)


def test_submitit_array_one_gpu_per_task(tmp_path):
    submitit = pytest.importorskip("submitit")
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit")
    assert executor.cluster == "slurm"

    def cuda_visible_devices(_: int) -> str:  # nested: cloudpickle ships it by value, no import of tests/
        import os

        return os.environ["CUDA_VISIBLE_DEVICES"]

    executor.update_parameters(slurm_partition=PARTITION, gpus_per_node=1, timeout_min=5, slurm_array_parallelism=4)
    jobs = executor.map_array(cuda_visible_devices, range(4))
    base = jobs[0].job_id.split("_")[0]
    assert {j.job_id for j in jobs} == {f"{base}_{i}" for i in range(4)}, "expected one array job"
    seen = [j.result() for j in jobs]
    assert all(s.isdigit() for s in seen), f"each task must see exactly one GPU: {seen}"
    rows = wait_sacct(base, {f"{base}_{i}" for i in range(4)})
    assert set(rows.values()) == {"COMPLETED"}, rows


def _spec(run_dir: Path, **kw) -> SbatchSpec:
    defaults = dict(
        job_name="slurm_router-test",
        run_dir=str(run_dir),
        array_size=2,
        partition=PARTITION,
        timeout_min=2,
        signal_delay_s=30,  # the default (120 s) is the whole limit: USR2 would reach a probe slowed by load
        mem_gb=0.5,
        python=sys.executable,
    )
    return SbatchSpec(**(defaults | kw))


def _manifest(run_dir: Path, job_id: str, n: int, launcher: str = "sbatch") -> None:
    logs = run_dir / "logs"
    tasks = [
        {
            "variant": f"v{i}",
            "array_index": i,
            "log_path": str(logs / f"{job_id}_{i}.out"),
            "err_path": str(logs / f"{job_id}_{i}.err"),
        }
        for i in range(n)
    ]
    manifest = {
        "run_id": "t",
        "experiment": "test",
        "run_dir": str(run_dir),
        "launcher": launcher,
        "jobs": [{"stage": "variants", "job_id": job_id, "array": True, "tasks": tasks}],
        "tasks": {},
        "stages": [{"name": "variants", "tasks": [t["variant"] for t in tasks]}],
    }  # Manifest.load needs it
    (run_dir / "manifest.json").write_text(json.dumps(manifest))


def status_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slurm_router.status", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


@pytest.mark.parametrize("ntasks", [1, 2])
def test_rendered_sbatch_with_hostile_run_dir(tmp_path, ntasks):
    run_dir = tmp_path / "run dir 'q' \"dq\" $(touch pwned) `touch pwned` #c %x"
    argv = ("-c", PROBE, "--run-dir", str(run_dir), "variant with spaces; $(touch pwned)", "")
    spec = _spec(run_dir, ntasks=ntasks, task_argv=argv, gpus_per_task=1)
    job_id = submit_sbatch(write_sbatch(spec))
    _manifest(run_dir, job_id, 2)

    proc = status_cli(str(run_dir), "--wait", "--json", "--poll-s", "1", "--timeout-s", "90")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert [t["state"] for t in report["tasks"]] == ["COMPLETED", "COMPLETED"] and report["all_completed"]

    for i in range(2):
        lines = (run_dir / "logs" / f"{job_id}_{i}.out").read_text().splitlines()
        seen = [json.loads(line) for line in lines]
        assert len(seen) == ntasks
        assert all(s["argv"] == list(argv[2:]) and s["task"] == str(i) and s["cwd"] == str(run_dir) for s in seen)
        assert all(s["gpus"].isdigit() for s in seen), seen  # one GPU each
        if ntasks > 1:  # srun: one GPU per task, different ones
            assert len({s["gpus"] for s in seen}) == ntasks and {s["procid"] for s in seen} == {"0", "1"}
    assert not list(tmp_path.rglob("pwned")), "an injected command ran"
    assert set(wait_sacct(job_id, {f"{job_id}_0", f"{job_id}_1"}).values()) == {"COMPLETED"}


def test_status_reports_failure_with_log_tail(tmp_path):
    run_dir = tmp_path / "run"
    spec = _spec(run_dir, gpus_per_task=0, task_argv=("-c", PROBE), env=(("EXIT_1", "3"),))
    job_id = submit_sbatch(write_sbatch(spec))
    _manifest(run_dir, job_id, 2)
    proc = status_cli(str(run_dir), "--wait", "--poll-s", "1", "--timeout-s", "90")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED" in proc.stdout and "last 20 lines" in proc.stdout
    wait_sacct(job_id, {f"{job_id}_0", f"{job_id}_1"})  # once accounting has both, it agrees
    tasks = {t.variant: t for t in st.collect_status(Manifest.load(run_dir).data)}
    assert tasks["v0"].state == "COMPLETED" and tasks["v1"].state == "FAILED" and tasks["v1"].exit_code == "3:0"
    assert any('"task": "1"' in line for line in tasks["v1"].out_tail)


def test_status_cancel_only_this_run(tmp_path):
    other = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--hold",
            f"--partition={PARTITION}",
            "--time=1",
            "--output=/dev/null",
            "--wrap",
            "true",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    other_id = other.stdout.strip()
    try:
        run_dir = tmp_path / "run"
        job_id = submit_sbatch(write_sbatch(_spec(run_dir, task_argv=("-c", PROBE))), "--hold")
        _manifest(run_dir, job_id, 2)
        proc = status_cli(str(run_dir), "--cancel", "--wait", "--json", "--poll-s", "1", "--timeout-s", "60")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert [t["state"] for t in json.loads(proc.stdout)["tasks"]] == ["CANCELLED", "CANCELLED"]
        state = subprocess.run(["squeue", "-h", "-j", other_id, "-o", "%T"], capture_output=True, text=True).stdout
        assert state.strip() == "PENDING", "another job was cancelled"
    finally:
        subprocess.run(["scancel", other_id], check=False)
