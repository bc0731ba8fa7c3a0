"""Status parsing on squeue/sacct outputs captured from Slurm 22.05 (tests/golden/slurm_outputs), and the CLI.

pytest tests/test_slurm_status.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import failed_base_manifest

from slurm_router.backends.slurm import queries as st
from slurm_router.cli import status as cli_status

OUT = Path(__file__).parent / "golden" / "slurm_outputs"


def read(name: str) -> str:
    return (OUT / name).read_text()


def manifest_for(job_id: str, n: int, run_dir: Path | None = None, launcher: str = "slurm") -> dict:
    logs = run_dir / "logs" if run_dir else Path("/nonexistent")
    return {
        "run_id": "r1",
        "experiment": "exp",
        "run_dir": str(run_dir),
        "launcher": launcher,
        "jobs": [
            {
                "stage": "variants",
                "job_id": job_id,
                "array": True,
                "tasks": [
                    {
                        "variant": f"v{i}",
                        "array_index": i,
                        "log_path": str(logs / f"{job_id}_{i}.out"),
                        "err_path": str(logs / f"{job_id}_{i}.err"),
                    }
                    for i in range(n)
                ],
            }
        ],
        "tasks": {},
    }


@pytest.mark.parametrize(
    "raw, seconds",
    [
        ("00:01:09", 69),
        ("1:09", 69),
        ("0:00", 0),
        ("2-03:04:05", 183845),
        ("12:00:00", 43200),
        ("INVALID", None),
        ("", None),
    ],
)
def test_parse_duration(raw, seconds):
    assert st.parse_duration(raw) == seconds


def test_format_duration_takes_the_local_launchers_float_seconds():
    from slurm_router.scheduler.task_view import format_duration

    assert format_duration(3725.6) == "1:02:06" and format_duration(59) == "0:00:59" and format_duration(None) == "-"


def test_normalize_state_and_array_ranges():
    assert st.normalize_state("CANCELLED by 0") == "CANCELLED"
    assert st.normalize_state("OUT_OF_MEMORY") == "OUT_OF_MEMORY"
    assert st.normalize_state("") == "UNKNOWN"
    assert st.expand_array_indices("0-5%2") == [0, 1, 2, 3, 4, 5]
    assert st.expand_array_indices("1,3-4") == [1, 3, 4]
    assert st.expand_array_indices("0-8:4") == [0, 4, 8]


def test_final_array_mixed_states():
    """Job 15: task 0 ok, 1 exit 3, 2 timed out, 3 requeued once then ok, 4 cancelled while running."""
    sacct = st.parse_sacct(read("sacct_final.txt"))
    assert {k: r.state for k, r in sacct.items()} == {
        "15_0": "COMPLETED",
        "15_1": "FAILED",
        "15_2": "TIMEOUT",
        "15_3": "COMPLETED",
        "15_4": "CANCELLED",
    }
    assert sacct["15_1"].exit_code == "3:0"
    assert sacct["15_2"].elapsed_s == 69
    assert sacct["15_3"].requeues == 1 and sacct["15_0"].requeues == 0
    squeue = st.parse_squeue(read("squeue_final.txt"))  # tasks 0 and 1 already aged out of the controller
    assert set(squeue) == {"15_2", "15_3", "15_4"} and squeue["15_3"].requeues == 1

    tasks = st.merge_status(manifest_for("15", 5), squeue, sacct)
    assert [t.state for t in tasks] == ["COMPLETED", "FAILED", "TIMEOUT", "COMPLETED", "CANCELLED"]
    assert [t.requeues for t in tasks] == [0, 0, 0, 1, 0]
    assert tasks[1].exit_code == "3:0" and tasks[1].variant == "v1" and tasks[1].job_id == "15_1"
    assert all(t.terminal for t in tasks)


def test_requeued_task_is_pending_not_done():
    sacct = st.parse_sacct(read("sacct_requeue_pending.txt"))
    assert sacct["15_3"].state == "PENDING" and sacct["15_3"].requeues == 1 and sacct["15_3"].node is None
    squeue = st.parse_squeue(read("squeue_requeue_pending.txt"))
    assert squeue["15_3"].reason == "BeginTime"
    tasks = st.merge_status(manifest_for("15", 5), squeue, sacct)
    assert tasks[3].state == "PENDING" and not tasks[3].terminal and tasks[3].requeues == 1


def test_pending_array_expands_to_every_task():
    squeue = st.parse_squeue(read("squeue_held_array.txt"))
    assert sorted(squeue) == [f"20_{i}" for i in range(6)]
    assert squeue["20_5"].state == "PENDING" and squeue["20_5"].reason == "JobHeldUser"
    sacct = st.parse_sacct(read("sacct_cancelled_array.txt"))  # cancelled before any task started
    tasks = st.merge_status(manifest_for("20", 6), {}, sacct)
    assert {t.state for t in tasks} == {"CANCELLED"}


def test_lagging_accounting_row_is_not_a_task_state():
    """Right after submission sacct may hold only a record under the array's base id: it names no task."""
    sacct = st.parse_sacct(read("sacct_lagging_master_row.txt"))
    tasks = st.merge_status(manifest_for("15", 2), {}, sacct)
    assert [t.state for t in tasks] == ["UNKNOWN", "UNKNOWN"]
    # ... but squeue knows better while the controller still has the job.
    tasks = st.merge_status(manifest_for("15", 2), st.parse_squeue("15_0|RUNNING|0:03|0|vm|None|\n"), sacct)
    assert tasks[0].state == "RUNNING" and tasks[0].elapsed_s == 3 and tasks[1].state == "UNKNOWN"


