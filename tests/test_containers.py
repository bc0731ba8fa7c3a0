"""launcher.container (issue 15): the rendered forms (golden files: the sbatch script with apptainer and with pyxis,
submitit's parameters for both), the batch shell that requeues from outside the image (bash, no Slurm), and the
real thing on the single-node Slurm test cluster with a stand-in runtime (tests/fake_runtime.py: a real program
that checks apptainer's arguments and execs the task where scontrol and squeue fail): one USR2 each, the task
requeued from outside the container, resumed, completed.

    pytest tests/test_containers.py       # UPDATE_GOLDEN=1 rewrites tests/golden/{array-*.sbatch,submitit-*.json}
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli, run_dir_of, slowdown, wait_until
from fake_runtime import calls, install_fake_apptainer, slurm_calls

from slurm_router.backends.slurm.container import ContainerSpec
from slurm_router.backends.slurm.sbatch_render import SbatchSpec, render_sbatch

GOLDEN = Path(__file__).parent / "golden"
RUN = "/scratch/runs/lora_ab/2024-01-01_12-00-00"
SLURM = pytest.mark.skipif(
    shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first"
)


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed: review, then rerun with UPDATE_GOLDEN=1"


def _spec(runtime: str, **changes) -> SbatchSpec:
    container = ContainerSpec(
        runtime=runtime,
        image="/images/pytorch 24.01.sif" if runtime == "apptainer" else "nvcr.io#nvidia/pytorch:24.01-py3",
        binds=(RUN, "/data/corpus"),
        mounts=("/scratch/shared:/shared",),
        workdir=RUN if runtime == "pyxis" else None,
    )
    fields = dict(
        job_name="lora_ab-variants",
        run_dir=RUN,
        array_size=2,
        gpus_per_task=1,
        cpus_per_task=4,
        timeout_min=90,
        partition="gpu",
        python="python3",
        container=container,
        task_argv=("-m", "slurm_router.supervise.job", "--run-dir", RUN, "--stage", "variants"),
        setup=("module load cuda/12.1", "source /opt/venvs/lab/bin/activate"),
        pythonpath=f"{RUN}/code",
        mail_type="END,FAIL",
        mail_user="someone@example.org",
    )
    return SbatchSpec(**{**fields, **changes})


def test_golden_apptainer_sbatch():
    text = render_sbatch(_spec("apptainer"))
    _golden("array-apptainer.sbatch", text)
    assert (
        "exec --nv --bind /scratch/runs/lora_ab/2024-01-01_12-00-00,/data/corpus,/scratch/shared:/shared "
        "'/images/pytorch 24.01.sif' python3 -m slurm_router.supervise.job" in text
    )
    assert "#SBATCH --signal=B:USR2@120" in text  # the batch shell, outside, gets it and passes it on


def test_golden_pyxis_sbatch_srun_workers():
    text = render_sbatch(_spec("pyxis", ntasks=2))
    _golden("array-pyxis.sbatch", text)
    assert (
        "srun --ntasks=2 --cpus-per-task=4 --nodes=1 --ntasks-per-node=2 --kill-on-bad-exit=0 --gpus-per-task=1 "
        "'--container-image=nvcr.io#nvidia/pytorch:24.01-py3' --container-mounts="
        f"{RUN}:{RUN},/data/corpus:/data/corpus,/scratch/shared:/shared --container-workdir={RUN} "
        "python3 -m slurm_router.supervise.job"
    ) in text
    one = render_sbatch(_spec("pyxis"))  # one task: still a step (pyxis is srun's), with the job's GPUs
    assert "\nsrun --ntasks=1 --cpus-per-task=4 '--container-image=" in one and "--gpus-per-task" not in one


@pytest.mark.parametrize("runtime", ["apptainer", "pyxis"])
def test_golden_submitit_parameters(runtime, tmp_path):
    """What launcher=slurm hands submitit: the executor's parameters, the interpreter submitit runs on, and (apptainer)
    the words the ColocatedRunner of one starts the task with inside the image."""
    from slurm_router.backends.slurm.container import container_spec
    from slurm_router.backends.slurm.submitit_launcher import submitit_params, submitit_python, task_runner_python
    from slurm_router.config.compose import compose

    image = "/images/pytorch.sif" if runtime == "apptainer" else "nvcr.io#nvidia/pytorch:24.01-py3"
    cfg = compose(
        [
            "launcher=slurm",
            f"launcher.container.image='{image}'",
            f"launcher.container.runtime={runtime}",
            "launcher.container.mounts=[/scratch/shared]",
            "launcher.setup=['module load cuda/12.1']",
            "launcher.mail_type=[END,FAIL]",
            "launcher.mail_user=someone@example.org",
        ]
    )
    params = submitit_params(cfg, 1, "variants", "1234", RUN, f"{RUN}/code")
    wrapped = task_runner_python(cfg, RUN)
    python = submitit_python(cfg, container_spec(cfg, RUN, gpus=True))
    golden = {
        "params": params,
        "task_runner_python": wrapped,
        "submitit_python": "<sys.executable>" if python == sys.executable else python,
    }
    _golden(f"submitit-{runtime}.json", json.dumps(golden, indent=1, sort_keys=True) + "\n")
    setup = params["slurm_setup"]  # the user's line as written, before ours (setup_lines.guarded around it)
    assert "module load cuda/12.1" in setup and setup.index("module load cuda/12.1") < setup.index(
        "export PYTHONSAFEPATH=1"
    )
    assert "export PYTHONSAFEPATH=1" in params["slurm_setup"]
    if runtime == "apptainer":  # submitit's own process stays outside (the submitter's interpreter)
        assert wrapped[:3] == ["apptainer", "exec", "--nv"] and "slurm_srun_args" not in params
    else:  # pyxis wraps submitit's srun step: its process runs in the image
        assert wrapped is None and params["slurm_srun_args"][0] == f"--container-image={image}"


# ---- the batch shell outside the container, without Slurm -------------------------------------------------

TASK = r"""import os, signal, sys, time
def stop(signum, frame):            # the task's verdict is a requeue: it asks the shell outside
    with open(os.environ["SLURM_ROUTER_REQUEUE_REQUEST"], "w") as f:
        f.write("{}")
    sys.exit(76)
