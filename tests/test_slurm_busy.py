"""Slurm as a busy cluster shows it, without a cluster: the states a requeue, a preemption or a lost node leave (rows
as Slurm 22.05 prints them: the held row captured on the test cluster after `scontrol requeuehold`), the calls one
poll makes, and a controller that times out (backends/slurm/commands.py, with a stand-in command on the PATH).

pytest tests/test_slurm_busy.py
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_slurm_status import manifest_for

from slurm_router.backends.slurm import commands
from slurm_router.backends.slurm import queries as st
from slurm_router.errors import SchedulerUnavailable
from slurm_router.scheduler.task_view import TaskView, poll

SQUEUE_COLS = "JobArrayID:|,State:|"


def runner_for(squeue: str, sacct: str, calls: list[str] | None = None):
    def run(argv: list[str]) -> str:
        if calls is not None:
            calls.append(argv[0])
        return squeue if argv[0] == "squeue" else sacct if argv[0] == "sacct" else ""

    return run


def one_task(squeue: str, sacct: str) -> TaskView:
    (task,) = st.collect_status(manifest_for("7", 1), runner_for(squeue, sacct))
    return task


# (squeue -t all row, sacct -X -D rows) -> (state, ended?, requeues, words in the reason)
CASES = {
    # `scontrol requeuehold 7` on the test cluster (captured): squeue says PENDING with the hold as its reason
    "requeue_hold": (
        "7_0|PENDING|0:00|1||job requeued in held state|0|",
        "7_0|7|REQUEUED|0:0|00:00:03|vm|2026-11-28T05:55:17|2026-11-28T05:55:20",
        ("PENDING", False, 1, "scontrol release 7_0"),
    ),
    "requeue_hold_state": (
        "7_0|REQUEUE_HOLD|0:00|1|||0|",
        "7_0|7|REQUEUED|0:0|00:00:03|vm|2026-11-28T05:55:17|2026-11-28T05:55:20",
        ("REQUEUE_HOLD", False, 1, "scontrol release 7_0"),
    ),
    # preempted with PreemptMode=REQUEUE: the attempt's row says PREEMPTED, then Slurm queues it again
    "preempted_requeued": (
        "7_0|PENDING|0:00|1||BeginTime|0|",
        "7_0|7|PREEMPTED|0:15|00:01:10|vm|2026-11-28T05:00:00|2026-11-28T05:01:10\n"
        "7_0|9|PENDING|0:0|00:00:00|None assigned|Unknown|Unknown",
        ("PENDING", False, 1, "BeginTime"),
    ),
    # the moment between: squeue has purged nothing yet and still says PREEMPTED: waiting, not ended
    "preempted": (
        "7_0|PREEMPTED|1:10|0|vm|None|15|",
        "7_0|7|PREEMPTED|0:15|00:01:10|vm|2026-11-28T05:00:00|2026-11-28T05:01:10",
        ("PREEMPTED", False, 0, "waits to run again"),
    ),
    "requeued": (
        "",
        "7_0|7|REQUEUED|0:0|00:00:20|vm|2026-11-28T05:00:00|2026-11-28T05:00:20",
        ("REQUEUED", False, 1, "waits to run again"),
    ),
    # a node lost under a --requeue job: the NODE_FAIL attempt, then the job running again elsewhere
    "node_fail_requeued": (
        "7_0|RUNNING|0:05|1|vm2|None|0|",
        "7_0|7|NODE_FAIL|0:0|00:02:00|vm|2026-11-28T05:00:00|2026-11-28T05:02:00\n"
        "7_0|7|RUNNING|0:0|00:00:05|vm2|2026-11-28T05:02:30|Unknown",
        ("RUNNING", False, 1, None),
    ),
    "node_fail": (
        "",
        "7_0|7|NODE_FAIL|0:0|00:02:00|vm|2026-11-28T05:00:00|2026-11-28T05:02:00",
        ("NODE_FAIL", True, 0, None),
    ),
    "boot_fail": (
        "",
        "7_0|7|BOOT_FAIL|0:0|00:00:00|vm|2026-11-28T05:00:00|2026-11-28T05:00:00",
        ("BOOT_FAIL", True, 0, None),
    ),
    "out_of_memory": (
        "7_0|OUT_OF_MEMORY|0:40|0|vm|OutOfMemory|0|",
        "7_0|7|OUT_OF_MEMORY|0:125|00:00:40|vm|2026-11-28T05:00:00|2026-11-28T05:00:40",
        ("OUT_OF_MEMORY", True, 0, None),
    ),
    "deadline": (
        "",
        "7_0|7|DEADLINE|0:0|00:00:00|None assigned|Unknown|2026-11-28T05:00:00",
        ("DEADLINE", True, 0, None),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_requeue_and_failure_states_map_to_the_task_words(case):
    squeue, sacct, (state, ended, requeues, reason) = CASES[case]
    task = one_task(squeue, sacct)
    assert (task.state, task.terminal, task.requeues) == (state, ended, requeues), task
    if reason:
        assert reason in (task.reason or ""), task.reason


def test_a_preempted_task_keeps_a_wait_going_until_the_grace_ends(monkeypatch):
    monkeypatch.setenv(commands.POLL_MIN_ENV, "0")
    squeue, sacct, _ = CASES["preempted"]
    manifest = manifest_for("7", 1)
    polls: list[int] = []
    tasks = st.wait_for_run(
        manifest, runner_for(squeue, sacct), poll_s=0.01, on_poll=lambda t: polls.append(1), unknown_grace_s=0.3
    )
    assert len(polls) > 3, "a PREEMPTED task ended the wait at once"
    assert tasks[0].state == "PREEMPTED" and "not requeued for" in tasks[0].reason


def test_one_squeue_and_at_most_one_sacct_per_poll_whatever_the_tasks():
    n = 100
    live = "\n".join(f"7_{i}|RUNNING|0:10|0|vm|None|0|" for i in range(n))
    calls: list[str] = []
    tasks = st.collect_status(manifest_for("7", n), runner_for(live, "", calls))
    assert len(tasks) == n and calls == ["squeue"], calls  # every task live in squeue: sacct adds nothing
    one_ended = live.replace("7_3|RUNNING|0:10|0|vm|None|0|", "7_3|COMPLETED|0:10|0|vm|None|0|")
    calls.clear()
    st.collect_status(manifest_for("7", n), runner_for(one_ended, "", calls))
    assert calls == ["squeue", "sacct"], calls


def test_a_wait_says_an_unreachable_controller_and_carries_on(capsys):
    answers = iter(
        [SchedulerUnavailable("squeue failed 5 time(s) over 31 s (Socket timed out on send/recv operation)")]
    )
    done = TaskView(stage="s", variant="v", job_id="7", state="COMPLETED")

    def collect() -> list[TaskView]:
        for error in answers:
            raise error
        return [done]

    assert poll(collect, poll_s=0.01) == [done]
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "squeue failed 5 time(s)" in line and "asking again in" in line, line


def stand_in(bin_dir: Path, name: str, fail_first: int, error: str) -> Path:
    """`name` on the PATH that answers `error` (exit 1) to its first fail_first calls, then prints 'ok'."""
    count = bin_dir / f"{name}.count"
    script = bin_dir / name
    script.write_text(
        "#!/bin/bash\n"
        f'n=$(cat "{count}" 2>/dev/null || echo 0); echo $((n+1)) > "{count}"\n'
        f'if [ "$n" -lt {fail_first} ]; then echo "{name}: error: {error}" >&2; exit 1; fi\n'
        "echo ok\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return count


@pytest.fixture
def fast_retries(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(commands.RETRY_S_ENV, "0.01")
    monkeypatch.setenv(commands.TRIES_ENV, "3")
    return bin_dir


@pytest.mark.parametrize(
    "error", ["Socket timed out on send/recv operation", "Unable to contact slurm controller (connect failure)"]
)
def test_a_busy_controller_is_retried_each_retry_in_one_line(fast_retries, capsys, error):
    count = stand_in(fast_retries, "scontrol", 2, error)
    assert commands.run_command(["scontrol", "ping"]) == "ok\n"
    assert count.read_text().strip() == "3"
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 2 and all(line.startswith("scontrol: ") and "try " in line for line in said), said


def test_past_the_limit_one_error_names_the_command_and_what_to_do(fast_retries):
    count = stand_in(fast_retries, "sacct", 99, "Socket timed out on send/recv operation")
    with pytest.raises(SchedulerUnavailable) as raised:
        commands.run_command(["sacct", "-j", "7"])
    assert count.read_text().strip() == "3"
    message = str(raised.value)
    assert message.startswith("sacct failed 3 time(s)") and "Socket timed out" in message and "scontrol ping" in message


def test_a_refusal_is_not_retried(fast_retries):
    count = stand_in(fast_retries, "squeue", 99, "Invalid job id specified")
    assert commands.run_command(["squeue", "-j", "12345"]) == ""
    assert count.read_text().strip() == "1"


def test_the_submitit_entry_prints_what_submitit_reads(fast_retries):
    """submitit runs `python -m slurm_router.backends.slurm.commands sbatch FILE` and reads 'job N' from it."""
    (fast_retries / "sbatch").write_text("#!/bin/bash\necho 41\n")
    (fast_retries / "sbatch").chmod(0o755)
    proc = subprocess.run(
        [sys.executable, "-m", "slurm_router.backends.slurm.commands", "sbatch", "/x.sh"],
        capture_output=True,
        text=True,
    )
    assert (proc.returncode, proc.stdout) == (0, "Submitted batch job 41\n"), proc.stderr


def manifest_named(name: str, submitted_at: float) -> dict:
    manifest = manifest_for("1140", 2)
    manifest["jobs"][0].update(name=name, submitted_at=submitted_at)
    return manifest


# captured on the test cluster: `squeue -O ...,Name:|,SubmitTime:|` and `sacct --format=...,JobName,Submit`
SUBMITTED = "2026-11-28T06:06:28"
SQUEUE_1140 = (
    f"1140_1|RUNNING|0:00|0|vm|None|0|g40-check|{SUBMITTED}|\n1140_0|RUNNING|0:00|0|vm|None|0|g40-check|{SUBMITTED}|"
)
SACCT_1140_1 = f"1140_1|1140|COMPLETED|0:0|00:00:02|vm|2026-11-28T06:06:29|2026-11-28T06:06:31|g40-check|{SUBMITTED}"


def epoch(text: str) -> float:
    import time

    return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))


def test_a_job_id_is_matched_by_id_name_and_submit_time():
    ours = st.collect_status(manifest_named("g40-check", epoch(SUBMITTED) - 1), runner_for(SQUEUE_1140, ""))
    assert [t.state for t in ours] == ["RUNNING", "RUNNING"]
    # the ids came round again: Slurm's 1140 is another experiment's job now
    other = st.collect_status(manifest_named("lora_ab-variants", epoch(SUBMITTED) - 1), runner_for(SQUEUE_1140, ""))
    assert [t.state for t in other] == ["UNKNOWN", "UNKNOWN"], other
    assert "is another job (named g40-check, not lora_ab-variants): its id was used again" in other[0].reason


def test_an_older_job_of_the_same_id_and_name_in_the_accounting_is_not_the_run_s():
    """After the accounting was reset, sacct holds an older job 1140 of the same experiment beside the run's own."""
    older = SACCT_1140_1.replace("COMPLETED|0:0", "FAILED|1:0").replace(SUBMITTED, "2026-10-01T10:00:00")
    manifest = manifest_named("g40-check", epoch(SUBMITTED) - 1)
    for rows in (f"{older}\n{SACCT_1140_1}", f"{SACCT_1140_1}\n{older}"):
        task = st.collect_status(manifest, runner_for("", rows))[1]
        assert (task.state, task.exit_code, task.requeues) == ("COMPLETED", "0:0", 0), (rows, task)
    (alone,) = [t for t in st.collect_status(manifest, runner_for("", older)) if t.variant == "v1"]
    assert alone.state == "UNKNOWN" and "submitted 2026-10-01T10:00:00, before this run" in alone.reason