def test_failed_never_reported_completed_when_squeue_and_sacct_disagree():
    squeue = st.parse_squeue("15_1|FAILED|0:00|0|vm|NonZeroExitCode|\n")
    sacct = st.parse_sacct("15_1|17|RUNNING|0:0|00:00:01|vm|2026-01-01T00:00:00|Unknown\n")
    manifest = {"jobs": [{"stage": "s", "job_id": "15", "array": True, "tasks": [{"variant": "v1", "array_index": 1}]}]}
    [task] = st.merge_status(manifest, squeue, sacct)
    assert task.state == "FAILED" and task.exit_code is None


def test_plain_job_uses_base_id():
    manifest = {"jobs": [{"stage": "base", "job_id": "11", "array": False, "tasks": [{"variant": "base"}]}]}
    sacct = st.parse_sacct("11|11|COMPLETED|0:0|00:00:02|vm|2026-01-01T00:00:00|2026-01-01T00:00:02\n")
    [task] = st.merge_status(manifest, {}, sacct)
    assert (task.job_id, task.state, task.elapsed_s) == ("11", "COMPLETED", 2)


def test_single_item_array_submitted_as_plain_job():
    """submitit map_array over one item submits a plain job: the manifest says array task 0, Slurm says 18."""
    manifest = manifest_for("18", 1)
    [task] = st.merge_status(manifest, st.parse_squeue("18|RUNNING|0:07|0|vm|None|\n"), {})
    assert (task.state, task.job_id, task.elapsed_s) == ("RUNNING", "18", 7)
    sacct = st.parse_sacct("18|18|FAILED|1:0|00:00:09|vm|2026-01-01T00:00:00|2026-01-01T00:00:09\n")
    [task] = st.merge_status(manifest, {}, sacct)
    assert (task.state, task.exit_code) == ("FAILED", "1:0")
    # ... but in a many-task array a bare base-id row (accounting lag) still names no task.
    assert {t.state for t in st.merge_status(manifest_for("18", 2), {}, sacct)} == {"UNKNOWN"}


