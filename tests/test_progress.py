"""Progress a user sees while a run trains (issue 41, item 8), through the real command: on a terminal a live bar per
task with its step, loss, tokens/s and ETA; captured (CI, a log file, a Slurm job's output) plain lines with the
same figures; `status RUN_DIR` gives the ETA while a task runs; `launcher.wait=true` follows a Slurm run the same
way, each task's line as it ends."""

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys

import pytest
from conftest import run_cli, run_dir_of, slowdown, start_cli, wait_until

pytestmark = pytest.mark.integration

SMALL = ["train.steps=20", "data.max_documents=60", "train.eval_batches=2"]
LINE = re.compile(r"^  variants/main: step (\d+)/20  loss \d+\.\d{3}  [\d,]+ tok/s(  ETA (\d+s|\d+m\d\ds))?$", re.M)


def test_plain_lines_when_not_a_terminal_and_status_gives_the_eta(tmp_path):
    proc = start_cli(*SMALL, f"run_root={tmp_path / 'runs'}", cwd=tmp_path, env=slowdown("3"))
    try:
        manifest = wait_until(lambda: next((tmp_path / "runs").glob("default/*/manifest.json"), None), "a run dir")
        run_dir = manifest.parent

        def running_with_steps():
            status = run_cli("status", str(run_dir), "--json", cwd=tmp_path, timeout=120)
            task = (json.loads(status.stdout)["tasks"] or [{}])[0] if status.returncode == 0 else {}
            return task if task.get("state") == "RUNNING" and (task.get("step") or 0) >= 2 else None

        task = wait_until(running_with_steps, "a running task with 2 steps", timeout=600, poll_s=1.0)
        assert task["eta_s"] is not None and task["eta_s"] > 0, task  # not '-' while it runs
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    lines = LINE.findall(out)
    steps = [int(step) for step, _, _ in lines]
    assert len(steps) >= 3 and steps == sorted(steps) and steps[-1] == 20, out[-3000:]
    assert all(eta for step, eta, _ in lines if int(step) < 20), lines  # an ETA on every line but the last
    assert "\nvariants/main: completed\n" in out
    shown = out[: out.index("variants/main: completed")]
    assert "\x1b[" not in shown + err and "━" not in shown  # no bar, no terminal codes in a log


def test_a_live_bar_on_a_terminal(tmp_path):
    primary, secondary = pty.openpty()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160", "TERM": "xterm"}
    args = [sys.executable, "-m", "slurm_router", *SMALL, f"run_root={tmp_path / 'runs'}"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary)
    os.close(secondary)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([primary], [], [], 600)
            if not ready:
                break
            try:
                data = os.read(primary, 65536)
            except OSError:  # the command closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        proc.wait(timeout=600)
    finally:
        os.close(primary)
        if proc.poll() is None:
            proc.kill()
    screen = b"".join(chunks).decode(errors="replace")
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)
    assert proc.returncode == 0, plain[-3000:]
    assert "━" in plain and "variants/main" in plain  # rich's bar, redrawn in place
    assert re.search(r"\d+/20 +loss \d+\.\d{3}  [\d,]+ tok/s  ETA \d+", plain), plain[-3000:]
    assert re.search(r"20/20", plain) and "variants/main: completed" in plain
    assert not LINE.search(plain)  # the bar, not the log's lines


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh first")
@pytest.mark.timeout(900)
def test_launcher_wait_follows_a_slurm_run_with_the_same_lines(tmp_path):
    proc = run_cli(
        *SMALL,
        "launcher=sbatch",
        "launcher.wait=true",
        "launcher.timeout_min=10",
        f"run_root={tmp_path / 'runs'}",
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"^submitted 1 array job\(s\): \d+", out, re.M), out[-3000:]
    steps = [int(step) for step, _, _ in LINE.findall(out)]
    assert steps and steps[-1] == 20, out[-3000:]  # the task's steps as it trained, before its end
    assert "\nvariants/main: COMPLETED\n" in out
    assert out.index("variants/main: COMPLETED") < out.index("run_dir: ")
    run_dir_of(proc)
