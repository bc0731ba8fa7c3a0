"""Every window of a stop signal ends cleanly (issue 12, finding 6), with real processes and real signals:
exit 130 (or the task's 75), one line, no traceback, finished work recorded as finished.

Windows: before anything is written (imports, compose, data loading: a loop of delays hits them); worker
start-up, just after a task wrote its result, and the report (made wide enough to hit every time by
SLURM_ROUTER_TEST_PAUSE, which only tests set: supervisor.test_pause sleeps there)."""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from conftest import event_rows, read_json, run_cli, start_cli, wait_until

pytestmark = pytest.mark.integration

FAST = [
    "base.enabled=false",
    "train.steps=2",
    "train.checkpoint_every=1",
    "data.max_documents=60",
    "train.eval_batches=2",
    "launcher.cpu_slots=2",
]
PAUSE = "SLURM_ROUTER_TEST_PAUSE"


def _run_dir(root: Path) -> Path | None:
    found = list(root.glob("default/*/manifest.json"))
    return found[0].parent if found else None


def _finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


SPAWN_MASK = textwrap.dedent("""
    import sys
    from slurm_router.supervise.supervisor import spawn_blocked, stop_signals_blocked

    def report(rank, path):
        with open("/proc/self/status") as f:
            open(f"{path}.{rank}", "w").write(next(line for line in f if line.startswith("SigBlk")).split()[1])

    if __name__ == "__main__":
        with stop_signals_blocked():
            ctx = spawn_blocked(report, (sys.argv[1],), int(sys.argv[2]))
        ctx.join()
        import multiprocessing.forkserver as fs                 # the forkserver (2 workers) keeps them blocked
        if fs._forkserver._forkserver_pid:
            with open(f"/proc/{fs._forkserver._forkserver_pid}/status") as f:
                open(f"{sys.argv[1]}.server", "w").write(next(l for l in f if l.startswith("SigBlk")).split()[1])
""")


@pytest.mark.parametrize("workers", [1, 2], ids=["spawned", "forked_from_the_forkserver"])
def test_spawned_workers_start_with_every_stop_signal_blocked(tmp_path, workers):
    """CPython's resource tracker unblocks INT and TERM when it starts (on the first spawn); workers used to start
    with only USR2 blocked, and a TERM during their start-up killed them (task exit 1). Several workers are forked
    from a forkserver (supervisor.spawn_blocked): it and they start blocked too."""
    script, out = tmp_path / "spawn_mask.py", tmp_path / "mask"
    script.write_text(SPAWN_MASK)
    subprocess.run([sys.executable, str(script), str(out), str(workers)], check=True, timeout=300)
    masks = {p.name: int(p.read_text(), 16) for p in tmp_path.glob("mask.*")}
    assert set(masks) == {f"mask.{r}" for r in range(workers)} | ({"mask.server"} if workers > 1 else set())
    for name, blocked in masks.items():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2):
            assert blocked & (1 << (sig - 1)), f"{sig.name} not blocked in {name} (SigBlk {blocked:x})"


def _workers(job_pid: int) -> list[int]:
    """The job process's workers: its descendants but multiprocessing's resource tracker and forkserver (the
    workers of a task with several devices are forked from that)."""
    workers = []
    for child in psutil.Process(job_pid).children():
        cmdline = " ".join(child.cmdline())
        if "forkserver" in cmdline:  # its children (same command line: forked) are the workers
            workers += [c.pid for c in child.children()]
        elif "resource_tracker" not in cmdline:
            workers.append(child.pid)
    return workers


# Who gets the stop signal during the workers' start-up: the launcher (Ctrl-C, `kill`), which stops the job
# process with SIGTERM; or the job process and its workers at once, as Slurm signals a job step.
STARTUP_CASES = {
    "ctrl_c": ("launcher", signal.SIGINT),
    "kill": ("launcher", signal.SIGTERM),
    "INT_to_the_task": ("task", signal.SIGINT),
    "TERM_to_the_task": ("task", signal.SIGTERM),
}