def test_local_manifest_states():
    manifest = {
        "launcher": "local",
        "jobs": [],
        "tasks": {
            "a": {"stage": "variants", "variant": "a", "state": "completed", "exit_code": 0},
            "b": {"stage": "variants", "variant": "b", "state": "failed", "exit_code": 1, "log_path": "/x"},
            "c": {"stage": "base", "variant": "c", "state": "cached"},
        },
    }
    tasks = st.collect_status(manifest, runner=lambda argv: pytest.fail(f"ran {argv}"))
    assert [(t.variant, t.state) for t in tasks] == [("a", "COMPLETED"), ("b", "FAILED"), ("c", "CACHED")]


def test_collect_status_queries_only_this_runs_jobs_and_tails_failed_logs(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "15_1.out").write_text("".join(f"line {i}\n" for i in range(30)))
    (tmp_path / "logs" / "15_1.err").write_text("Traceback\nboom\n")
    calls = []

    def runner(argv):
        calls.append(argv)
        return read("squeue_final.txt") if argv[0] == "squeue" else read("sacct_final.txt")

    tasks = st.collect_status(manifest_for("15", 5, tmp_path), runner)
    assert [c[0] for c in calls] == ["squeue", "sacct"]
    assert all(c[c.index("-j") + 1] == "15" for c in calls)
    assert "-X" in calls[1] and "-D" in calls[1]
    failed = tasks[1]
    assert failed.out_tail == [f"line {i}" for i in range(10, 30)] and failed.err_tail == ["Traceback", "boom"]
    assert tasks[0].out_tail == [] and tasks[0].err_tail == []

    cancelled = []
    assert st.cancel_run(manifest_for("15", 5), cancelled.append) == ["15"]
    assert cancelled == [["scancel", "15"]]


def test_wait_polls_until_terminal():
    outputs = iter(
        [
            "15_0|RUNNING|0:01|0|vm|None|\n15_1|PENDING|0:00|0||Resources|\n",
            "15_0|COMPLETED|0:02|0|vm|None|\n15_1|RUNNING|0:01|0|vm|None|\n",
            "15_0|COMPLETED|0:02|0|vm|None|\n15_1|OUT_OF_MEMORY|0:02|0|vm|OutOfMemory|\n",
        ]
    )
    polls = []
    tasks = st.wait_for_run(
        manifest_for("15", 2), lambda argv: next(outputs) if argv[0] == "squeue" else "", poll_s=0, on_poll=polls.append
    )
    assert len(polls) == 3 and [t.state for t in tasks] == ["COMPLETED", "OUT_OF_MEMORY"]


def test_resubmitted_task_is_the_latest_job():
    """resume= submits unfinished tasks again: each task is the job that submitted it last, and appears once."""
    manifest = manifest_for("15", 2)
    manifest["jobs"].append(
        {
            "stage": "variants",
            "job_id": "20",
            "array": True,
            "tasks": [{"variant": "v1", "array_index": 1, "job_id": "20_1"}],
        }
    )
    squeue = st.parse_squeue("20_1|RUNNING|0:05|0|vm|None|\n")
    sacct = st.parse_sacct("15_0|15_0|COMPLETED|0:0|00:00:09|vm|t|t\n15_1|15_1|TIMEOUT|0:0|00:10:00|vm|t|t\n")
    tasks = st.merge_status(manifest, squeue, sacct)
    assert [(t.variant, t.job_id, t.state) for t in tasks] == [("v0", "15_0", "COMPLETED"), ("v1", "20_1", "RUNNING")]
    assert [
        t.variant
        for t in st.live_tasks(manifest, lambda argv: "20_1|RUNNING|0:05|0|vm|None|\n" if argv[0] == "squeue" else "")
    ] == ["v1"]


def test_forgotten_job_state_comes_from_the_run_dir(tmp_path):
    """No squeue row (aged out) and no accounting: the task's own files say how it ended."""
    manifest = manifest_for("15", 3, tmp_path)
    for i in range(3):
        (tmp_path / f"v{i}").mkdir()
        manifest["tasks"][f"v{i}"] = {"task_dir": str(tmp_path / f"v{i}")}
    (tmp_path / "v0" / "result.json").write_text("{}")
    (tmp_path / "v1" / "events-rank0.jsonl").write_text(json.dumps({"event": "end", "exit_state": "failed"}) + "\n")
    tasks = st.collect_status(manifest, runner=lambda argv: "")
    assert [t.state for t in tasks] == ["COMPLETED", "FAILED", "UNKNOWN"]
    assert "run dir" in tasks[0].reason


