"""Issue 50's hostile cases, each through the real command where a user meets it (cases 5 and 6, bad experiment
files, are rows of tests/test_bad_input_table.py):

1. an lm-eval task file beside another with the same `task:` name is scored itself, not its sibling; a valid one
   is not refused with a broken sibling's error;
2. a task that had finished stays completed when the Ctrl-C's TERM lands as its process exits; resume=, status and
   the report agree, and resume= corrects a manifest that recorded such a task failed;
3. a finished task whose adapter/ was deleted: export names the command, resume= says so and trains it again;
4. a metric whose higher_is_better differs between the submission's check and the calls inside a task fails the
   task in one line instead of recording the checked value;
7. a task that failed before any evaluation after step 0 shows no val_loss (a dash), not the base's step-0 loss;
11. (a newcomer's friction) prune=true with train.eval_every too large suggests a value that is accepted.
"""

import json
import os
import signal
from pathlib import Path

import pytest
from conftest import event_rows, read_json, run_cli, run_dir_of, start_cli, wait_until

pytestmark = pytest.mark.integration

TESTS = Path(__file__).parent
SMALL = [
    "base.enabled=false",
    "train.steps=2",
    "train.eval_batches=1",
    "data.max_documents=40",
    "launcher.cpu_slots=1",
]


def _env(*folders: Path, **extra: str) -> dict:
    """tests/ (and `folders`) on PYTHONPATH: the jobs import the toy metric too."""
    path = [*map(str, folders), str(TESTS), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p), **extra}