signal.signal(signal.SIGUSR2, stop)
with open(os.environ["STARTED"], "w") as f:
    f.write(str(os.getpid()))
mode = os.environ["MODE"]
if mode != "wait":
    sys.exit(int(mode))
time.sleep(60)
sys.exit(3)
"""


@pytest.mark.parametrize("mode, code", [("wait", 75), ("0", 0), ("1", 1)])
def test_batch_shell_requeues_from_outside(tmp_path, mode, code):
    """USR2 to the batch shell reaches the task in the image; the task writes the request and exits 76; the
    shell runs `scontrol requeue JOB_TASK` itself and exits 75. A task that ends on its own keeps its code."""
    bindir = tmp_path / "bin"
    runtime = install_fake_apptainer(tmp_path / "rt")
    bindir.mkdir()
    (bindir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.txt\n')
    (bindir / "scontrol").chmod(0o755)
    task = tmp_path / "task"
    task.write_text(TASK)
    run_dir, image = tmp_path / "run", tmp_path / "image.sif"
    image.write_text("")
    spec = SbatchSpec(
        job_name="j",
        run_dir=str(run_dir),
        array_size=1,
        python=sys.executable,
        task_argv=(str(task),),
        container=ContainerSpec("apptainer", str(image), binds=(str(run_dir),), runtime_cmd=str(runtime)),
    )
    (run_dir / "logs").mkdir(parents=True)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec))
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        "SLURM_ARRAY_JOB_ID": "41",
        "SLURM_ARRAY_TASK_ID": "1",
        "STARTED": str(tmp_path / "started"),
        "MODE": mode,
    }
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if mode == "wait":
        wait_until(
            lambda: (tmp_path / "started").is_file() and (tmp_path / "started").read_text(), "the task", timeout=30
        )
        proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, (out, err)
    scontrol = tmp_path / "scontrol.txt"
    requeued = scontrol.read_text().splitlines() if scontrol.is_file() else []
    assert requeued == (["requeue 41_1"] if code == 75 else []), requeued
    assert not list((run_dir / "logs").glob("requeue-request.*")), "the request outlived the requeue"
    assert calls(tmp_path / "rt")[0]["binds"] == [str(run_dir)] and not slurm_calls(tmp_path / "rt")


# ---- the real cluster, with the stand-in runtime --------------------------------------------------------

TRAIN = [
    "train.steps=12",
    "train.checkpoint_every=2",
    "train.eval_batches=2",
    "data.max_documents=60",
    "launcher.timeout_min=10",
]
SLOW = slowdown("4")  # reaches the workers inside the container: apptainer passes the environment on


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "tasks" / "main" / "events-rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.is_file() else []


def _sacct_state(job_id: str) -> str:
    out = subprocess.run(
        ["sacct", "-X", "-n", "--parsable2", "-o", "JobID,State", "-j", job_id], capture_output=True, text=True
    ).stdout
    return next((l.split("|")[1] for l in out.splitlines() if l.split("|")[0] == job_id), "")


_PENDING_SINCE: dict[str, float] = {}


def _start_requeued(job_id: str) -> None:
    """A requeued job waits cred_expire seconds (scripts/slurm_test_cluster.sh sets 5) so that its previous run
    has ended everywhere; on a cluster with Slurm's default (120 s) start it after 20 s, never sooner (that races
    the end of the previous run: tests/test_requeue_slurm.py)."""
    state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True).stdout
    if state.strip() != "PENDING BeginTime":
        _PENDING_SINCE.pop(job_id, None)
    elif time.time() - _PENDING_SINCE.setdefault(job_id, time.time()) > 20:
        subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], capture_output=True)


def _run_in_container(tmp_path: Path, launcher: str, signal_args: list[str]) -> tuple[Path, Path, str]:
    """Submit the one-task default experiment in the stand-in image; USR2 at step 3; wait for its end."""
    rt = tmp_path / "rt"
    runtime = install_fake_apptainer(rt)
    image, extra = tmp_path / "images" / "lab.sif", tmp_path / "extra"
    image.parent.mkdir()
    image.write_text("")
    extra.mkdir()
    proc = run_cli(
        *TRAIN,
        f"launcher={launcher}",
        f"run_root={tmp_path / 'runs'}",
        f"launcher.container.image={image}",
        f"launcher.container.runtime_cmd={runtime}",
        f"launcher.container.mounts=[{extra}]",
        f"launcher.python={sys.executable}",
        "launcher.setup=['export SETUP_MARK=from-setup']",
        "launcher.mail_type=[END,FAIL]",
        "launcher.mail_user=someone@example.org",
        cwd=tmp_path,
        env=SLOW,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    job = json.loads((run_dir / "manifest.json").read_text())["tasks"]["main"]["job_id"]
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert "MailUser=someone@example.org" in shown and "MailType=END,FAIL" in shown, shown
    wait_until(
        lambda: any(r["event"] == "step" and r["step"] >= 3 for r in _rows(run_dir)), "step 3", timeout=180, poll_s=0.3
    )
    subprocess.run(["scancel", *signal_args, "--signal=USR2", job], check=True)

    def done():
        _start_requeued(job)
        return (run_dir / "tasks" / "main" / "result.json").is_file() and _sacct_state(job) == "COMPLETED"

    wait_until(done, "the requeued task to complete", timeout=240, poll_s=0.5)
    return run_dir, rt, job


def _assert_requeued_in_the_image(run_dir: Path, rt: Path, colocated: bool) -> None:
    made = calls(rt)
    assert len(made) == 2 and not any(c["errors"] for c in made), made  # the first attempt and the requeued one
    for call in made:
        assert call["nv"] and call["binds"] == [str(run_dir), str(run_dir.parents[2] / "extra")], call
        assert call["image"] == str(run_dir.parents[2] / "images" / "lab.sif")
        assert call["command"][:3] == [sys.executable, "-m", "slurm_router.supervise.job"], call
        assert call["env"]["SETUP_MARK"] == "from-setup"  # launcher.setup ran first, outside
        assert call["slurm_router"] == str(run_dir / "code" / "slurm_router" / "__init__.py")  # the snapshot
        assert call["env"]["PYTHONPATH"].split(":")[0] == str(run_dir / "code")
        assert bool(call["env"]["SLURM_ROUTER_COLOCATED"]) == colocated
        # the job's end (launcher.timeout_min=10), worked out outside: squeue fails in there
        assert 0 < int(call["env"]["SLURM_ROUTER_JOB_END_TIME"]) - time.time() <= 600, call["env"]
    assert not [c for c in slurm_calls(rt) if c.startswith("scontrol")], "scontrol ran inside the image"
    rows = _rows(run_dir)
    requeue = [r for r in rows if r["event"] == "requeue"]
    assert [r["reason"] for r in requeue] == ["preempted"], requeue  # USR2 minutes before the limit
    assert " s left: a preemption" in requeue[0]["detail"] and "? s" not in requeue[0]["detail"], requeue
    assert any(r["event"] == "checkpoint_loaded" and r["attempt"] == 1 for r in rows)
    assert any(r["event"] == "end" and r["exit_state"] == "completed" and r["attempt"] == 1 for r in rows)
    assert len({r["step"] for r in rows if r["event"] == "step"}) == 12  # every step, once or twice
    assert not list((run_dir / "logs").glob("requeue-request.*"))


@pytest.mark.slurm
@SLURM
def test_sbatch_task_in_a_container_is_requeued_from_outside(tmp_path):
    """launcher=sbatch: USR2 to the batch shell (what --signal=B:USR2@N sends) goes on to the task in the image;
    it checkpoints, writes the request and exits 76; the batch shell requeues its array task; the task resumes."""
    run_dir, rt, job = _run_in_container(tmp_path, "sbatch", ["--batch"])
    _assert_requeued_in_the_image(run_dir, rt, colocated=False)
    log = (run_dir / "logs" / f"{job}.out").read_text()
    assert "requeued" in log and "resuming from" in log, log[-2000:]


@pytest.mark.slurm
@SLURM
def test_submitit_task_in_a_container_is_requeued_from_outside(tmp_path):
    """launcher=slurm: submitit's own process stays outside the image and starts the task in it (a ColocatedRunner of
    one); USR2 to the step; the task asks with exit 76 and submitit requeues; the task resumes."""
    run_dir, rt, _ = _run_in_container(tmp_path, "slurm", [])
    _assert_requeued_in_the_image(run_dir, rt, colocated=True)


@pytest.mark.slurm
@SLURM
def test_sbatch_srun_workers_in_a_container_meet_without_slurm_inside(tmp_path):
    """launcher.srun_workers: each srun task runs in its own container; the workers' meeting point is worked out
    outside (srun_worker would ask scontrol, which the image lacks); the task completes."""
    rt = tmp_path / "rt"
    runtime = install_fake_apptainer(rt)
    (tmp_path / "lab.sif").write_text("")
    proc = run_cli(
        "launcher=sbatch",
        "launcher.srun_workers=true",
        "resources.devices_per_task=2",
        "train.steps=4",
        "train.eval_batches=2",
        "data.max_documents=40",
        f"run_root={tmp_path / 'runs'}",
        f"launcher.container.image={tmp_path / 'lab.sif'}",
        f"launcher.container.runtime_cmd={runtime}",
        f"launcher.python={sys.executable}",
        "launcher.wait=true",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    made = calls(rt)
    assert len(made) == 2 and not any(c["errors"] for c in made), made
    assert not slurm_calls(rt), slurm_calls(rt)
    assert (run_dir / "tasks" / "main" / "result.json").is_file()
    starts = [
        json.loads(f.read_text().splitlines()[0]) for f in (run_dir / "tasks" / "main").glob("events-rank*.jsonl")
    ]
    assert sorted((r["event"], r["device"], r["world"]) for r in starts) == [("start", 0, 2), ("start", 1, 2)]
