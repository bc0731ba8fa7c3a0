"""python -m slurm_router.status as a script reads it: one JSON object per task (state, job id, step/total, losses,
tokens/s, ETA, requeues, retries, logs), the table's step and ETA columns, --follow, and the list of recent runs.

The progress comes from the newest rows of each task's events file, found from its end (task_progress); the
real run below checks it against what the task wrote (events, result.json) while it runs and once it ended.

    pytest tests/test_status_cli.py
"""

from __future__ import annotations

import io
import json
import os
import platform
import signal
import time
from pathlib import Path

import pytest
from conftest import event_rows, run_cli, slowdown, start_cli, wait_until

from slurm_router.cli import run_list
from slurm_router.cli import status as cli_status
from slurm_router.rundir.progress import last_rows, pace, read_progress
from slurm_router.scheduler.task_view import TaskView


def _row(kind: str, **fields) -> str:
    return json.dumps({"event": kind, "time": fields.pop("time", 0.0), **fields}, separators=(",", ":"))


def test_last_rows_reads_the_newest_rows_of_a_kind_from_the_end(tmp_path):
    """Newest first; a row being written (no newline yet) is skipped; a kind far back (the start's evaluation
    behind a long run's step rows) is still found; no file, an empty file or no such row: []."""
    path = tmp_path / "events-rank0.jsonl"
    lines = [_row("start", steps=5000), _row("eval", step=0, val_loss=3.5)]
    lines += [_row("step", step=i, loss=1.0 / (i + 1), n_tokens=100, attempt=0, time=float(i)) for i in range(5000)]
    path.write_text("\n".join(lines) + "\n" + '{"event":"step","step":5000,"lo')  # torn: a crash mid-write
    newest = last_rows(path, "step", 3)
    assert [r["step"] for r in newest] == [4999, 4998, 4997]
    assert last_rows(path, "eval") == [{"event": "eval", "time": 0.0, "step": 0, "val_loss": 3.5}]
    assert last_rows(path, "end") == [] and last_rows(tmp_path / "none.jsonl", "step") == []
    (tmp_path / "empty.jsonl").write_text("")
    assert last_rows(tmp_path / "empty.jsonl", "step") == []


def test_pace_is_the_recent_steps_wall_time_of_the_current_attempt():
    rows = [{"step": s, "time": 100.0 + 2 * s, "n_tokens": 1000, "attempt": 1, "t_step_s": 1.5} for s in (9, 8, 7, 6)]
    rows.append({"step": 5, "time": 10.0, "n_tokens": 1000, "attempt": 0})  # before a requeue: not this pace
    tokens, eta = pace(rows, steps=20)
    assert tokens == pytest.approx(3000 / 6) and eta == pytest.approx(10 * 2.0)  # 10 steps left at 2 s each
    assert pace(rows[:1], steps=20) == (pytest.approx(1000 / 1.5), pytest.approx(10 * 1.5))  # one row: its step time
    assert pace([], steps=20) == (None, None)


def test_log_follower_prefixes_new_lines_and_starts_where_a_user_expects(tmp_path):
    running, ended = tmp_path / "a.out", tmp_path / "b.out"
    running.write_text("".join(f"old {i}\n" for i in range(30)))
    ended.write_text("finished long ago\n")
    tasks = [
        TaskView(stage="variants", variant="a", job_id="1_0", state="RUNNING", log_path=str(running)),
        TaskView(stage="variants", variant="b", job_id="1_1", state="COMPLETED", log_path=str(ended)),
    ]
    out = io.StringIO()
    follower = cli_status.LogFollower(out, backlog=3)
    follower.poll(tasks, first=True)  # a running task: its last lines; an ended one: nothing of the past
    assert out.getvalue().splitlines() == ["[a] old 27", "[a] old 28", "[a] old 29"]
    with open(running, "a") as f:
        f.write("step 1\nhalf a li")
    follower.poll(tasks)
    with open(running, "a") as f:
        f.write("ne\n")
    follower.poll(tasks)
    assert out.getvalue().splitlines()[3:] == ["[a] step 1", "[a] half a line"]


def test_run_state_is_made_current():
    live = {"15": "RUNNING", "16": "PENDING"}
    submitted = {"state": "submitted", "launcher": "sbatch", "jobs": [{"job_id": "16"}, {"job_id": "15"}]}
    assert run_list.run_state(submitted, live, 0, 2) == "running"
    assert run_list.run_state(submitted | {"jobs": [{"job_id": "16"}]}, live, 0, 2) == "pending"
    assert run_list.run_state(submitted | {"jobs": [{"job_id": "9"}]}, live, 2, 2) == "completed"
    assert run_list.run_state(submitted | {"jobs": [{"job_id": "9"}]}, live, 1, 2) == "ended"
    gone = {"state": "running", "launcher": "local", "owner": {"pid": 2**22 + 7, "host": platform.node()}}
    assert run_list.run_state(gone, {}, 0, 2).startswith("interrupted")
    assert run_list.run_state({"state": "failed"}, {}, 0, 2) == "failed"


