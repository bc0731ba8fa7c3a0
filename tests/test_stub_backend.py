"""A scheduler is a backend (issue 39): the stub scheduler in tests/stub_backend/ (a queue whose "cluster" is
detached local subprocesses) runs the real command end to end. Adding it took its package (__init__.py: the
Backend, its JobEnvironment and launcher schema; launcher.py; cluster.py), its config file
(stub_backend/conf/launcher/stub.yaml, here through --config-dir) and one registry line (SLURM_ROUTER_BACKENDS, the
registry's hook for a backend outside the package): nothing else of slurm_router changed for it."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli, run_dir_of

STUB = Path(__file__).resolve().parent / "stub_backend"
TINY = ["data=synthetic", "data.n_samples=64", "data.max_len=64", "data.mean_len=20", "train.steps=2"]
TINY += ["train.eval_batches=1", "train.eval_every=2"]
ENV = {"SLURM_ROUTER_BACKENDS": "stub=stub_backend", "PYTHONPATH": str(STUB.parent)}


def test_a_stub_scheduler_runs_the_real_command_end_to_end(tmp_path):
    proc = run_cli(
        "--config-dir",
        str(STUB / "conf"),
        "launcher=stub",
        *TINY,
        "+variants.a.train.lr=1e-3",
        "+variants.b.train.lr=2e-3",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        env=ENV,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["launcher"] == "stub" and manifest["state"] == "submitted"
    tasks = manifest["tasks"]
    assert sorted(tasks) == ["a", "b"] and all((run_dir / "tasks" / t / "result.json").is_file() for t in tasks)
    # each task's job process ran under the stub's job environment (found through the registry): its events
    # carry the stub's job id, and it left the run's lock to the command that submitted it
    assert {t["job_id"] for t in tasks.values()} == {"1_0", "1_1"}
    assert (run_dir / "report" / "summary.json").is_file(), "the report job ran after the tasks"

    status = run_cli("status", str(run_dir), "--json", cwd=tmp_path, env=ENV, timeout=120)
    assert status.returncode == 0, status.stdout[-2000:] + status.stderr[-2000:]
    rows = json.loads(status.stdout)
    rows = rows.get("tasks", rows) if isinstance(rows, dict) else rows
    assert sorted((r["variant"], r["state"]) for r in rows) == [("a", "COMPLETED"), ("b", "COMPLETED")]