@pytest.mark.parametrize("case", list(STARTUP_CASES))
def test_a_stop_during_worker_start_up_is_a_clean_stop(case, tmp_path):
    target, sig = STARTUP_CASES[case]
    proc = start_cli(
        *FAST, "resources.devices_per_task=2", f"run_root={tmp_path}", cwd=tmp_path, env={PAUSE: "worker_startup=4"}
    )

    def log() -> str:
        path = (_run_dir(tmp_path) or tmp_path) / "logs" / "main.log"
        return path.read_text() if path.is_file() else ""

    try:
        wait_until(lambda: log().count("test pause: worker_startup") == 2, "two workers in start-up")
        run_dir = _run_dir(tmp_path)
        job = read_json(run_dir / "manifest.json")["tasks"]["main"]["pid"]
        if target == "launcher":
            proc.send_signal(sig)
        else:
            for pid in [job, *_workers(job)]:
                psutil.Process(pid).send_signal(sig)
        out, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    task = read_json(run_dir / "manifest.json")["tasks"]["main"]
    assert task["exit_code"] == 75, f"task exit {task['exit_code']}: {log()[-1500:]}"  # never killed by the signal
    assert "Traceback" not in out + err + log() and "killed by" not in log(), out + err + log()
    assert event_rows(run_dir / "tasks" / "main")[-1]["exit_state"] == "interrupted"
    assert not list((run_dir / "tasks" / "main").glob("checkpoints/step-*.pt"))  # stopped before the first step
    assert read_json(run_dir / "manifest.json")["state"] == "interrupted"
    assert f"resume={run_dir}" in out + err
    if target == "launcher":
        assert proc.returncode == 130, out + err