def test_wait_gives_up_on_a_task_slurm_has_forgotten():
    """A wait ends once a task has had no record anywhere for the grace period, instead of polling forever."""
    outputs = iter(["15_0|RUNNING|0:01|0|vm|None|\n"] + ["15_0|COMPLETED|0:02|0|vm|None|\n"] * 100)
    tasks = st.wait_for_run(
        manifest_for("15", 2),
        lambda argv: next(outputs) if argv[0] == "squeue" else "",
        poll_s=0.01,
        unknown_grace_s=0.05,
    )
    assert [t.state for t in tasks] == ["COMPLETED", "UNKNOWN"]
    assert "no record" in tasks[1].reason


def test_an_ended_job_has_its_exit_code_before_sacct_records_it():
    """squeue's exit_code (a raw wait status, captured from Slurm 22.05: `exit 2` -> 512, `kill -9 $$` -> 9) is the
    exit code while slurmdbd has not yet recorded the end (sacct still says RUNNING, or has no row): a status
    --wait that returns then, or a report job that starts then, still says how the task ended."""
    squeue = st.parse_squeue("220|FAILED|0:01|0|vm|NonZeroExitCode|512|\n224|FAILED|0:01|0|vm|None|9|\n")
    assert (squeue["220"].exit_code, squeue["224"].exit_code) == ("2:0", "0:9")
    assert st.parse_squeue("225|RUNNING|0:04|0|vm|None|0|\n")["225"].exit_code is None  # not ended: no exit code
    lagging = st.parse_sacct("220|220|RUNNING|0:0|00:00:01|vm|2026-11-23T22:45:40|Unknown\n")
    for sacct in (lagging, {}):
        base, r8, r32 = st.merge_status(failed_base_manifest("221"), squeue, sacct)
        assert (base.state, base.exit_code) == ("FAILED", "2:0")
    recorded = st.parse_sacct(read("sacct_never_satisfied.txt"))  # once sacct has it, its own (exit 3)
    assert st.merge_status(failed_base_manifest("221"), squeue, recorded)[0].exit_code == "3:0"


def test_dependency_never_satisfied_is_terminal_and_names_the_failed_stage():
    """Captured from Slurm 22.05: base 220 failed (exit 3); 221 waited on it with --kill-on-invalid-dep=yes
    (Slurm cancelled it), 222 without (PENDING forever), 223 (the report) with afterany on 222."""
    squeue = st.parse_squeue(read("squeue_never_satisfied.txt"))
    sacct = st.parse_sacct(read("sacct_never_satisfied.txt"))
    assert (squeue["221_0"].state, squeue["221_0"].reason) == ("CANCELLED", "DependencyNeverSatisfied")
    assert (squeue["222_1"].state, squeue["222_1"].reason) == ("PENDING", "DependencyNeverSatisfied")
    assert (squeue["223"].state, squeue["223"].reason) == ("PENDING", "Dependency")
    assert st.never_runs(squeue["222_0"]) and not st.never_runs(squeue["223"]) and not st.never_runs(squeue["221_0"])
    blame = "DependencyNeverSatisfied: stage base failed (base FAILED)"
    for job, state in (("221", "CANCELLED"), ("222", "PENDING")):
        base, r8, r32 = st.merge_status(failed_base_manifest(job), squeue, sacct)
        assert (base.state, base.exit_code) == ("FAILED", "3:0")
        assert [(t.state, t.reason, t.terminal, t.blocked) for t in (r8, r32)] == [(state, blame, True, True)] * 2
    # squeue forgets the cancelled ones after MinJobAge, and sacct has no reason: never had a node is enough
    _, r8, _ = st.merge_status(failed_base_manifest("221"), {}, sacct)
    assert (r8.state, r8.reason) == ("CANCELLED", blame)
    # the same rows without a failed stage before them: no blame
    ok = failed_base_manifest("221")
    ok["stages"][1]["depends_on"] = []
    assert st.merge_status(ok, {}, sacct)[1].reason is None
    # ... and a PENDING task that only waits is neither terminal nor blamed
    [t] = st.merge_status(manifest_for("30", 1), st.parse_squeue("30_0|PENDING|0:00|0||Dependency|\n"), {})
    assert not t.terminal and not t.blocked


