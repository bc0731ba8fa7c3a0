"""A base stage that fails under Slurm (issue 12, finding 3): nothing of the run waits forever, status says why
and returns, and resume= (once the cause is gone) submits the base and its variants again and the run ends with
a report. Real jobs on the single-node test cluster, both Slurm launchers.

The failure is real: the test sets SLURM_ROUTER_COLLECTIVE_TIMEOUT_S to a word in the environment the run is
submitted from; Slurm exports it to the jobs, where every worker fails to start (ValueError); the launcher
itself never reads it. resume= from an environment without it is the fix.

    sudo scripts/slurm_test_cluster.sh && pytest -m slurm tests/test_slurm_failed_stage.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_cli, run_dir_of

from slurm_router.backends.slurm.submitit_launcher import submitit_params

needs_slurm = pytest.mark.skipif(
    shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first"
)

SMALL = [
    "+experiment=lora_ab",
    "base.steps=4",
    "train.steps=2",
    "train.eval_batches=1",
    "data.max_documents=60",
    "launcher.timeout_min=10",
]
BREAK_WORKERS = {"SLURM_ROUTER_COLLECTIVE_TIMEOUT_S": "not-a-number"}
# what a run submitted before --kill-on-invalid-dep (or a cluster that ignores it) does: dependants stay PENDING
KEEP_PENDING = "+launcher.additional_parameters.kill_on_invalid_dep=no"
BLAME = "DependencyNeverSatisfied: stage base failed (base FAILED)"
WAIT_S = 180  # generous: a failed base ends within seconds of its start


def _submit(tmp_path: Path, *args: str) -> Path:
    proc = run_cli(
        *SMALL,
        *args,
        f"base.cache_dir={tmp_path / 'cache'}",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        env=BREAK_WORKERS,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir_of(proc)


def _status(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli(str(run_dir), *args, module="slurm_router.status", timeout=WAIT_S + 60)


def _wait_json(run_dir: Path) -> tuple[int, dict]:
    proc = _status(run_dir, "--wait", "--json", "--poll-s", "1", "--timeout-s", str(WAIT_S))
    return proc.returncode, json.loads(proc.stdout)


def _squeue(job_id: str) -> str:
    return subprocess.run(
        ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%i %T %r"], capture_output=True, text=True
    ).stdout.strip()


def _wait_for(cond, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _summary(run_dir: Path) -> dict | None:
    path = run_dir / "report" / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _assert_base_failed(run_dir: Path, state: str) -> None:
    """status --wait returns (exit 1) and names the failed stage as the reason of each dependant."""
    rc, status = _wait_json(run_dir)
    tasks = {t["variant"]: t for t in status["tasks"]}
    assert rc == 1 and status["all_terminal"] and not status["all_completed"], status
    assert (
        tasks["base"]["state"] == "FAILED" and tasks["base"]["exit_code"] == 1 and tasks["base"]["exit_signal"] == 0
    ), tasks["base"]
    for v in ("r8", "r32"):
        assert (tasks[v]["state"], tasks[v]["reason"], tasks[v]["terminal"]) == (state, BLAME, True), tasks[v]
    err = (run_dir / "logs").rglob("*.err")
    assert any("not-a-number" in f.read_text() for f in err), "the base failed for another reason"
    table = _status(run_dir).stdout
    assert "2 task(s) never ran (r8, r32): stage base failed (base FAILED)" in table, table
    assert f"resume={run_dir}" in table


def _resume_to_the_end(run_dir: Path) -> str:
    """resume= (without the fault) submits base, r8 and r32 again; the run completes and gets its report."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    proc = run_cli(f"resume={run_dir}", cwd=run_dir.parent, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(f"{t} from step 0" in proc.stdout for t in ("base", "r8", "r32")), proc.stdout
    again = json.loads((run_dir / "manifest.json").read_text())
    assert [j["stage"] for j in again["jobs"][len(manifest["jobs"]) :]] == ["base", "variants"]
    rc, status = _wait_json(run_dir)
    assert rc == 0 and {t["variant"]: t["state"] for t in status["tasks"]} == dict.fromkeys(
        ("base", "r8", "r32"), "COMPLETED"
    ), status
    summary = _wait_for(
        lambda: (s := _summary(run_dir)) and s["variants"]["r8"].get("val_loss") and s,
        "the resumed run's report",
        timeout_s=120,
    )
    assert summary["variants"]["r32"]["val_loss"] > 0 and summary["base"]["val_loss"] > 0
    return proc.stdout


