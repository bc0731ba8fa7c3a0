"""launcher.setup, launcher.python and launcher.mail_type/mail_user (issue 15): how both Slurm launchers form the
job. setup's lines are the user's shell, run as written before the task (in the directory the run was submitted
from); every other value stays quoted. The submitit side is checked in the sbatch text submitit itself renders,
and on the real cluster.

    pytest tests/test_job_setup.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, run_dir_of, wait_until

from slurm_router.backends.slurm.sbatch_launcher import report_script, sbatch_spec
from slurm_router.backends.slurm.sbatch_render import SbatchSpec, render_sbatch
from slurm_router.backends.slurm.submitit_launcher import job_setup, submitit_params, submitit_python
from slurm_router.config.compose import compose

SRUN = pytest.mark.skipif(shutil.which("srun") is None, reason="submitit's Slurm executor needs srun on the PATH")
RECORDER = r"""#!{python}
import json, os, sys
with open({record!r}, "a") as f:
    f.write(json.dumps({{"argv": sys.argv, "cwd": os.getcwd(), "SETUP_MARK": os.environ.get("SETUP_MARK"),
                        "PYTHONSAFEPATH": os.environ.get("PYTHONSAFEPATH"),
                        "HOSTILE": os.environ.get("HOSTILE"), "PYTHONPATH": os.environ.get("PYTHONPATH")}}) + "\n")