def test_wait_returns_on_a_task_pending_forever():
    def runner(argv):
        return read("squeue_never_satisfied.txt") if argv[0] == "squeue" else read("sacct_never_satisfied.txt")

    tasks = st.wait_for_run(failed_base_manifest("222"), runner, poll_s=0, timeout_s=5)
    assert [t.state for t in tasks] == ["FAILED", "PENDING", "PENDING"] and all(t.terminal for t in tasks)
    assert st.live_tasks(failed_base_manifest("222"), runner) == []
    assert (
        st.wait_for_job(
            "223",
            lambda argv: "223|PENDING|0:00|0||DependencyNeverSatisfied|\n" if argv[0] == "squeue" else "",
            poll_s=0,
        )
        == "PENDING (DependencyNeverSatisfied)"
    )


def test_cancel_never_runnable_cancels_only_those_and_the_waiting_report_job():
    calls = []

    def runner(argv):
        calls.append(argv)
        return read("squeue_never_satisfied.txt") if argv[0] == "squeue" else read("sacct_never_satisfied.txt")

    stuck, report = st.cancel_never_runnable(failed_base_manifest("222"), runner, report_too=True)
    assert [t.job_id for t in stuck] == ["222_0", "222_1"] and report == "223"
    assert calls[-1] == ["scancel", "223", "222_0", "222_1"]
    calls.clear()
    stuck, report = st.cancel_never_runnable(failed_base_manifest("222"), runner)  # launcher.wait: keep the report
    assert calls[-1] == ["scancel", "222_0", "222_1"] and report is None
    calls.clear()
    assert st.cancel_never_runnable(failed_base_manifest("221"), runner) == ([], None)  # Slurm cancelled them
    assert not any(c[0] == "scancel" for c in calls)


def test_table_names_the_failed_stage_and_the_tasks_it_took_down(capsys):
    manifest = failed_base_manifest("222") | {"run_id": "r", "experiment": "e", "run_dir": "/runs/e/1"}
    tasks = st.merge_status(
        manifest, st.parse_squeue(read("squeue_never_satisfied.txt")), st.parse_sacct(read("sacct_never_satisfied.txt"))
    )
    cli_status.render_table(manifest, tasks)
    out = capsys.readouterr().out
    assert "2 task(s) never ran (r8, r32): stage base failed (base FAILED)" in out
    assert "resume=/runs/e/1" in out and "Slurm keeps them PENDING" in out


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slurm_router.status", *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )


def test_cli_bad_run_dir(tmp_path):
    proc = run_cli(str(tmp_path / "missing"))
    assert proc.returncode == 2 and "missing" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli(str(tmp_path))
    assert proc.returncode == 2 and "manifest.json" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "manifest.json").write_text("{not json")
    proc = run_cli(str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_cli_local_run_json_and_table(tmp_path):
    manifest = {
        "run_id": "r",
        "experiment": "e",
        "launcher": "local",
        "jobs": [],
        "stages": [{"name": "variants", "tasks": ["a", "b"]}],  # what Manifest.load requires
        "tasks": {"a": {"variant": "a", "state": "completed"}, "b": {"variant": "b", "state": "failed"}},
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    proc = run_cli(str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [t["state"] for t in data["tasks"]] == ["COMPLETED", "FAILED"] and not data["all_completed"]
    proc = run_cli(str(tmp_path), "--wait", "--poll-s", "0")
    assert proc.returncode == 1 and "FAILED" in proc.stdout and "COMPLETED" in proc.stdout
