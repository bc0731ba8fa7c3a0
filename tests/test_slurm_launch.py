"""lora_ab on the real single-node Slurm test cluster (scripts/slurm_test_cluster.sh), both Slurm launchers.

One array job per stage, one array task per variant, all COMPLETED in sacct; the base stage ends before any
variant starts (afterok); concurrently running tasks saw different GPUs; the report is in the run dir.
"""

import json
import shutil
import subprocess

import pytest
from conftest import CLUSTER_GPUS, run_cli, run_dir_of, slowdown, task_spans

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
# Steps long enough (slowdown(): a sleep in proportion to each step's compute, so a loaded machine slows
# both alike) that tasks started together are still training when the other starts: they really run at once. Seen
# here: the two array tasks' start rows 0.05 s apart, each then training 10 s; two co-located tasks' 0.2-1.8 s apart,
# each training 5-7 s with a slowdown of 4 (their steps are slower: three tasks share the cores).
HELD = slowdown("r8=15;r32=15")  # the variants only: the base stage as it was
HELD_PACKED = slowdown("8")


def _sacct(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["sacct", "-X", "-n", "--parsable2", "-o", "JobID,State,JobName", "-j", job_id],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {l.split("|")[0]: l.split("|")[1] for l in out.splitlines() if l}


@pytest.mark.parametrize("launcher", ["slurm", "sbatch"])
def test_lora_ab_on_slurm(tmp_path, launcher):
    proc = run_cli(
        *SMALL,
        f"launcher={launcher}",
        f"base.cache_dir={tmp_path / 'cache'}",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        env=HELD,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = run_dir_of(proc)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    jobs = manifest["jobs"]
    assert [j["stage"] for j in jobs] == ["base", "variants"]
    for job, n_tasks in zip(jobs, (1, 2)):
        states = _sacct(job["job_id"])
        assert len(job["tasks"]) == n_tasks
        assert sorted(states) == sorted(t["job_id"] for t in job["tasks"]), states
        assert set(states.values()) == {"COMPLETED"}, states
    variants = jobs[1]
    assert variants["array"] and [t["job_id"] for t in variants["tasks"]] == [
        f"{variants['job_id']}_{i}" for i in (0, 1)
    ]
    spans = task_spans(run_dir)
    assert spans["base"][1] <= min(spans["r8"][0], spans["r32"][0]), "a variant started before the base ended"
    # the two array tasks ran at once (each started before the other ended), each on a GPU of its own
    assert spans["r8"][0] < spans["r32"][1] and spans["r32"][0] < spans["r8"][1], f"one after another: {spans}"
    assert spans["r8"][2] != spans["r32"][2], f"concurrent tasks shared GPU {spans['r8'][2]}"
    assert all(spans[t][2] in CLUSTER_GPUS for t in spans), spans
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert set(summary["variants"]) == {"r8", "r32"} and summary["base"]["val_loss"] > 0
    # launcher.wait=true waits for the whole run, the report job included (squeue first: sacct lags)
    from slurm_router.backends.slurm.queries import TERMINAL_STATES, query_slurm

    squeue, sacct = query_slurm(manifest["report_job_id"])
    report_row = squeue.get(manifest["report_job_id"]) or sacct.get(manifest["report_job_id"])
    assert report_row is not None and report_row.state in TERMINAL_STATES, report_row
    if launcher == "sbatch":
        assert (run_dir / "submit.sbatch").is_file() and (run_dir / "submit-base.sbatch").is_file()
        assert (
            "#SBATCH --kill-on-invalid-dep=yes" in (run_dir / "submit.sbatch").read_text()
        )  # a failed base cancels it
    status = run_cli(str(run_dir), "--json", module="slurm_router.status", timeout=60)
    assert status.returncode == 0, status.stderr


def test_sbatch_rejection_is_one_line_and_marks_the_run_failed(tmp_path):
    proc = run_cli(
        *SMALL,
        "launcher=slurm",
        "launcher.partition=nosuchpartition",
        f"run_root={tmp_path}",
        f"base.cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(err) == 1 and "Slurm rejected the job" in err[0] and "Traceback" not in proc.stderr, proc.stderr
    manifest = json.loads(next(tmp_path.rglob("manifest.json")).read_text())
    assert manifest["state"] == "failed"


def test_no_sbatch_means_not_a_slurm_machine(tmp_path):
    import os
    import sys

    env = {"PATH": os.path.dirname(sys.executable)}
    proc = run_cli(*SMALL, "launcher=slurm", f"run_root={tmp_path}", cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 2 and "not a Slurm machine" in proc.stderr and "launcher=local" in proc.stderr
    assert not any(tmp_path.rglob("manifest.json"))


@pytest.mark.parametrize("launcher", ["sbatch", "slurm"])
def test_srun_workers_one_gpu_each(tmp_path, launcher):
    """launcher.srun_workers: a task's D workers are D srun tasks, each pinned to its own GPU, meeting at
    the job's MASTER_ADDR:MASTER_PORT; the loss curve still trains."""
    proc = run_cli(
        "base.enabled=false",
        "train.steps=4",
        "train.eval_batches=1",
        "data.max_documents=40",
        f"launcher={launcher}",
        "launcher.srun_workers=true",
        "resources.devices_per_task=2",
        "launcher.wait=true",
        "launcher.timeout_min=10",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    task_dir = run_dir_of(proc) / "tasks" / "main"
    starts = {}
    for rank in (0, 1):
        rows = [json.loads(l) for l in (task_dir / f"events-rank{rank}.jsonl").read_text().splitlines()]
        start = next(r for r in rows if r["event"] == "start")
        starts[rank] = (start["cuda_visible_devices"], start["pid"], start["world"])
    assert starts[0][0] != starts[1][0] and {starts[0][0], starts[1][0]} <= CLUSTER_GPUS, starts
    assert starts[0][2] == starts[1][2] == 2
    summary = json.loads((run_dir_of(proc) / "report" / "summary.json").read_text())
    assert summary["variants"]["main"]["devices"] == 2


@pytest.mark.parametrize("launcher", ["sbatch", "slurm"])
def test_variants_colocated_in_one_allocation(tmp_path, launcher):
    """resources.tasks_per_gpu=2: 3 variants become 2 array tasks; the first runs two variants side by side on
    the one GPU Slurm gave it, and every variant completes."""
    variants = [f"+variants.v{i}.train.lr={1e-3 * (i + 1)}" for i in range(3)]
    proc = run_cli(
        "base.enabled=false",
        "train.steps=6",
        "train.eval_batches=1",
        "data.max_documents=40",
        *variants,
        f"launcher={launcher}",
        "resources.tasks_per_gpu=2",
        "launcher.wait=true",
        "launcher.timeout_min=10",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        env=HELD_PACKED,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = run_dir_of(proc)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    job = manifest["jobs"][0]
    ids = {n: manifest["tasks"][n]["job_id"] for n in ("v0", "v1", "v2")}
    assert ids["v0"] == ids["v1"] == f"{job['job_id']}_0" and ids["v2"] == f"{job['job_id']}_1", ids
    assert set(_sacct(job["job_id"]).values()) == {"COMPLETED"}
    spans = task_spans(run_dir)
    assert spans["v0"][2] == spans["v1"][2], "co-located tasks must share their array task's GPU"
    # side by side: each started before the other ended (no slack: their steps are long, HELD_PACKED)
    assert spans["v0"][0] < spans["v1"][1] and spans["v1"][0] < spans["v0"][1], (
        f"co-located tasks ran one after another: {spans}"
    )
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert all(summary["variants"][v]["steps"] == 6 for v in ("v0", "v1", "v2"))


def test_colocate_by_memory_needs_local(tmp_path):
    proc = run_cli(
        "base.enabled=false",
        "launcher=slurm",
        "resources.tasks_per_gpu=0",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2 and "works with launcher=local only" in proc.stderr
    assert not any(tmp_path.rglob("manifest.json"))