def _handles_sigterm(pid: int) -> bool:
    """The command's own code runs: it has installed its SIGTERM handler (SigCgt in /proc). Before that, the
    interpreter itself is starting, a window no program can handle."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = int(next(line for line in f if line.startswith("SigCgt")).split()[1], 16)
    except (OSError, StopIteration):
        return False
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_ctrl_c_before_anything_is_written_is_one_line(tmp_path):
    """Imports, compose, data loading, then the run dir and the first task: a signal at delays spread over them
    (from the moment the command's code runs). Before the run dir exists: `interrupted: nothing was written`;
    after: the run is interrupted, with the resume= hint."""
    hits = {"nothing written": 0, "run dir": 0}
    for i, delay in enumerate([0.0, 0.2, 0.5, 1.0, 1.6, 2.4, 3.5, 4.5, 6.0]):
        sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
        root = tmp_path / f"attempt{i}"
        proc = start_cli(*FAST, f"run_root={root}", cwd=tmp_path)
        wait_until(
            lambda: _handles_sigterm(proc.pid) or proc.poll() is not None, "the command's handlers", 120, poll_s=0.005
        )
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            pass
        proc.send_signal(sig)
        out, err = _finish(proc)
        what = f"{sig.name} after {delay} s: rc {proc.returncode}\n{out[-1500:]}\n{err[-1500:]}"
        assert proc.returncode == 130 and "Traceback" not in out + err, what
        run_dir = _run_dir(root)
        if run_dir is None:
            assert [line for line in err.splitlines() if line.strip()][-1] == "interrupted: nothing was written", what
            assert not root.exists() or not any(root.rglob("*.json")), what
            hits["nothing written"] += 1
        else:
            if read_json(run_dir / "manifest.json")["state"] == "completed":  # a fast machine: in the report
                assert "interrupted before the report was written: every task has ended" in out, what
            else:
                assert read_json(run_dir / "manifest.json")["state"] == "interrupted", what
                assert f"resume={run_dir}" in out, what
            assert out.strip().splitlines()[-1] == f"run_dir: {run_dir}", what
            hits["run dir"] += 1
    print(hits)
    assert hits["nothing written"] >= 2, hits


CTRL_C_IN_A_DATACLASS = textwrap.dedent("""
    import sys
    import slurm_router.__main__ as command
    import slurm_router.cli.run as workflow
    import slurm_router.rundir.lock  # noqa: F401  (what the interrupted path imports: none left to exec a string)
    import slurm_router.rundir.manifest  # noqa: F401

    def compose(overrides, multirun):  # a Ctrl-C while an import builds a dataclass's methods (exec of a string)
        exec("raise KeyboardInterrupt")

    workflow.compose = compose
    sys.exit(command.main(["train.steps=2"]))
""")


def test_ctrl_c_inside_an_exec_of_a_string_still_exits_130(tmp_path):
    """CPython notes a KeyboardInterrupt leaving exec("...") as unhandled even when caught later, and under
    `python -m` then ends the process by SIGINT (rc -2) after our one line: what the start-up Ctrl-C test once saw
    under load (the signal landed while dataclasses built a class). main() clears the note; exit 130."""
    pkg = tmp_path / "ctrl_c_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(CTRL_C_IN_A_DATACLASS)
    env = {"PYTHONPATH": str(tmp_path)}
    proc = start_cli(cwd=tmp_path, env=env, module="ctrl_c_probe")
    out, err = _finish(proc, timeout=120)
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert err.strip().splitlines()[-1] == "interrupted: nothing was written" and "Traceback" not in err, err


CTRL_C_AS_THE_MANIFEST_APPEARS = textwrap.dedent("""
    import os
    import signal
    import sys
    import slurm_router.__main__ as command
    import slurm_router.rundir.manifest as manifest

    made = manifest.create_run_dir

    def create_run_dir(*args, **kwargs):  # the signal lands the moment the run dir is whole
        run = made(*args, **kwargs)
        os.kill(os.getpid(), signal.SIG{sig})
        return run

    manifest.create_run_dir = create_run_dir
    sys.exit(command.main(sys.argv[1:]))
""")


@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_a_stop_the_moment_the_manifest_exists_marks_the_run_interrupted(sig, tmp_path):
    """The run's lock is taken as its directory is made, so there is no moment in which the manifest says
    `running` while the command thinks nothing was written (what a CI run once caught at a 1 s SIGTERM):
    exit 130, the run interrupted, the resume= hint."""
    pkg = tmp_path / "stop_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(CTRL_C_AS_THE_MANIFEST_APPEARS.replace("{sig}", sig))
    root = tmp_path / "runs"
    proc = start_cli(*FAST, f"run_root={root}", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, module="stop_probe")
    out, err = _finish(proc, timeout=300)
    run_dir = _run_dir(root)
    assert proc.returncode == 130 and "Traceback" not in out + err and run_dir is not None, (proc.returncode, out, err)
    assert "nothing was written" not in err, err
    assert read_json(run_dir / "manifest.json")["state"] == "interrupted"
    assert f"resume={run_dir}" in out and out.strip().splitlines()[-1] == f"run_dir: {run_dir}", out


def _stop_after(tmp_path: Path, sig: signal.Signals, pause: str, ready) -> tuple[subprocess.Popen, Path, str, str]:
    proc = start_cli(*FAST, f"run_root={tmp_path}", cwd=tmp_path, env={PAUSE: pause})
    try:
        run_dir = wait_until(lambda: (r := _run_dir(tmp_path)) and ready(r) and r, pause)
        proc.send_signal(sig)
        out, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, run_dir, out, err


def _assert_completed_report_left(proc, run_dir: Path, out: str, err: str) -> None:
    """Exit 130, no traceback, the task and the run completed, and the one line saying who writes the report."""
    log = (run_dir / "logs" / "main.log").read_text()
    assert proc.returncode == 130 and "Traceback" not in out + err + log, out + err + log
    manifest = read_json(run_dir / "manifest.json")
    assert manifest["state"] == "completed", manifest
    assert manifest["tasks"]["main"]["state"] == "completed" and manifest["tasks"]["main"]["exit_code"] == 0
    assert (run_dir / "tasks" / "main" / "result.json").is_file()
    hint = f"python -m slurm_router.analysis {run_dir} writes the report"
    assert len([line for line in out.splitlines() if hint in line]) == 1, out
    assert not (run_dir / "report" / "summary.json").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_ctrl_c_just_after_a_task_wrote_its_result_keeps_it_completed(sig, tmp_path):
    proc, run_dir, out, err = _stop_after(
        tmp_path, sig, "after_result=4", lambda r: (r / "tasks" / "main" / "result.json").is_file()
    )
    _assert_completed_report_left(proc, run_dir, out, err)
    resumed = run_cli(f"resume={run_dir}", cwd=tmp_path, timeout=600)  # every task completed: writes the report
    assert resumed.returncode == 0 and "writing the report" in resumed.stdout, resumed.stdout + resumed.stderr
    assert json.loads((run_dir / "report" / "summary.json").read_text())
    again = run_cli(f"resume={run_dir}", cwd=tmp_path, timeout=300)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_ctrl_c_during_the_report_keeps_the_run_completed(sig, tmp_path):
    proc, run_dir, out, err = _stop_after(
        tmp_path, sig, "report=6", lambda r: read_json(r / "manifest.json", {}).get("state") == "completed"
    )
    _assert_completed_report_left(proc, run_dir, out, err)
    analysis = run_cli(str(run_dir), module="slurm_router.analysis", cwd=tmp_path, timeout=600)
    assert analysis.returncode == 0 and (run_dir / "report" / "summary.json").is_file(), analysis.stderr


def _signal_dropped_in_a_callback(sig: signal.Signals) -> None:
    """`sig` to this process, handled while the interpreter runs a __del__: the handler's KeyboardInterrupt is
    printed ("Exception ignored") and dropped, and this returns normally."""
    import os

    class SignalledWhileCollected:
        def __del__(self):
            os.kill(os.getpid(), sig)
            sum(range(1000))  # the handler runs here, inside the callback

    SignalledWhileCollected()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_the_interpreter_drops_is_raised_again_at_the_launchers_next_loop():
    """A KeyboardInterrupt raised while the interpreter runs a callback (here a __del__; in a run, importlib's
    module-lock cleanup during a lazy import) is printed and dropped; the command's handler counted it, and the
    launcher's loops (the local queue, each stage, the report) raise it again."""
    from slurm_router.rundir.lifecycle import forget_stops, raise_if_stop_dropped, raise_stop

    before = signal.signal(signal.SIGINT, raise_stop)
    try:
        forget_stops()
        raise_if_stop_dropped()  # nothing raised yet: nothing to raise again
        _signal_dropped_in_a_callback(signal.SIGINT)
        reached = True  # the Ctrl-C did not stop this code
        with pytest.raises(KeyboardInterrupt):
            raise_if_stop_dropped()
    finally:
        signal.signal(signal.SIGINT, before)
        forget_stops()
    assert reached


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_error_that_a_dropped_ctrl_c_caused_is_reported_as_the_interrupt(monkeypatch, capsys):
    """Seen under load: a SIGTERM inside Hydra's compose, swallowed there, surfaced as `error: unknown key
    'defaults'` with exit 2. The command counted the stop, so the error after it reads as the interrupt: one
    line, exit 130, as a Ctrl-C at that moment always did."""
    import slurm_router.__main__ as cli
    import slurm_router.cli.run as workflow
    from slurm_router.errors import UserError

    def compose_hit_by_a_signal(argv, multirun):
        _signal_dropped_in_a_callback(signal.SIGTERM)
        raise UserError("unknown key 'defaults'")

    monkeypatch.setattr(workflow, "run", compose_hit_by_a_signal)
    assert cli.main(["train.steps=2"]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "interrupted: nothing was written" and "unknown key" not in err, err

    monkeypatch.setattr(workflow, "run", lambda argv, multirun: (_ for _ in ()).throw(UserError("a real mistake")))
    assert cli.main(["train.steps=2"]) == 2  # no stop this time: the error is the user's
    assert capsys.readouterr().err.strip() == "error: a real mistake"