def _run(tmp: Path, *args: str, code: int = 0, **extra: str):
    proc = run_cli(*SMALL, *args, f"run_root={tmp / 'runs'}", cwd=tmp, env=_env(**extra), timeout=900)
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _lm_eval_task(folder: Path, name: str, n: int, local: bool = True) -> Path:
    """A multiple-choice task file `name`.yaml called toy_mc, of n documents (or, local=False, on the Hub)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{chr(97 + i)}>", "label": i % 2}) + "\n" for i in range(n)))
    source = f"json\ndataset_kwargs:\n  data_files:\n    test: {data}\n" if local else "someone/a_hub_dataset\n"
    (folder / f"{name}.yaml").write_text(
        f"task: toy_mc\ndataset_path: {source}test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_choice: ["y", "z"]\ndoc_to_target: label\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n    higher_is_better: true\n    aggregation: mean\n"
    )
    return folder / f"{name}.yaml"


def test_an_lm_eval_task_file_is_scored_itself_never_a_sibling_of_the_same_task_name(tmp_path):
    """swap/: a_other.yaml (12 documents) sorts first and shares b_named.yaml's `task: toy_mc`: lm-eval's folder
    scan registered a_other, and the run scored 12 examples where the named file has 5. broken/: a valid
    b_valid.yaml was refused with its sibling a_broken.yaml's error (its data on the Hub)."""
    pytest.importorskip("lm_eval")
    _lm_eval_task(tmp_path / "swap", "a_other", 12)
    named = _lm_eval_task(tmp_path / "swap", "b_named", 5)
    _lm_eval_task(tmp_path / "broken", "a_broken", 3, local=False)
    valid = _lm_eval_task(tmp_path / "broken", "b_valid", 7)
    run_dir = run_dir_of(_run(tmp_path, f"eval.metrics.mc={named}", f"eval.metrics.ok={valid}"))
    evals = [r for r in event_rows(run_dir / "tasks" / "main") if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(len(r["metrics"]["mc"]["scores"]) == 5 for r in evals), [r["metrics"]["mc"] for r in evals]
    assert all(len(r["metrics"]["ok"]["scores"]) == 7 for r in evals)
    assert "Duplicate task name" not in (run_dir / "logs" / "main.log").read_text()


# Imported first by every Python process whose PYTHONPATH holds its folder; in a local job process only (its
# launcher's pid in the environment) it makes the interpreter's exit slow: after main() returned, when the
# interpreter has reset the signal handlers and tears down its modules. The Ctrl-C lands there.
SLOW_EXIT = """
import os
if os.environ.get("SLURM_ROUTER_LAUNCHER_PID") and os.environ.get("SLOW_EXIT_MARK"):
    import time

    class _SlowExit:
        def __del__(self, mark=os.environ["SLOW_EXIT_MARK"], sleep=time.sleep, open=open):
            open(mark, "w").close()
            sleep(4)

    _kept_until_teardown = _SlowExit()
"""


def _status(run_dir: Path, tmp: Path) -> str:
    proc = run_cli(str(run_dir), module="slurm_router.status", cwd=tmp, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_a_ctrl_c_as_a_finished_task_exits_keeps_it_completed_and_resume_corrects_an_old_manifest(tmp_path):
    """The job process has written its result and is exiting when the launcher's TERM comes: the task was recorded
    `failed`, exit -15 (status FAILED, the report listing it missing). It stays completed; the run ends with the
    line naming the report's command (exit 130), status says COMPLETED, resume= writes the report with nothing
    missing. A manifest written before the fix (failed, -15) is recorded completed by resume=, which says so."""
    probe, mark = tmp_path / "probe", tmp_path / "exiting"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(SLOW_EXIT)
    env = _env(probe, SLOW_EXIT_MARK=str(mark))
    proc = start_cli(*SMALL, f"run_root={tmp_path / 'runs'}", cwd=tmp_path, env=env)
    try:
        wait_until(mark.exists, "the job process's exit", 600)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    run_dir = next((tmp_path / "runs").glob("default/*"))
    assert proc.returncode == 130 and "Traceback" not in out + err, out + err
    task = read_json(run_dir / "manifest.json")["tasks"]["main"]
    assert task["state"] == "completed", task
    assert read_json(run_dir / "manifest.json")["state"] == "completed"
    assert f"python -m slurm_router.analysis {run_dir} writes the report" in out
    assert "COMPLETED" in _status(run_dir, tmp_path)
    resumed = run_cli(f"resume={run_dir}", cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0 and "writing the report" in resumed.stdout, resumed.stdout + resumed.stderr
    assert read_json(run_dir / "report" / "summary.json")["missing"] == []

    manifest = read_json(run_dir / "manifest.json")  # as the launcher recorded it before the fix
    manifest["tasks"]["main"].update(state="failed", exit_code=-15)
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    again = run_cli(f"resume={run_dir}", cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "main completed (its result is whole: recorded completed, not failed)" in again.stdout, again.stdout
    assert read_json(run_dir / "manifest.json")["tasks"]["main"]["state"] == "completed"
    status = _status(run_dir, tmp_path)
    assert "COMPLETED" in status and "FAILED" not in status, status


def test_a_deleted_adapter_is_trained_again_by_resume_and_export_says_so(tmp_path):
    """tasks/main/adapter/ deleted after the run: resume= said "nothing to do" and export said to resume. export
    now names resume=, which says in one line that it trains the task again; the adapter is back, as trained."""
    import shutil

    run_dir = run_dir_of(_run(tmp_path))
    adapter = run_dir / "tasks" / "main" / "adapter"
    before = (adapter / "adapter_model.safetensors").read_bytes()
    shutil.rmtree(adapter)
    refused = run_cli(str(run_dir), "main", module="slurm_router.export", cwd=tmp_path, timeout=300)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1, refused.stdout + refused.stderr
    assert f"it was deleted after the task completed: python -m slurm_router resume={run_dir} trains" in lines[0]

    resumed = run_cli(f"resume={run_dir}", cwd=tmp_path, env=_env(), timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    said = [line for line in resumed.stdout.splitlines() if "is gone" in line]
    assert said == [f"resume: main completed, but its {adapter} is gone: the task trains again to rebuild it"]
    assert (adapter / "adapter_model.safetensors").read_bytes() == before
    exported = run_cli(str(run_dir), "main", module="slurm_router.export", cwd=tmp_path, timeout=300)
    assert exported.returncode == 0 and str(adapter) in exported.stdout, exported.stdout + exported.stderr


def test_a_metric_whose_direction_changes_inside_the_task_fails_it_in_one_line(tmp_path):
    """higher_is_better=True when asked for no examples (the submission's check), False when it scores: every
    eval row recorded True. Now the first evaluation fails the task, naming the metric and both values."""
    proc = _run(tmp_path, "eval.metrics.d=toy_metric:flips_direction", code=1)
    run_dir = next((tmp_path / "runs").glob("default/*"))
    end = [r for r in event_rows(run_dir / "tasks" / "main") if r["event"] == "end"][-1]
    assert end["exit_state"] == "failed", end
    assert "eval.metrics.d=toy_metric:flips_direction failed at the evaluation of step 0" in end["error"]
    assert "higher_is_better changed from True to False" in end["error"], end["error"]
    assert not [r for r in event_rows(run_dir / "tasks" / "main") if r["event"] == "eval"], proc.stdout


def test_a_task_that_failed_after_step_0_shows_no_val_loss(tmp_path):
    """The metric raises at the step-2 evaluation: the task failed with only its step-0 evaluation, the base's
    loss, which its table row showed as val_loss (equal to the base row's). It shows a dash now."""
    proc = _run(
        tmp_path,
        "train.steps=4",
        "train.eval_every=2",
        "eval.metrics.acc=toy_metric:next_letter",
        code=1,
        TOY_METRIC_FAIL_AT="0",
        TOY_METRIC_FAIL_CALL="2",
    )
    run_dir = run_dir_of(proc)
    evals = [r["step"] for r in event_rows(run_dir / "tasks" / "main") if r["event"] == "eval"]
    assert evals == [0]
    summary = read_json(run_dir / "report" / "summary.json")
    main = summary["variants"]["main"]
    assert main.get("val_loss") is None and main["val_loss_start"] == summary["base"]["val_loss"], main
    row = next(line for line in proc.stdout.splitlines() if line.startswith("│ main "))
    assert row.split("│")[2].strip() == "-", row


def test_prune_with_eval_every_too_large_suggests_a_value_that_is_accepted(tmp_path):
    """Issue 50, 11: the refusal suggested train.eval_every=25 whatever train.steps was (25 >= 10 is refused too)."""
    args = ["+experiment=lora_ab", "prune=true", "seeds=2", "train.steps=10", "dry_run=true", f"run_root={tmp_path}"]
    proc = run_cli(*args, "train.eval_every=20", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    line = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1]
    assert "set e.g. train.eval_every=2 " in line, line
    proc = run_cli(*args, "train.eval_every=2", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
