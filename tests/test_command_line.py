"""One command line (issue 29, item 5): `slurm-router run|status|analysis|export|resume` beside the `python -m`
forms (overrides alone still run), `--version`, "did you mean" for a mistyped key, an example value in a type
error, one word per state (the run list and the task table), and `status --json` with nulls and numbers."""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib.metadata import entry_points, version

import pytest
from conftest import event_rows, run_cli, run_dir_of

from slurm_router.__main__ import main

TINY = ["data=synthetic", "data.n_samples=64", "data.max_len=64", "data.mean_len=20", "train.steps=2"]
TINY += ["train.eval_batches=1", "launcher.cpu_slots=1"]


def test_the_console_script_is_main_and_says_its_version():
    (script,) = entry_points(group="console_scripts", name="slurm-router")
    assert script.value == "slurm_router.__main__:main" and script.load() is main
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout == f"slurm-router {version('slurm_router')}\n", proc.stderr
    installed = shutil.which("slurm-router")
    if installed:  # the installed script itself, as a user types it
        out = subprocess.run([installed, "--version"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout == proc.stdout, out.stderr


def test_help_lists_the_subcommands():
    out = run_cli("--help").stdout
    for word in ("run", "status", "analysis", "export", "resume"):
        assert f"\n  {word} " in out, out


@pytest.mark.parametrize(
    "args, code, expected",
    [
        (["run", "train.lrr=1"], 2, "unknown key 'train.lrr': did you mean train.lr? valid keys under train"),
        (["train.lrr=1"], 2, "did you mean train.lr?"),  # overrides alone: the run command, as before
        (["traim.steps=1"], 2, "unknown key 'traim': did you mean train?"),
        (["launcher=slurm", "launcher.partitoin=gpu"], 2, "did you mean launcher.partition?"),
        (["train.lr=abc"], 2, "could not be converted to Float: give a number, e.g. train.lr=0.002"),
        (["train.steps=many"], 2, "give a whole number, e.g. train.steps=60"),
        (["train.compile=maybe"], 2, "give true or false, e.g. train.compile=false"),
        (["resume"], 2, "resume needs a run directory: "),
        (["resume", "/nonexistent/run"], 2, "/nonexistent/run: no such directory"),
        (["export"], 2, "the following arguments are required: RUN_DIR"),
        (["analysis"], 2, "the following arguments are required: RUN_DIR"),
    ],
)
def test_subcommands_and_one_line_errors(args, code, expected, tmp_path):
    proc = run_cli(*args, cwd=tmp_path, timeout=120)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_status_subcommand_lists_runs(tmp_path):
    proc = run_cli("status", "--run-root", str(tmp_path), "--json", timeout=120)
    assert proc.returncode == 0 and json.loads(proc.stdout) == [], proc.stderr


def test_one_word_per_state_interrupted_in_the_run_list_and_the_task_table():
    from slurm_router.cli.run_list import run_state
    from slurm_router.scheduler.task_view import TERMINAL_STATES, local_tasks

    manifest = {
        "state": "interrupted",
        "launcher": "local",
        "tasks": {
            "a": {"stage": "variants", "state": "interrupted", "exit_code": 75},
            "b": {"stage": "variants", "state": "running"},  # never recorded its end: the run's word too
            "c": {"stage": "variants", "state": "completed", "exit_code": 0},
        },
    }
    assert run_state(manifest, {}, 1, 3) == "interrupted"
    states = {t.variant: t.state for t in local_tasks(manifest)}
    assert states == {"a": "INTERRUPTED", "b": "INTERRUPTED", "c": "COMPLETED"}
    assert "INTERRUPTED" in TERMINAL_STATES


def test_status_json_has_nulls_and_numbers(tmp_path):
    from slurm_router.cli.status import exit_status

    assert exit_status("0:15") == (0, 15) and exit_status("1:0") == (1, 0) and exit_status("75") == (75, None)
    assert exit_status("-") == (None, None) and exit_status(None) == (None, None)

    proc = run_cli(*TINY, f"run_root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run_dir = run_dir_of(proc)
    status = run_cli("status", str(run_dir), "--json", cwd=tmp_path, timeout=120)
    assert status.returncode == 0, status.stderr
    (task,) = json.loads(status.stdout)["tasks"]
    assert task["state"] == "COMPLETED" and task["exit_code"] == 0 and task["exit_signal"] is None, task
    for key, value in task.items():
        assert value not in ("-", ""), (key, value)
        if key in ("exit_code", "elapsed_s", "requeues", "step", "steps", "attempts", "tokens_per_s"):
            assert value is None or isinstance(value, (int, float)), (key, value)
    assert task["step"] == task["steps"] == 2


def test_status_and_the_report_show_one_tokens_per_s(tmp_path):
    """One definition of tokens/s (slurm_router/rundir/throughput.py): `status --json` shows the report's figure
    for the same task (summary.json and report.md), the real tokens of the steps after warm-up over their summed
    step time; the pace of the newest steps' wall time (evaluations between them included) has its own name."""
    longer = [a for a in TINY if a != "train.steps=2"] + ["train.steps=12", "train.eval_every=3"]
    proc = run_cli(*longer, f"run_root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run_dir = run_dir_of(proc)
    status = run_cli("status", str(run_dir), "--json", cwd=tmp_path, timeout=120)
    assert status.returncode == 0, status.stderr
    (task,) = json.loads(status.stdout)["tasks"]
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    report = summary["variants"][task["task"]]
    assert task["tokens_per_s"] == report["tokens_per_s"] > 0, (task, report)

    assert report["warmup_steps"] == 1  # 10% of 12 steps, at least one
    warm = [r for r in event_rows(run_dir / "tasks" / task["task"]) if r["event"] == "step" and r["step"] >= 1]
    assert task["tokens_per_s"] == pytest.approx(sum(r["n_tokens"] for r in warm) / sum(r["t_step_s"] for r in warm))
    assert f"| {task['task']} " in (md := (run_dir / "report" / "report.md").read_text())
    assert f"{task['tokens_per_s']:,.0f}" in md and "Tokens/s: the real (non-padding) tokens" in md
    assert task["pace_tokens_per_s"] > 0 and task["pace_tokens_per_s"] != task["tokens_per_s"], task