def test_submitit_dependants_are_submitted_with_kill_on_invalid_dep():
    from omegaconf import OmegaConf

    lc = {
        "timeout_min": 5,
        "cpus_per_task": 1,
        "array_parallelism": 4,
        "signal_delay_s": 30,
        "srun_workers": False,
        "partition": None,
        "account": None,
        "qos": None,
        "constraint": None,
        "mem_gb": None,
    }
    cfg = OmegaConf.create({"experiment": "e", "launcher": lc | {"additional_parameters": {"nice": 10}}})
    extra = submitit_params(cfg, 1, "variants", "41")["slurm_additional_parameters"]
    assert extra == {"nice": 10, "dependency": "afterok:41", "kill-on-invalid-dep": "yes"}
    assert submitit_params(cfg, 1, "base", None)["slurm_additional_parameters"] == {"nice": 10}
    mine = OmegaConf.create(
        {"experiment": "e", "launcher": lc | {"additional_parameters": {"kill_on_invalid_dep": "no"}}}
    )
    extra = submitit_params(mine, 1, "variants", "41")["slurm_additional_parameters"]
    assert extra == {"kill_on_invalid_dep": "no", "dependency": "afterok:41"}, "the user's own choice wins"


@pytest.mark.slurm
@needs_slurm
@pytest.mark.parametrize("launcher", ["slurm", "sbatch"])
def test_failed_base_cancels_its_dependants_and_resume_finishes_the_run(tmp_path, launcher):
    run_dir = _submit(tmp_path, f"launcher={launcher}")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    variants, report_job = manifest["jobs"][1]["job_id"], manifest["report_job_id"]

    _assert_base_failed(run_dir, "CANCELLED")
    assert "PENDING" not in _squeue(variants), _squeue(variants)
    # the report job (afterany) still runs and says what happened
    summary = _wait_for(lambda: _summary(run_dir), "the report of the failed run")
    missing = " | ".join(summary["missing"])
    assert "base: failed" in missing and "r8: never ran: stage base failed" in missing, missing
    assert "r32: never ran: stage base failed" in missing, missing
    _wait_for(
        lambda: "PENDING" not in _squeue(report_job) and "RUNNING" not in _squeue(report_job),
        "the report job to end",
        timeout_s=60,
    )

    _resume_to_the_end(run_dir)


@pytest.mark.slurm
@needs_slurm
def test_dependants_pending_forever_are_terminal_and_resume_cancels_them(tmp_path):
    """A run submitted before this fix, or a cluster that ignores --kill-on-invalid-dep (here: the user's own
    kill_on_invalid_dep=no): the variants stay PENDING with DependencyNeverSatisfied and the report job waits
    on them. status --wait still returns; resume= cancels them and the report job (one line) and goes on."""
    run_dir = _submit(tmp_path, "launcher=slurm", KEEP_PENDING)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    variants, report_job = manifest["jobs"][1]["job_id"], manifest["report_job_id"]

    _assert_base_failed(run_dir, "PENDING")
    assert "PENDING DependencyNeverSatisfied" in _squeue(variants)
    assert _squeue(report_job) == f"{report_job} PENDING Dependency"

    out = _resume_to_the_end(run_dir)
    line = [l for l in out.splitlines() if l.startswith("resume: cancelled")]
    assert len(line) == 1 and "2 task(s) that could never start" in line[0] and f"report job {report_job}" in line[0]
    assert BLAME in line[0], line
    sacct = subprocess.run(
        ["sacct", "-X", "-n", "--parsable2", "-o", "JobID,State", "-j", report_job], capture_output=True, text=True
    ).stdout
    assert sacct.startswith(f"{report_job}|CANCELLED"), "the old report job ran"


@pytest.mark.slurm
@needs_slurm
def test_launcher_wait_cancels_what_can_never_start_and_reports(tmp_path):
    """launcher.wait=true on such a cluster: the launcher cancels the stuck variants itself, so the report job
    (afterany) runs; it prints the report of the failure and exits 1."""
    proc = run_cli(
        *SMALL,
        "launcher=slurm",
        "launcher.wait=true",
        KEEP_PENDING,
        f"base.cache_dir={tmp_path / 'cache'}",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        env=BREAK_WORKERS,
        timeout=WAIT_S,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("launcher.wait: cancelled")]
    assert len(line) == 1 and "2 task(s) that could never start" in line[0] and BLAME in line[0], proc.stdout
    assert "missing: base: failed" in proc.stdout and "report job" not in proc.stderr, proc.stderr
    assert any(m.startswith("base: failed") for m in _summary(run_dir_of(proc))["missing"]), "no report written"
