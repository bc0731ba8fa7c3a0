"""sbatch rendering: golden file, validation, and shell-injection safety (the rendered script is executed).

pytest tests/test_sbatch_render.py                     # UPDATE_GOLDEN=1 rewrites tests/golden/array.sbatch
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_router.backends.slurm.sbatch_render import (
    SbatchSpec,
    render_sbatch,
    safe_job_name,
    sbatch_directives,
    write_sbatch,
)

GOLDEN = Path(__file__).parent / "golden" / "array.sbatch"
# Every injection attempt would create a file named "pwned" (relative: in the script's cwd, the run dir).
HOSTILE = "a b'c\"d $(touch pwned) `touch pwned` ; touch pwned #e %A\\ttab\nnl"


def golden_spec() -> SbatchSpec:
    run_dir = "/scratch/runs/lora_ab/2024-01-01_12-00-00"
    return SbatchSpec(
        job_name="lora_ab-variants",
        run_dir=run_dir,
        array_size=4,
        array_parallelism=2,
        gpus_per_task=1,
        cpus_per_task=4,
        mem_gb=31.5,
        timeout_min=90,
        partition="debug",
        account="research",
        qos=None,
        constraint="h100|a100",
        signal_delay_s=120,
        requeue=True,
        dependency_job_id="1234",
        extra_sbatch=(("nice", "10"),),
        python="/opt/venv/bin/python",
        task_argv=("-m", "slurm_router.supervise.job", "--run-dir", run_dir, "--stage", "variants"),
        env=(("OMP_NUM_THREADS", "4"),),
    )


def test_golden_file():
    text = render_sbatch(golden_spec())
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "rendered script changed: review, then rerun with UPDATE_GOLDEN=1"


def test_directives_minimal_and_srun_mode():
    base = SbatchSpec(job_name="j", run_dir="/r", array_size=1, python="/py", task_argv=("x",))
    lines = sbatch_directives(base)
    assert "#SBATCH --array=0-0" in lines and "#SBATCH --gres=gpu:1" in lines
    assert "#SBATCH --signal=B:USR2@120" in lines and "#SBATCH --requeue" in lines
    assert not any(k in " ".join(lines) for k in ("--partition", "--account", "--qos", "--constraint", "--mem"))
    assert render_sbatch(base).rstrip().endswith("exec /py x")

    srun = dataclasses.replace(base, ntasks=4, gpus_per_task=1, requeue=False)
    lines = sbatch_directives(srun)
    assert "#SBATCH --ntasks=4" in lines and "#SBATCH --gpus-per-task=1" in lines
    assert "#SBATCH --nodes=1" in lines and "#SBATCH --ntasks-per-node=4" in lines
    assert not any("--gres" in line for line in lines)
    assert "#SBATCH --signal=USR2@120" in lines and "#SBATCH --no-requeue" in lines
    assert (
        render_sbatch(srun)
        .rstrip()
        .endswith(
            "srun --ntasks=4 --cpus-per-task=1 --nodes=1 --ntasks-per-node=4 --kill-on-bad-exit=0 --gpus-per-task=1 /py x"
        )
    )
    two_nodes = dataclasses.replace(srun, nodes=2)  # resources.nodes_per_task=2: 2 srun tasks on each node
    lines = sbatch_directives(two_nodes)
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --ntasks-per-node=2" in lines and "#SBATCH --ntasks=4" in lines
    assert "srun --ntasks=4 --cpus-per-task=1 --nodes=2 --ntasks-per-node=2 " in render_sbatch(two_nodes)
    with pytest.raises(ValueError, match="ntasks=4 does not split evenly over nodes=3"):
        sbatch_directives(dataclasses.replace(srun, nodes=3))
    cpu = dataclasses.replace(base, gpus_per_task=0)
    assert not any("gpu" in line for line in sbatch_directives(cpu))


def test_array_indices_for_a_resume():
    spec = SbatchSpec(job_name="j", run_dir="/r", array_size=4, array_parallelism=2, array_indices=(3, 1))
    assert "#SBATCH --array=1,3%2" in sbatch_directives(spec)


def test_percent_in_run_dir_is_literal_for_slurm():
    spec = SbatchSpec(job_name="j", run_dir="/r/100%done", array_size=1)
    assert "#SBATCH --output=/r/100%%done/logs/%A_%a.out" in sbatch_directives(spec)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"job_name": "bad\nname"}, "job_name"),
        ({"job_name": 'say "hi"'}, "job_name"),
        ({"job_name": ""}, "job_name"),
        ({"run_dir": "relative/dir"}, "absolute"),
        ({"run_dir": "/tmp/a\nb"}, "run_dir"),
        ({"run_dir": "/tmp/a\\b"}, "backslash"),
        ({"partition": "debug\n#SBATCH --wrap=x"}, "partition"),
        ({"array_size": 0}, "array_size"),
        ({"timeout_min": 0}, "timeout_min"),
        ({"mem_gb": -1.0}, "mem_gb"),
        ({"array_parallelism": 0}, "array_parallelism"),
        ({"array_indices": (1,)}, "array_indices"),
        ({"array_indices": ()}, "array_indices"),
        ({"dependency_job_id": "1; rm -rf /"}, "dependency_job_id"),
        ({"extra_sbatch": (("wrap --x", "y"),)}, "extra_sbatch"),
        ({"env": (("BAD-NAME", "x"),)}, "env name"),
    ],
)
def test_rejects_values_sbatch_cannot_carry(change, message):
    spec = dataclasses.replace(SbatchSpec(job_name="j", run_dir="/r", array_size=1), **change)
    with pytest.raises(ValueError, match=message):
        render_sbatch(spec)


def test_safe_job_name():
    assert safe_job_name('lora "ab"\n|x') == "lora _ab___x"
    render_sbatch(SbatchSpec(job_name=safe_job_name(HOSTILE), run_dir="/r", array_size=1))


def _fake_bin(bindir: Path, name: str, record: Path) -> str:
    """An executable that writes its argv (and a few env vars) as JSON to record, then exits 0."""
    path = bindir / name
    path.write_text(
        f"#!{shutil.which('python3')}\n"
        "import json, os, sys\n"
        f"with open({str(record)!r}, 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'HOSTILE': os.environ.get('HOSTILE')}) + '\\n')\n"
    )
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("ntasks", [1, 2])
def test_hostile_values_cannot_inject_shell(tmp_path, ntasks):
    hostile = HOSTILE
    # The run dir itself is hostile too (no newline or backslash: sbatch could not carry them, see above).
    run_dir = tmp_path / "run $(touch pwned) `touch pwned` 'q' \"dq\" ; #c %x"
    bindir = tmp_path / "bin dir $(touch pwned)"
    bindir.mkdir()
    record = tmp_path / "argv.jsonl"
    fake_python = _fake_bin(bindir, "py'thon", record)
    srun_record = tmp_path / "srun.jsonl"
    fake_srun = bindir / "srun"  # records its argv, then runs the command after its --options, as srun would
    fake_srun.write_text(
        f"#!{shutil.which('python3')}\n"
        "import json, os, sys\n"
        f"open({str(srun_record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "i = next(i for i, a in enumerate(sys.argv[1:]) if not a.startswith('--'))\n"
        "os.execv(sys.argv[1 + i], sys.argv[1 + i:])\n"
    )
    fake_srun.chmod(0o755)

    argv = ("-m", "slurm_router.supervise.job", "--run-dir", str(run_dir), "--variant", hostile, "", "$HOME", "*")
    spec = SbatchSpec(
        job_name="job $(touch pwned) 'q' `touch pwned` ;#",
        run_dir=str(run_dir),
        array_size=3,
        ntasks=ntasks,
        partition="debug",
        constraint="a|b&c",
        python=fake_python,
        task_argv=argv,
        env=(("HOSTILE", hostile),),
    )
    script = write_sbatch(spec)
    assert script == run_dir / "submit.sbatch" and (run_dir / "logs").is_dir()
    subprocess.run(["bash", "-n", str(script)], check=True)

    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "HOME": "/nonexistent-home"}
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(calls) == 1
    assert calls[0]["argv"] == [fake_python, *argv]
    assert calls[0]["cwd"] == str(run_dir)
    assert calls[0]["HOSTILE"] == hostile
    if ntasks > 1:
        srun_argv = json.loads(srun_record.read_text())
        assert srun_argv == [
            "--ntasks=2",
            "--cpus-per-task=1",
            "--nodes=1",
            "--ntasks-per-node=2",
            "--kill-on-bad-exit=0",
            "--gpus-per-task=1",
            fake_python,
            *argv,
        ]
    else:
        assert not srun_record.exists()
    assert not list(tmp_path.rglob("pwned")), "an injected command ran"


def test_a_users_gpu_request_replaces_the_built_in_one():
    """launcher.additional_parameters={gres: 'gpu:a100:2'} (or gpus, gpus_per_node...): one GPU request, the user's."""
    base = SbatchSpec(job_name="j", run_dir="/r", array_size=1, gpus_per_task=2, python="/py", task_argv=("x",))
    for key, value in [("gres", "gpu:a100:2"), ("gpus", "a100:2"), ("gpus-per-node", "2")]:
        lines = sbatch_directives(dataclasses.replace(base, extra_sbatch=((key, value),)))
        gpu_lines = [line for line in lines if "gpu" in line]
        assert gpu_lines == [f"#SBATCH --{key}={value}"], lines
    srun = dataclasses.replace(base, ntasks=2, gpus_per_task=1, extra_sbatch=(("gres", "gpu:a100:2"),))
    text = render_sbatch(srun)
    assert "--gpus-per-task" not in text and text.count("--gres=") == 1
    assert [line for line in sbatch_directives(base) if "gpu" in line] == ["#SBATCH --gres=gpu:2"]  # none given


