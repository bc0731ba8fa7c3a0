"""Runs started together, and previews among real runs (issue 41, findings 3, 4 and 9), through the real command:
runs started in the same second (a script launching them in parallel) each get their own run directory; a
dry_run=true preview cannot be resumed (one line, exit 2, the folder left as it was), is said to be one by
`analysis`, and is left out of the run list unless asked for; `analysis` of a run still running says so."""

import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
from conftest import read_json, run_cli, run_dir_of, start_cli, wait_until

pytestmark = pytest.mark.integration

FAST = ["base.enabled=false", "train.steps=2", "data.max_documents=60", "train.eval_batches=2", "launcher.cpu_slots=1"]

# Every run of the test is started "in the same second", and none makes its folder before all have chosen a name:
# what a script that launches runs in parallel meets when their checks end together.
SAME_SECOND = textwrap.dedent("""
    import os
    import sys
    import time
    from datetime import datetime
    from pathlib import Path

    import slurm_router.__main__ as command
    import slurm_router.rundir.manifest as manifest


    class SameSecond(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 1, 2, 3, 4, 5)


    manifest.datetime = SameSecond
    made, gate, n = manifest.create_run_dir, Path(sys.argv[1]), int(sys.argv[2])


    def create_run_dir(*args, **kwargs):
        (gate / str(os.getpid())).touch()
        give_up = time.monotonic() + 300
        while len(list(gate.iterdir())) < n and time.monotonic() < give_up:
            time.sleep(0.05)
        return made(*args, **kwargs)


    manifest.create_run_dir = create_run_dir
    sys.exit(command.main(sys.argv[3:]))
""")


def _files(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*")}


def test_runs_started_in_the_same_second_each_get_their_own_run_dir(tmp_path):
    pkg, gate, root = tmp_path / "same_second", tmp_path / "gate", tmp_path / "runs"
    pkg.mkdir()
    gate.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(SAME_SECOND)
    runs = [[*FAST, "dry_run=true"]] * 3 + [FAST]  # three previews and one real run, at once
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    procs = [
        start_cli(str(gate), str(len(runs)), *args, f"run_root={root}", cwd=tmp_path, env=env, module="same_second")
        for args in runs
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "File exists" not in out + err, (p.returncode, out[-2000:], err[-2000:])
    dirs = [run_dir_of(subprocess.CompletedProcess([], 0, out, err)) for out, err in outs]
    stamp = "2026-01-02_03-04-05"
    assert sorted(d.name for d in dirs) == [stamp, f"{stamp}_2", f"{stamp}_3", f"{stamp}_4"], dirs
    for d in dirs:  # each run's own files name its own folder
        manifest = read_json(d / "manifest.json")
        assert manifest["run_dir"] == str(d) and manifest["run_id"] == f"default-{d.name}", manifest
        assert read_json(d / "tasks" / "main" / "task.json")["run_dir"] == str(d)
    real = dirs[-1]
    assert read_json(real / "manifest.json")["state"] == "completed"
    assert read_json(real / "tasks" / "main" / "result.json")["steps"] == 2
    assert [read_json(d / "manifest.json")["state"] for d in dirs[:3]] == ["previewed"] * 3


def test_a_preview_is_not_resumed_and_analysis_says_it_is_one(tmp_path):
    preview = run_dir_of(run_cli(*FAST, "dry_run=true", f"run_root={tmp_path}", cwd=tmp_path, timeout=300))
    before = _files(preview)
    proc = run_cli(f"resume={preview}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert proc.stderr.strip() == (
        f"error: resume={preview}: a dry_run=true preview, never run: nothing to resume; to run it, give the "
        "command that made it without dry_run=true"
    )
    assert _files(preview) == before and read_json(preview / "manifest.json")["state"] == "previewed"
    proc = run_cli(str(preview), cwd=tmp_path, timeout=300, module="slurm_router.analysis")
    assert proc.returncode == 0, proc.stderr
    note = f"note: {preview} is a dry_run=true preview: nothing was trained, so its report has no results"
    assert proc.stdout.splitlines()[0] == note
    assert (preview / "report" / "report.md").is_file()  # still written, from what there is


def test_analysis_of_a_run_still_running_says_so(tmp_path):
    proc = start_cli(*FAST, f"run_root={tmp_path}", cwd=tmp_path, env={"SLURM_ROUTER_TEST_PAUSE": "worker_startup=60"})
    try:
        logs = lambda: tmp_path.glob("default/*/logs/main.log")  # noqa: E731
        log = wait_until(lambda: next((p for p in logs() if "test pause" in p.read_text()), None), "a paused worker")
        run_dir = log.parent.parent
        shown = run_cli(str(run_dir), cwd=tmp_path, timeout=300, module="slurm_router.analysis")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0] == (
        f"note: {run_dir} is still running; 1 of 1 task(s) have no result yet: this report shows what was logged so far"
    )


def test_previews_are_left_out_of_the_run_list_unless_asked_for(tmp_path):
    real = run_dir_of(run_cli(*FAST, f"run_root={tmp_path}", cwd=tmp_path, timeout=600))
    previews = [run_dir_of(run_cli(*FAST, "dry_run=true", f"run_root={tmp_path}", cwd=tmp_path)) for _ in range(2)]
    listed = run_cli("status", "--run-root", str(tmp_path), cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.strip().splitlines()
    assert [line.split()[-1] for line in lines[1:-1]] == [str(real)], listed.stdout
    assert lines[-1] == "2 dry_run=true preview(s) not listed (--previews lists them, --clean-previews deletes them)"
    rows = json.loads(run_cli("status", "--run-root", str(tmp_path), "--json", cwd=tmp_path).stdout)
    assert [r["run_dir"] for r in rows] == [str(real)]
    every = run_cli("status", "--run-root", str(tmp_path), "--previews", cwd=tmp_path).stdout.strip().splitlines()
    assert sorted(line.split()[-1] for line in every[1:]) == sorted(map(str, [real, *previews])), every
    assert os.path.isdir(previews[0])
