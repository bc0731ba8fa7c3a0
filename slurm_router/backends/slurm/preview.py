"""dry_run=true under Slurm (launch/preview.py asks the run's backend): each stage's array script rendered as
launcher=sbatch submits it, the report job, and RUN_DIR/submit-all.sh with the exact submit commands in order."""

from __future__ import annotations

import shlex
from pathlib import Path

from omegaconf import DictConfig

from slurm_router.rundir.spec import Stage

SUBMIT_SCRIPT = "submit-all.sh"  # dry_run=true: the submit commands in order, runnable


def slurm_scripts(cfg: DictConfig, manifest, stages: list[Stage]) -> list[str]:
    """Render each stage's array script (as launcher=sbatch submits it) and the report job, and write
    RUN_DIR/submit-all.sh: the exact submit commands in order, each stage after the one before (afterok,
    cancelled if that fails), seeds=auto's reserve rounds each after the round before (afterany), and the report
    after the last (afterany). Returns the commands."""
    from slurm_router.backends.slurm.common import REPORT_TIMEOUT_MIN, afterok, stage_devices
    from slurm_router.backends.slurm.common import colocated_tasks as colocated_of
    from slurm_router.backends.slurm.sbatch_launcher import report_script, sbatch_spec
    from slurm_router.backends.slurm.sbatch_render import safe_job_name, script_path, write_sbatch
    from slurm_router.launch.base import reserve_rounds

    layout, run_dir = manifest.layout, str(manifest.layout.root)
    per_array_task = colocated_of(cfg)
    todo = [s for s in stages if not s.cached]
    commands = ["set -euo pipefail"]
    prev = None
    for whole in todo:
        n_arrays = -(-len(manifest.stage_tasks(whole.name)) // per_array_task)
        parts = reserve_rounds(whole) if per_array_task == 1 else [whole]  # SlurmLauncher.chains_rounds
        stage_before, prev_round = prev, None
        for stage in parts:
            indices = tuple(t.index for t in stage.tasks) if len(parts) > 1 else None
            spec = sbatch_spec(cfg, run_dir, stage.name, n_arrays, stage_devices(stage), None, indices)
            last = stage.name == manifest.data["stages"][-1]["name"]
            script = write_sbatch(spec, script_path(layout, stage.name, last, 0, stage.round))
            var = f"JOB_{stage.name.upper().replace('-', '_')}" + (f"_ROUND{stage.round}" if stage.round else "")
            waits = afterok(stage_before and f"${stage_before}", prev_round and f"${prev_round}")
            dep = [f"--{key}={value}" for key, value in waits.items()]
            commands.append(f"{var}=$(sbatch --parsable {' '.join(dep + [shlex.quote(str(script))])})")
            prev = prev_round = var
    logs = str(layout.logs).replace("%", "%%")
    report = shlex.join(
        [
            "sbatch",
            "--parsable",
            "--job-name",
            safe_job_name(f"{cfg.experiment}-report"),
            "--output",
            f"{logs}/report-%j.out",
            "--time",
            str(REPORT_TIMEOUT_MIN),
            *([f"--partition={cfg.launcher.partition}"] if cfg.launcher.partition else []),
            "--wrap",
            shlex.join(["bash", "-c", report_script(cfg, run_dir, None)]),
        ]
    )
    commands.append(report.replace("sbatch --parsable", f"sbatch --parsable --dependency=afterany:${prev}", 1))
    path = Path(run_dir) / SUBMIT_SCRIPT
    path.write_text("#!/usr/bin/env bash\n# dry_run=true: the submit commands in order (run this file to submit)\n")
    with path.open("a") as f:
        f.write("\n".join(commands) + "\n")
    path.chmod(0o755)
    return commands[1:]


def preview_lines(cfg: DictConfig, manifest, stages: list[Stage]) -> list[str]:
    """The preview's lines for the Slurm launchers: how they submit, and each command."""
    commands = slurm_scripts(cfg, manifest, stages)
    how = (
        "launcher=slurm submits the same arrays through submitit (one map_array per stage); as sbatch:"
        if cfg.launcher.kind == "slurm"
        else "submit commands, in order:"
    )
    run_dir = manifest.layout.root
    return [how, *(f"  {c}" for c in commands), f"(all of them: bash {run_dir / SUBMIT_SCRIPT})"]