def test_bad_run_root_and_run_dir_are_one_line(tmp_path, capsys):
    assert cli_status.main(["--run-root", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--run-root" in err[0] and "no such folder" in err[0]
    assert cli_status.main([str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert cli_status.main(["--run-root", str(tmp_path)]) == 0
    assert "no runs under" in capsys.readouterr().out


def _table_rows(text: str) -> dict[str, dict[str, str]]:
    """The status table's rows (a rich table: a header row of ┃ cells, rows of │ cells), by variant."""
    lines = text.splitlines()
    header = [c.strip() for c in next(l for l in lines if "┃" in l).split("┃")[1:-1]]
    rows = [dict(zip(header, (c.strip() for c in l.split("│")[1:-1]))) for l in lines if l.startswith("│")]
    return {r["variant"]: r for r in rows if r.get("variant")}


FAST = [
    "+experiment=lora_ab",
    "base.steps=10",
    "train.steps=16",
    "train.eval_every=4",
    "train.eval_batches=2",
    "data.max_documents=60",
]
SLOW = slowdown("3")


@pytest.mark.integration
def test_status_of_a_real_run_while_it_runs_and_after(tmp_path, base_cache):
    """A local run: while it runs, --json says each task's step of its total, its losses, tokens/s and an ETA,
    and the table shows them; --follow prints its tasks' log lines, each prefixed with its name, and returns
    when every task has ended; then the figures are the ones the tasks wrote, and the run is listed."""
    root = tmp_path / "runs"
    proc = start_cli(*FAST, f"base.cache_dir={base_cache}", f"run_root={root}", cwd=tmp_path, env=SLOW)
    try:
        manifest = wait_until(lambda: next(root.glob("lora_ab/*/manifest.json"), None), "run dir", timeout=120)
        run_dir = manifest.parent
        r8 = run_dir / "tasks" / "r8"
        wait_until(
            lambda: sum(r["event"] == "step" for r in event_rows(r8)) >= 3, "r8 at step 3", timeout=300, poll_s=0.3
        )
        # r8 is held mid-run (its worker stopped) while status looks, so it is running, a fast machine or not
        worker = next(r["pid"] for r in event_rows(r8) if r["event"] == "start")
        os.kill(worker, signal.SIGSTOP)
        try:
            rows = event_rows(r8)
            newest = [r for r in rows if r["event"] == "step"][-1]
            live = run_cli(str(run_dir), "--json", module="slurm_router.status", timeout=60)
            table = run_cli(str(run_dir), module="slurm_router.status", timeout=60)
        finally:
            os.kill(worker, signal.SIGCONT)
        assert live.returncode == 0, live.stderr
        task = {t["task"]: t for t in json.loads(live.stdout)["tasks"]}["r8"]
        assert task["state"] == "RUNNING" and (task["step"], task["steps"]) == (newest["step"] + 1, 16), task
        assert 3 <= task["step"] < 16 and task["train_loss"] == newest["loss"], (task, newest)
        assert task["val_loss"] == [r for r in rows if r["event"] == "eval"][-1]["val_loss"] > 0, task
        assert task["tokens_per_s"] > 0 and 0 < task["eta_s"] < 3600, task
        row = _table_rows(table.stdout)["r8"]
        assert (row["state"], row["step"]) == ("RUNNING", f"{task['step']}/16") and row["ETA"] != "-", table.stdout

        follow = run_cli(str(run_dir), "--follow", "--poll-s", "0.5", module="slurm_router.status", timeout=600)
        assert follow.returncode == 0, follow.stdout[-2000:] + follow.stderr[-2000:]
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = follow.stdout.splitlines()
    assert lines and all(line.startswith(("[r8]", "[r32]", "[base]")) for line in lines), lines[:5]
    assert any(line.startswith("[r8] ") and '"val_loss"' in line for line in lines), lines  # its result line
    assert "COMPLETED" in follow.stderr and "FAILED" not in follow.stderr, follow.stderr

    done = run_cli(str(run_dir), "--json", module="slurm_router.status", timeout=60)
    tasks = {t["task"]: t for t in json.loads(done.stdout)["tasks"]}
    for name in ("r8", "r32"):
        t, rows = tasks[name], event_rows(run_dir / "tasks" / name)
        result = json.loads((run_dir / "tasks" / name / "result.json").read_text())
        last_step = [r for r in rows if r["event"] == "step"][-1]
        assert (t["state"], t["step"], t["steps"], t["eta_s"], t["requeues"], t["attempts"]) == (
            "COMPLETED",
            16,
            16,
            None,
            0,
            1,
        )
        assert t["train_loss"] == last_step["loss"] and t["val_loss"] == result["val_loss"] and t["val_step"] == 16
        assert t["tokens_per_s"] > 0 and Path(t["log_path"]).is_file() and t["retries"] == [] and t["retry"] is None
    assert read_progress(run_dir / "tasks" / "r8", running=False).step == 16

    listed = run_cli("--run-root", str(root), "--json", module="slurm_router.status", timeout=60)
    assert listed.returncode == 0, listed.stderr
    runs = json.loads(listed.stdout)
    assert len(runs) == 1 and runs[0]["run_dir"] == str(run_dir) and runs[0]["state"] == "completed"
    assert (runs[0]["experiment"], runs[0]["launcher"], runs[0]["tasks_total"]) == ("lora_ab", "local", 3)
    assert runs[0]["tasks_done"] == 3 and abs(runs[0]["created"] - time.time()) < 3600
    text = run_cli("--run-root", str(root), module="slurm_router.status", timeout=60, cwd=tmp_path)
    assert "completed" in text.stdout and "3/3" in text.stdout and str(run_dir) in text.stdout