os.execv({python!r}, [{python!r}, *sys.argv[1:]])
"""


def _recorder(path: Path, record: Path) -> Path:
    """A real interpreter wrapper: records how it was called, then runs the real python with the same arguments."""
    path.write_text(RECORDER.format(python=sys.executable, record=str(record)))
    path.chmod(0o755)
    return path


def test_setup_lines_run_as_written_and_nothing_else_does(tmp_path):
    """The setup lines are shell ($(...) runs, in the submission directory, before the exports); a hostile value
    anywhere else reaches the task as literal text; the snapshot is first on PYTHONPATH; set -u comes back."""
    record = tmp_path / "calls.jsonl"
    python = _recorder(tmp_path / "py", record)
    run_dir = tmp_path / "run $(touch pwned)"
    hostile = "$(touch pwned) `touch pwned`"
    spec = SbatchSpec(
        job_name="j",
        run_dir=str(run_dir),
        array_size=1,
        python=str(python),
        task_argv=("-c", "import sys; sys.exit(0)", hostile),
        env=(("HOSTILE", hostile),),
        setup=('export SETUP_MARK=$(echo ran-in)-$(basename "$PWD")', "true $UNSET_IS_FINE_HERE"),
        pythonpath=str(run_dir / "code"),
    )
    (run_dir / "logs").mkdir(parents=True)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec))
    submitted_from = tmp_path / "submitted-from"
    submitted_from.mkdir()
    env = {**os.environ, "PYTHONPATH": "/elsewhere"}
    proc = subprocess.run(["bash", str(script)], cwd=submitted_from, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    call = json.loads(record.read_text())
    assert call["SETUP_MARK"] == "ran-in-submitted-from" and call["HOSTILE"] == hostile
    assert call["argv"][1:] == ["-c", "import sys; sys.exit(0)", hostile] and call["cwd"] == str(run_dir)
    assert call["PYTHONPATH"] == f"{run_dir / 'code'}:/elsewhere"
    assert not list(tmp_path.rglob("pwned"))
    text = script.read_text()
    assert text.index("set +u") < text.index("\nexport SETUP_MARK") < text.index("set -u") < text.index("cd ")


def test_both_launchers_take_the_same_options():
    cfg = compose(
        [
            "launcher=sbatch",
            "launcher.setup=['module load cuda/12.1', 'source ~/venv/bin/activate']",
            "launcher.python=/opt/py 3/bin/python",
            "launcher.mail_type=[end,fail]",
            "launcher.mail_user=someone@example.org",
        ]
    )
    spec = sbatch_spec(cfg, "/r", "variants", 1, 1, None, pythonpath="/r/code")
    assert spec.python == "/opt/py 3/bin/python"
    assert spec.setup == ("module load cuda/12.1", "source ~/venv/bin/activate")
    text = render_sbatch(spec)
    assert "#SBATCH --mail-type=END,FAIL\n#SBATCH --mail-user=someone@example.org\n" in text
    assert "\nexec '/opt/py 3/bin/python' -m slurm_router.supervise.job --run-dir /r --stage variants\n" in text
    report = report_script(cfg, "/r", "/r/code")  # the report job: the same setup, snapshot and interpreter
    lines = report.splitlines()
    at = lines.index("module load cuda/12.1")  # as written, each after the number of its line
    assert lines[at - 1 : at + 3] == [
        "_slurm_router_setup_line=1",
        "module load cuda/12.1",
        "_slurm_router_setup_line=2",
        "source ~/venv/bin/activate",
    ]
    assert report.endswith("cd /r\nexec '/opt/py 3/bin/python' -m slurm_router.analysis /r")

    cfg = compose(
        [
            "launcher=slurm",
            "launcher.setup=['module load cuda/12.1']",
            "launcher.python=/opt/py 3/bin/python",
            "launcher.mail_type=END",
            "launcher.mail_user=someone@example.org",
        ]
    )
    params = submitit_params(cfg, 1, "variants", None, "/r", "/r/code")
    setup = params["slurm_setup"]  # the user's line as written, in setup_lines.guarded's frame, then ours
    assert setup[setup.index("module load cuda/12.1") - 2 :] == [
        "set -e",
        "_slurm_router_setup_line=1",
        "module load cuda/12.1",
        "set +e",
        "_slurm_router_setup_line=0",
        '[ "$(trap -p EXIT)" != "$_slurm_router_trap" ] || trap - EXIT      # an EXIT trap of your own stays',
        'rm -f /r/logs/setup-failed."$_slurm_router_job"',
        "# ---- end of launcher.setup ----",
        'export PYTHONPATH=/r/code"${PYTHONPATH:+:$PYTHONPATH}"',
        "export PYTHONSAFEPATH=1",
    ]
    assert params["slurm_mail_type"] == "END" and params["slurm_mail_user"] == "someone@example.org"
    assert submitit_python(cfg, None) == "'/opt/py 3/bin/python'"
    default = compose(["launcher=sbatch"])
    assert sbatch_spec(default, "/r", "v", 1, 1, None).python == sys.executable  # the submitter's, by default
    assert job_setup(default, None) == []


@SRUN
def test_submitit_renders_setup_python_and_mail(tmp_path):
    """The sbatch text submitit itself writes from these parameters (the real library)."""
    import submitit

    cfg = compose(
        [
            "launcher=slurm",
            "launcher.setup=['module load cuda/12.1']",
            "launcher.python=/opt/py 3/bin/python",
            "launcher.mail_type=[END,FAIL]",
            "launcher.mail_user=someone@example.org",
        ]
    )
    ex = submitit.AutoExecutor(folder=tmp_path / "%j", cluster="slurm", slurm_python=submitit_python(cfg, None))
    ex.update_parameters(**submitit_params(cfg, 1, "variants", None, "/r", "/r/code"))
    slurm = ex._executor
    text = slurm._make_submission_file_text(slurm._submitit_command_str, "uid")
    assert "#SBATCH --mail-type=END,FAIL\n" in text and "#SBATCH --mail-user=someone@example.org\n" in text
    assert "\n# setup\n# ---- launcher.setup" in text
    assert (
        "\nmodule load cuda/12.1\nset +e\n" in text
        and "# ---- end of launcher.setup ----\n"
        'export PYTHONPATH=/r/code"${PYTHONPATH:+:$PYTHONPATH}"\nexport PYTHONSAFEPATH=1\n'
    ) in text
    assert "'/opt/py 3/bin/python' -u -m submitit.core._submit" in text


@pytest.mark.slurm
@pytest.mark.skipif(
    shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first"
)
def test_submitit_job_runs_setup_then_launcher_python(tmp_path):
    """launcher=slurm on the real cluster: submitit's process is launcher.python (a wrapper that records its call),
    started after the setup line, in the submission directory, with the snapshot first on PYTHONPATH and
    PYTHONSAFEPATH=1 (tests/test_snapshot.py shows what that keeps out); the task completes."""
    record = tmp_path / "calls.jsonl"
    python = _recorder(tmp_path / "lab-python", record)
    proc = run_cli(
        "launcher=slurm",
        "train.steps=2",
        "train.eval_batches=2",
        "data.max_documents=40",
        f"run_root={tmp_path / 'runs'}",
        f"launcher.python={python}",
        "launcher.setup=['export SETUP_MARK=from-setup']",
        "launcher.mail_type=END",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    wait_until(
        lambda: (run_dir / "tasks" / "main" / "result.json").is_file(), "the task's result", timeout=180, poll_s=0.5
    )
    call = json.loads(record.read_text().splitlines()[0])
    assert call["argv"][1:4] == ["-u", "-m", "submitit.core._submit"], call
    assert call["SETUP_MARK"] == "from-setup" and call["cwd"] == str(tmp_path)
    assert call["PYTHONPATH"].split(":")[0] == str(run_dir / "code") and call["PYTHONSAFEPATH"] == "1"