def test_a_command_that_hangs_is_a_controller_that_does_not_answer(fast_retries):
    hang = fast_retries / "squeue"
    hang.write_text("#!/bin/bash\nexec sleep 30\n")
    hang.chmod(0o755)
    with pytest.raises(SchedulerUnavailable) as raised:
        commands.run_slurm(["squeue"], commands.Retry(tries=2, first_s=0.01), timeout_s=1.0)
    assert str(raised.value).startswith("squeue failed 2 time(s)") and "no answer in 1 s" in str(raised.value)


def test_the_report_job_facts_fall_back_to_the_run_dir_when_the_controller_never_answers(capsys):
    from slurm_router.analysis import jobfacts
    from slurm_router.analysis.load import Task

    manifest = {**manifest_for("15", 1), "tasks": {"v0": {"state": "completed", "elapsed_s": 12.0}}}

    def unreachable(argv: list[str]) -> str:
        raise SchedulerUnavailable(f"{argv[0]} failed 5 time(s) over 31 s (Unable to contact slurm controller)")

    facts = jobfacts.job_facts(manifest, [Task("v0", manifest["tasks"]["v0"])], unreachable)
    assert (facts["v0"]["source"], facts["v0"]["state"], facts["v0"]["elapsed_s"]) == ("local", "COMPLETED", 12.0)
    assert "job facts come from the run dir: squeue failed 5 time(s)" in capsys.readouterr().err


def test_the_user_s_own_comment_is_kept_beside_the_submission_s_token(tmp_path, fast_retries):
    """launcher.additional_parameters={comment: ...} is the script's #SBATCH --comment; the command line's --comment
    (the token an sbatch is found by after a lost reply) would replace it, so it carries the user's text too."""
    seen = fast_retries / "args"
    (fast_retries / "sbatch").write_text(f'#!/bin/bash\necho "$@" > "{seen}"\necho 41\n')
    (fast_retries / "sbatch").chmod(0o755)
    script = tmp_path / "submit.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --comment='my run 1'\n#SBATCH --job-name=x\nexec true\n")
    assert commands.sbatch([str(script)], "submit.sbatch") == "41"
    assert f"--comment=my run 1 {commands.COMMENT_PREFIX}" in seen.read_text()