def _dry_run(tmp_path: Path, *args: str) -> str:
    """The scripts launcher=sbatch launcher.dry_run=true renders, through the real command."""
    from conftest import run_cli, run_dir_of

    proc = run_cli(
        "launcher=sbatch",
        "launcher.dry_run=true",
        "launcher.snapshot=false",
        "data=synthetic",
        "data.n_samples=64",
        "train.steps=1",
        f"run_root={tmp_path}",
        *args,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scripts = sorted(run_dir_of(proc).glob("submit*.sbatch"))
    assert scripts, proc.stdout
    return "\n".join(p.read_text() for p in scripts)


def test_the_command_renders_the_users_gres_once_and_cpus_for_every_worker(tmp_path):
    text = _dry_run(tmp_path, "launcher.additional_parameters={gres: 'gpu:a100:2'}", "resources.devices_per_task=2")
    assert [line for line in text.splitlines() if "--gres" in line] == ["#SBATCH --gres=gpu:a100:2"]
    # the rule: launcher.cpus_per_device (1) for each of the task's 2 workers
    assert [line for line in text.splitlines() if line.startswith("#SBATCH --cpus-per-task")] == [
        "#SBATCH --cpus-per-task=2"
    ]


@pytest.mark.parametrize(
    "args, cpus",
    [
        ([], 1),
        (["resources.devices_per_task=2"], 2),
        (["resources.devices_per_task=2", "launcher.cpus_per_device=3"], 6),
        (["resources.devices_per_task=2", "launcher.cpus_per_task=5"], 5),  # the user's own number wins
        (["resources.devices_per_task=2", "launcher.srun_workers=true", "launcher.cpus_per_device=2"], 2),
        (["resources.devices_per_task=2", "resources.tasks_per_gpu=2"], 4),  # 2 co-located tasks x 2 workers
    ],
)
def test_cpus_per_task_follow_the_workers_of_a_task(args, cpus):
    from slurm_router.backends.slurm.common import job_cpus
    from slurm_router.backends.slurm.sbatch_launcher import sbatch_spec
    from slurm_router.backends.slurm.submitit_launcher import submitit_params
    from slurm_router.config.compose import compose

    for launcher in ("sbatch", "slurm"):
        cfg = compose([f"launcher={launcher}", *args])
        devices = cfg.resources.devices_per_task
        assert job_cpus(cfg, devices) == cpus
        if launcher == "sbatch":
            spec = sbatch_spec(cfg, "/r", "variants", 1, devices, None)
            assert f"#SBATCH --cpus-per-task={cpus}" in sbatch_directives(spec)
        else:
            assert submitit_params(cfg, devices, "variants", None)["cpus_per_task"] == cpus


def test_submitit_leaves_the_gpu_request_to_the_users_gres():
    from slurm_router.backends.slurm.submitit_launcher import submitit_params
    from slurm_router.config.compose import compose

    mine = submitit_params(compose(["launcher=slurm", "resources.devices_per_task=2"]), 2, "variants", None)
    assert mine["gpus_per_node"] == 2 and mine["cpus_per_task"] == 2
    cfg = compose(["launcher=slurm", "launcher.additional_parameters={gres: 'gpu:a100:2'}"])
    params = submitit_params(cfg, 2, "variants", None)
    assert "gpus_per_node" not in params and params["slurm_additional_parameters"] == {"gres": "gpu:a100:2"}
    srun = compose(["launcher=slurm", "launcher.srun_workers=true", "launcher.additional_parameters={gpus: 2}"])
    params = submitit_params(srun, 2, "variants", None)
    assert "slurm_gpus_per_task" not in params and params["slurm_additional_parameters"] == {"gpus": 2}


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh")
def test_slurm_accepts_the_users_gres_and_the_cpus_rule(tmp_path):
    """The rendered script as the test cluster's Slurm reads it (sbatch --test-only: checked, not queued)."""
    _dry_run(tmp_path, "launcher.additional_parameters={gres: 'gpu:2'}", "resources.devices_per_task=2")
    (script,) = [p for p in tmp_path.glob("*/*/submit*.sbatch")]
    proc = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "using 2 processors" in proc.stderr, proc.stderr
