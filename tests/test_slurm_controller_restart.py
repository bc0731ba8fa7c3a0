"""The Slurm controller stopped for 40 s in the middle of a run, then started again, on the 2-node test cluster
(scripts/slurm_multinode_cluster.sh: its own slurmctld, so the single-node cluster's tests are not disturbed).
The tasks train on, `launcher.wait=true` says the controller is unreachable and carries on, the report job runs,
and nothing is lost or submitted twice.

pytest tests/test_slurm_controller_restart.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import run_dir_of, slowdown, start_cli
from test_multinode import MN_CONF, SMALL, cluster_test, mn_env  # noqa: F401 (mn_env: the fixture)

PID_FILE = Path("/run/slurm-mn/slurmctld.pid")
DOWN_S = 40


def controller_answers(env: dict) -> bool:
    ping = subprocess.run(["scontrol", "ping"], env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
    return "UP" in ping.stdout


def steps_done(run_dir: Path) -> int:
    rows = [
        json.loads(line)
        for f in run_dir.glob("tasks/*/events-rank0.jsonl")
        for line in f.read_text().splitlines()
        if line.strip()
    ]
    return sum(r.get("event") == "step" for r in rows)


@cluster_test
def test_a_controller_stopped_mid_run_costs_nothing(tmp_path, mn_env):  # noqa: F811
    proc = start_cli(
        "+experiment=lora_ab",
        *SMALL,
        "launcher=sbatch",
        "launcher.partition=mn",
        "launcher.timeout_min=10",
        "launcher.wait=true",
        f"run_root={tmp_path / 'mn'}",
        cwd=tmp_path,
        env={**mn_env, **slowdown("10")},  # steps long enough that the tasks train through the outage
    )
    stopped = False
    try:
        deadline = time.monotonic() + 240
        while not any(steps_done(d) for d in tmp_path.glob("mn/*/*")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(1)
        (run_dir,) = list(tmp_path.glob("mn/*/*"))
        before = steps_done(run_dir)
        assert before, "no task started training within 240 s"
        os.kill(int(PID_FILE.read_text()), signal.SIGTERM)
        stopped = True
        time.sleep(DOWN_S)
        assert not controller_answers(mn_env)
        during = steps_done(run_dir)
    finally:
        if stopped:  # always bring the controller back: the other tests on this cluster need it
            subprocess.run(["slurmctld", "-f", str(MN_CONF)], check=True)
            deadline = time.monotonic() + 60
            while not controller_answers(mn_env) and time.monotonic() < deadline:
                time.sleep(1)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert during > before, f"the tasks did not train while the controller was down ({before} -> {during} steps)"
    unreachable = [line for line in err.splitlines() if "asking again" in line or "the controller is busy" in line]
    assert unreachable, f"launcher.wait never said the controller was unreachable: {err[-3000:]}"
    assert run_dir_of(subprocess.CompletedProcess([], 0, out, err)) == run_dir
    assert sorted(p.parent.name for p in run_dir.glob("tasks/*/result.json")) == ["r32", "r8"]
    assert (run_dir / "report" / "summary.json").is_file()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    ids = [j["job_id"] for j in manifest["jobs"]] + [manifest["report_job_id"]]
    sacct = subprocess.run(
        ["sacct", "-X", "-n", "--parsable2", "-o", "JobID,State,JobName", "-j", ",".join(ids)],
        env={**os.environ, **mn_env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    names = {line.split("|")[2] for line in sacct.splitlines() if line}
    assert len(ids) == 2 and len(names) == 2, f"jobs {ids}, sacct:\n{sacct}"
    for task in ("r8", "r32"):  # trained straight through: one attempt, every step once
        rows = [json.loads(line) for line in (run_dir / "tasks" / task / "events-rank0.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in rows if r.get("event") == "step"]
        assert sorted(set(steps)) == list(range(len(set(steps)))) and len(set(steps)) == 12, (task, steps)
