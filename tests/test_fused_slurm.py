"""Fused variants on the real single-node Slurm test cluster (scripts/slurm_test_cluster.sh): r8 and r32 x 2 seeds
with resources.fuse_variants=2 are one array job of 2 tasks (one per seed), both COMPLETED in sacct; every variant
has its own result and adapter, `status --json` lists all four with their group's array task, and each variant's
losses equal the same fused run's on the local launcher (the launcher never changes the math)."""

import json
import shutil
import subprocess

import pytest
from conftest import event_rows, run_cli, run_dir_of

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first"
    ),
]

ARGS = [
    "+experiment=lora_ab",
    "base.enabled=false",
    "train.steps=4",
    "train.eval_batches=2",
    "data.max_documents=60",
    "seeds=2",
    "resources.fuse_variants=2",
]
TASKS = ("r8-s0", "r32-s0", "r8-s1", "r32-s1")


def _losses(run_dir) -> dict[str, list[float]]:
    return {
        t: [
            r["loss"]
            for r in sorted(
                (r for r in event_rows(run_dir / "tasks" / t) if r["event"] == "step"), key=lambda r: r["step"]
            )
        ]
        for t in TASKS
    }


def test_fused_groups_run_as_one_array_on_slurm(tmp_path):
    proc = run_cli(
        *ARGS,
        "launcher=slurm",
        "launcher.wait=true",
        "launcher.timeout_min=10",
        f"run_root={tmp_path / 'slurm'}",
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = run_dir_of(proc)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (job,) = [j for j in manifest["jobs"] if j["stage"] == "variants"]
    assert [t["job_id"] for t in job["tasks"]] == [f"{job['job_id']}_{i}" for i in (0, 1)], job
    out = subprocess.run(
        ["sacct", "-X", "-n", "--parsable2", "-o", "JobID,State", "-j", job["job_id"]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert {line.split("|")[1] for line in out.splitlines() if line} == {"COMPLETED"}, out
    for t in TASKS:
        result = json.loads((run_dir / "tasks" / t / "result.json").read_text())
        assert result["steps"] == 4 and (run_dir / "tasks" / t / "adapter" / "adapter_model.safetensors").is_file(), t
    status = run_cli("status", str(run_dir), "--json", cwd=tmp_path, timeout=120)
    assert status.returncode == 0, status.stderr
    rows = {r["task"]: r for r in json.loads(status.stdout)["tasks"]}
    assert set(TASKS) <= set(rows), rows
    assert rows["r32-s0"]["job_id"] == rows["r8-s0"]["job_id"] and rows["r32-s1"]["job_id"] == rows["r8-s1"]["job_id"]
    local = run_cli(*ARGS, f"run_root={tmp_path / 'local'}", cwd=tmp_path, timeout=900)
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    on_slurm, here = _losses(run_dir), _losses(run_dir_of(local))
    for t in TASKS:
        assert len(on_slurm[t]) == 4 and on_slurm[t] == pytest.approx(here[t], rel=1e-6), t
