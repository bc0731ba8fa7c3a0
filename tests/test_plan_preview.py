"""Say what will run before it runs (issue 29, item 2), through the real command: Hydra's `--cfg job|all`
(`--resolve`) prints the composed config and each variant's overrides and writes nothing; `dry_run=true` prints
the plan (stages, tasks, devices, predicted peak memory per device against the device's memory, array sizes,
worst-case device-hours) on all three launchers and writes only the preview (for the Slurm launchers the
scripts and the submit commands in order, dependencies and the report job included); `status` of a preview
says it was never submitted; on the test cluster the preview matches what a real submission then queues."""

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import run_cli, run_dir_of, slowdown

SMALL = ["+experiment=lora_ab", "base.steps=8", "train.steps=4", "train.eval_batches=2", "data.max_documents=60"]
on_cluster = pytest.mark.skipif(
    shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first"
)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_cfg_job_and_all_print_the_config_and_each_variants_overrides_and_write_nothing(tmp_path):
    proc = run_cli(*SMALL, "train.lr=2e-3", f"run_root={tmp_path / 'runs'}", "--cfg", "job", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    body = "\n".join(line for line in proc.stdout.splitlines() if not line.startswith("#"))
    cfg = yaml.safe_load(body)
    assert cfg["train"]["steps"] == 4 and cfg["train"]["lr"] == 2e-3 and cfg["experiment"] == "lora_ab"
    assert "hydra" not in cfg and set(cfg["variants"]) == {"r8", "r32"}
    assert "# variant r8: model.lora.r=8 model.lora.alpha=16.0" in proc.stdout
    assert "# variant r32: model.lora.r=32 model.lora.alpha=64.0" in proc.stdout
    # --cfg all adds Hydra's own node; --resolve; a sweep's grid is the variants
    proc = run_cli(*SMALL, "--cfg", "all", "--resolve", "-m", "train.lr=1e-3,2e-3", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^hydra:$", proc.stdout, re.M) and "slurm_router does not read them" in proc.stdout
    variants = re.findall(r"^# variant (\S+): (.*)$", proc.stdout, re.M)
    assert [v for v, _ in variants] == ["r8_lr1e-3", "r8_lr2e-3", "r32_lr1e-3", "r32_lr2e-3"]
    assert dict(variants)["r32_lr2e-3"] == "model.lora.r=32 model.lora.alpha=64.0 train.lr=0.002"
    assert not (tmp_path / "runs").exists() and not (tmp_path / "outputs").exists(), "nothing is written"
    bad = run_cli("--cfg", "jobs", cwd=tmp_path, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --cfg jobs: show one of job, hydra, all (--cfg job)"


def _preview(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    proc = run_cli(
        *SMALL,
        *extra,
        "dry_run=true",
        f"run_root={tmp_path / 'runs'}",
        f"base.cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, run_dir_of(proc)


def _status_says_never_submitted(run_dir: Path) -> None:
    status = run_cli(str(run_dir), module="slurm_router.status", timeout=60)
    assert status.returncode == 0 and "a dry_run=true preview, never submitted" in status.stdout, status.stdout
    as_json = run_cli(str(run_dir), "--json", module="slurm_router.status", timeout=60)
    data = json.loads(as_json.stdout)
    assert data["state"] == "previewed" and data["submitted"] is False and data["tasks"] == ["base", "r8", "r32"]


def test_dry_run_local_prints_the_plan_and_writes_only_the_preview(tmp_path):
    proc, run_dir = _preview(tmp_path, "resources.devices_per_task=2")
    out = proc.stdout
    assert "dry_run=true: a preview of run" in out and "nothing was trained or submitted" in out
    assert re.search(r"launcher=local; devices are cpu: .*, [\d.]+ GiB", out), out
    assert "stage 1 base: 1 task(s) x 2 device(s)" in out
    assert "stage 2 variants, after stage base: 2 task(s) x 2 device(s)" in out  # no scheduler's word for it
    # one line per task group, every member named; the memory note once (issue 50, 9)
    assert re.search(
        r"^  r8, r32, seed 0 \(2 tasks\): 4 steps, global batch 16, lr [\d.e-]+; peak per device [\d.]+ GiB "
        r"of [\d.]+ GiB \(\d+%\)$",
        out,
        re.M,
    ), out
    assert out.count("one micro-batch at data.max_len") == 1, out
    assert re.search(r"worst case: 3 task\(s\) needing 6 device\(s\) in all, at most \d+ at once \(", out), out
    assert "launcher=local has no time limit" in out and "data the standard library: " in out
    # only the plan and the preview: no events, checkpoints, adapters, logs or report; no cache trained
    files = _files(run_dir)
    assert files == {"config.yaml", "manifest.json", "manifest.lock", "preview.txt"} | {
        f"tasks/{t}/task.json" for t in ("base", "r8", "r32")
    }, files
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    assert (run_dir / "preview.txt").read_text().startswith("dry_run=true: a preview")
    assert json.loads((run_dir / "manifest.json").read_text())["state"] == "previewed"
    _status_says_never_submitted(run_dir)
    # it says where the preview is kept and how to clean previews up (issue 50, 12); cleaning deletes only previews
    assert f"the preview is kept in {run_dir}" in out and "--clean-previews deletes them" in out
    ran = run_dir.parent / "ran"
    (ran / "tasks" / "t").mkdir(parents=True)
    (ran / "manifest.json").write_text((run_dir / "manifest.json").read_text())
    (ran / "tasks" / "t" / "events-rank0.jsonl").write_text("{}\n")  # something ran in it: never deleted
    clean = run_cli("--run-root", str(run_dir.parents[1]), "--clean-previews", module="slurm_router.status", timeout=60)
    assert clean.returncode == 0 and f"deleted the preview {run_dir}" in clean.stdout, clean.stdout + clean.stderr
    assert not run_dir.exists() and ran.is_dir()


def _array_sizes(preview: str) -> list[int]:
    return [int(n) for n in re.findall(r"one Slurm array of (\d+) task\(s\)", preview)]


@pytest.mark.parametrize("launcher", ["slurm", "sbatch"])
def test_dry_run_slurm_launchers_render_scripts_and_the_submit_commands_in_order(tmp_path, launcher):
    proc, run_dir = _preview(tmp_path, f"launcher={launcher}", "launcher.timeout_min=30")
    out = proc.stdout
    assert _array_sizes(out) == [1, 2], out
    assert "worst case: 3 device(s) over 3 task(s) x 30 min (launcher.timeout_min) = 1.50 device-hours" in out
    assert "its memory is known once the job starts" in out
    submit = (run_dir / "submit-all.sh").read_text()
    commands = [line for line in submit.splitlines() if "sbatch" in line and not line.startswith("#")]
    assert commands[0] == f"JOB_BASE=$(sbatch --parsable {run_dir / 'submit-base.sbatch'})"
    assert commands[1] == (
        f"JOB_VARIANTS=$(sbatch --parsable --dependency=afterok:$JOB_BASE --kill-on-invalid-dep=yes "
        f"{run_dir / 'submit.sbatch'})"
    )
    assert commands[2].startswith("sbatch --parsable --dependency=afterany:$JOB_VARIANTS --job-name lora_ab-report")
    assert f"-m slurm_router.analysis {run_dir}" in submit
    assert re.search(r"^#SBATCH --array=0-1\b", (run_dir / "submit.sbatch").read_text(), re.M)
    assert not re.search(r"^#SBATCH --array", (run_dir / "submit-base.sbatch").read_text(), re.M) or re.search(
        r"^#SBATCH --array=0-0\b", (run_dir / "submit-base.sbatch").read_text(), re.M
    )
    files = _files(run_dir)
    assert files - {f"tasks/{t}/task.json" for t in ("base", "r8", "r32")} == {
        "config.yaml",
        "manifest.json",
        "manifest.lock",
        "preview.txt",
        "submit-all.sh",
        "submit-base.sbatch",
        "submit.sbatch",
    }, files
    assert not (run_dir / "code").exists(), "no code snapshot for a preview"
    _status_says_never_submitted(run_dir)


def test_dry_run_sbatch_queues_seeds_auto_reserves_round_by_round(tmp_path):
    """seeds=auto under Slurm: the first round is one array, each round of reserves its own array, queued after
    the round before has ended (afterany) and the base (afterok), so a reserve never waits for its call inside an
    allocation; the report comes after the last round."""
    proc, run_dir = _preview(
        tmp_path, "launcher=sbatch", "seeds=auto", "prune=true", "auto_seeds.max=4", "train.eval_every=1"
    )
    assert (
        "one Slurm array of 4 task(s), then seeds=auto's reserves, one array per round (2 + 2 task(s))" in proc.stdout
    )
    submit = (run_dir / "submit-all.sh").read_text()
    commands = [line for line in submit.splitlines() if "sbatch" in line and not line.startswith("#")]
    assert commands[2] == (
        "JOB_VARIANTS_ROUND2=$(sbatch --parsable --dependency=afterok:$JOB_BASE,afterany:$JOB_VARIANTS "
        f"--kill-on-invalid-dep=yes {run_dir / 'submit-round2.sbatch'})"
    )
    assert "afterany:$JOB_VARIANTS_ROUND2 " in commands[3] and "afterany:$JOB_VARIANTS_ROUND3 " in commands[4]
    assert re.search(r"^#SBATCH --array=0,1,2,3\b", (run_dir / "submit.sbatch").read_text(), re.M)
    assert re.search(r"^#SBATCH --array=6,7\b", (run_dir / "submit-round3.sbatch").read_text(), re.M)


def _scontrol(job_id: str) -> list[dict[str, str]]:
    """scontrol show job's records (one per array task), as key=value dicts."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    return [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in out.splitlines() if line.strip()]


@pytest.mark.slurm
@on_cluster
@pytest.mark.parametrize("launcher", ["slurm", "sbatch"])
def test_the_preview_matches_what_a_real_submission_queues(tmp_path, launcher):
    """The same command with and without dry_run=true: as many arrays, of as many tasks, each stage after the one
    before (afterok) and the report job after the last (afterany). The base is slowed so that the variants are
    still waiting on it when their dependency is read; the jobs are cancelled afterwards."""
    slow = ["launcher.timeout_min=10"]
    proc, preview_dir = _preview(tmp_path, f"launcher={launcher}", *slow)
    sizes = _array_sizes(proc.stdout)
    commands = [
        line for line in (preview_dir / "submit-all.sh").read_text().splitlines() if "sbatch --parsable" in line
    ]
    real = run_cli(
        *SMALL,
        *slow,
        f"launcher={launcher}",
        f"run_root={tmp_path / 'real'}",
        f"base.cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
        env=slowdown("30"),
        timeout=300,
    )
    assert real.returncode == 0, real.stdout[-3000:] + real.stderr[-3000:]
    run_dir = run_dir_of(real)
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
        jobs = manifest["jobs"]
        assert [len(j["tasks"]) for j in jobs] == sizes == [1, 2]
        assert len(commands) == len(jobs) + 1, "one submit command per stage, and the report job"
        base, variants, report = jobs[0]["job_id"], jobs[1]["job_id"], str(manifest["report_job_id"])
        records = _scontrol(variants)
        assert len(records) >= 1 and all(r.get("Dependency", "").startswith(f"afterok:{base}") for r in records), (
            records
        )
        deadline = time.time() + 30
        while not _scontrol(report) and time.time() < deadline:
            time.sleep(1)
        assert _scontrol(report)[0].get("Dependency", "").startswith(f"afterany:{variants}"), _scontrol(report)
        assert "afterok:$JOB_BASE" in commands[1] and "afterany:$JOB_VARIANTS" in commands[2]
    finally:
        run_cli(str(run_dir), "--cancel", module="slurm_router.status", timeout=120)
        subprocess.run(["scancel", str(json.loads((run_dir / "manifest.json").read_text()).get("report_job_id"))])
