"""What a run will do, before it does it: Hydra's `--cfg job|all [--resolve]` (the composed config and each
variant's overrides) and `dry_run=true` (stages, tasks, devices, predicted peak memory per device against the
device's memory, array sizes, worst-case device-hours; for the Slurm launchers the rendered scripts and the exact
submit commands in order, dependencies and the report job included). A preview writes its run dir (the plan:
config.yaml, task.json files, the manifest marked `previewed`) and preview.txt, and nothing else: nothing is
trained, queued, snapshotted or reported; `status RUN_DIR` says it was never submitted."""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from slurm_router.launch.fuse import flat, fused_line
from slurm_router.rundir.layout import PREVIEW_FILE
from slurm_router.rundir.layout import SUBMIT_ALL as SUBMIT_SCRIPT
from slurm_router.rundir.spec import Stage

PREVIEWED = "previewed"  # the manifest's state of a dry_run=true run: never submitted


def cfg_text(cfg: DictConfig, variants: dict[str, DictConfig], resolve: bool, hydra_node: Any = None) -> str:
    """`--cfg job` (or `all`, with Hydra's own node, never resolved: it has run-time values): the composed config
    as YAML, then each variant's overrides as the experiment (or the sweep) wrote them, with their values in the
    variant's merged config (resolved with `--resolve`)."""
    lines = [OmegaConf.to_yaml(cfg, resolve=resolve).rstrip()]
    if hydra_node is not None:
        lines += [
            "# hydra: Hydra's own settings, as `--cfg all` shows them; slurm_router does not read them (a run's "
            "directory is run_root=, and hydra.* overrides are refused)",
            OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_node})).rstrip(),
        ]
    for name, vcfg in variants.items():
        written = flat(OmegaConf.to_container(cfg.variants[name], resolve=False))
        merged = flat(OmegaConf.to_container(vcfg, resolve=resolve))
        changed = [f"{k}={_value(merged.get(k, v))}" for k, v in written.items()]
        lines.append(f"# variant {name}: {' '.join(changed) or '(no overrides: the config above)'}")
    return "\n".join(lines)


def _value(v: Any) -> str:
    return "[" + ",".join(map(str, v)) + "]" if isinstance(v, list) else str(v)


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def _device_memory(cfg: DictConfig) -> tuple[str, int | None, str]:
    """(device kind, its memory in bytes or None, where that figure comes from)."""
    import psutil

    if cfg.launcher.kind != "local":
        gres = str((cfg.launcher.get("additional_parameters") or {}).get("gres") or "")
        return "cuda", None, f"a Slurm GPU{' (' + gres + ')' if gres else ''}: its memory is known once the job starts"
    import torch

    if torch.cuda.is_available():
        total = int(torch.cuda.get_device_properties(0).total_memory)
        return "cuda", total, f"GPU 0 here ({torch.cuda.get_device_name(0)})"
    cap = cfg.router.get("cpu_memory_cap_bytes")
    if cap:
        return "cpu", int(cap), "router.cpu_memory_cap_bytes"
    return "cpu", int(psutil.virtual_memory().total), "this machine's RAM (CPU workers share it)"


@functools.lru_cache(maxsize=64)
def _peak(model_json: str, lora: bool, global_batch: int, devices: int, kind: str) -> int:
    return predicted_peak(OmegaConf.create(json.loads(model_json)), lora, global_batch, devices, kind)


def predicted_peak(task_cfg: DictConfig, lora: bool, global_batch: int, devices: int, kind: str) -> int:
    """One device's predicted peak for its share of a step in one micro-batch at full length: the router's
    memory model seeded from the model's sizes on the meta device (as launch/local.py packable_tasks)."""
    import torch

    from slurm_router.router import MemoryModel
    from slurm_router.train.model import build_model, memory_shape

    with torch.device("meta"):
        model = build_model(task_cfg.model, task_cfg.model.vocab_size, task_cfg.seed, lora=lora)
    mem = MemoryModel.from_model_bytes(
        **memory_shape(model, task_cfg, torch.device(kind)), vocab_size=cast(Any, model).config.vocab_size
    )
    per_device = -(-global_batch // devices)
    max_len = int(task_cfg.data.max_len)
    return int(mem.predict(per_device * max_len, per_device, max_len))


def plan_lines(cfg: DictConfig, stages: list[Stage]) -> list[str]:
    """Stages, tasks, devices, predicted peak memory per device against the device's memory, array sizes and
    the worst-case device-hours."""
    slurm = cfg.launcher.kind != "local"
    per_pack = 1
    if slurm:
        from slurm_router.launch.slurm.common import tasks_per_pack

        per_pack = tasks_per_pack(cfg)
    kind, total, source = _device_memory(cfg)
    limit_h = float(cfg.launcher.timeout_min) / 60 if slurm else None
    lines = [f"launcher={cfg.launcher.kind}; devices are {kind}: {source}" + (f", {_gib(total)}" if total else "")]
    worst, n_tasks, n_device_tasks = 0.0, 0, 0
    for i, stage in enumerate(stages):
        after = f", after stage {', '.join(stage.depends_on)} (afterok)" if stage.depends_on else ""
        if stage.cached:
            lines.append(f"stage {stage.name}: cached (an earlier run trained it): not run")
            continue
        devices = max(int(t.devices) for t in stage.tasks)
        arrays = -(-len(stage.tasks) // per_pack)
        array = f"; one Slurm array of {arrays} task(s)" + (f" ({per_pack} tasks packed each)" if per_pack > 1 else "")
        lines.append(
            f"stage {i + 1} {stage.name}{after}: {len(stage.tasks)} task(s) x {devices} device(s)"
            + (array if slurm else "")
        )
        for t in stage.tasks:
            try:
                shape = {k: t.config[k] for k in ("model", "data", "train", "seed")}  # what the peak depends on
                peak = _peak(json.dumps(shape, sort_keys=True), bool(t.lora), int(t.global_batch_size), devices, kind)
            except Exception as e:  # a model the meta device cannot build: say so, the plan still shows
                lines.append(f"  {t.name}: predicted peak memory unknown ({type(e).__name__})")
                continue
            against = (
                f" of {_gib(total)} ({peak / total:.0%}{'; does NOT fit' if peak > total else ''})" if total else ""
            )
            seed = f", seed {t.seed}" if t.seed is not None else ""
            lines.append(
                f"  {t.name}{seed}: {t.steps} steps, global batch {t.global_batch_size}, lr {t.lr:g}; "
                f"predicted peak per device {_gib(peak)}{against} (one micro-batch at data.max_len; the router "
                "splits a step that does not fit"
                + ("; a CPU worker's RSS adds the interpreter and torch" if kind == "cpu" else "")
                + (f"; one variant's: this task trains {len(t.group)}" if t.members else "")
                + ")"
            )
            if line := fused_line(t):
                lines.append(f"    {line}")
        if stage.fused:
            lines.append(
                f"  resources.fuse_variants={cfg.resources.fuse_variants}: {len(stage.tasks) + len(stage.fused)} "
                f"variant task(s) run as {len(stage.tasks)} task(s); each fused task holds one base in memory"
            )
        n_tasks += len(stage.tasks)
        n_device_tasks += len(stage.tasks) * devices
        if limit_h:
            worst += len(stage.tasks) * devices * limit_h
    if slurm:
        lines.append(
            f"worst case: {n_device_tasks} device(s) over {n_tasks} task(s) x {cfg.launcher.timeout_min} min "
            f"(launcher.timeout_min) = {worst:.2f} device-hours, plus the report job (1 CPU)"
        )
    else:
        lines.append(
            f"worst case: {n_device_tasks} device(s) over {n_tasks} task(s); launcher=local has no time limit, so "
            "no bound on device-hours (a task runs until its steps are done)"
        )
    return lines


def slurm_scripts(cfg: DictConfig, manifest, stages: list[Stage]) -> list[str]:
    """Render each stage's array script (as launcher=sbatch submits it) and the report job, and write
    RUN_DIR/submit-all.sh: the exact submit commands in order, each stage after the one before (afterok,
    cancelled if that fails) and the report after the last (afterany). Returns the commands."""
    from slurm_router.launch.slurm.common import KILL_ON_INVALID_DEP, REPORT_TIMEOUT_MIN, stage_devices
    from slurm_router.launch.slurm.common import tasks_per_pack as per_pack_of
    from slurm_router.launch.slurm.sbatch_launcher import report_script, sbatch_spec
    from slurm_router.launch.slurm.sbatch_render import safe_job_name, write_sbatch

    layout, run_dir = manifest.layout, str(manifest.layout.root)
    per_pack = per_pack_of(cfg)
    todo = [s for s in stages if not s.cached]
    commands = ["set -euo pipefail"]
    prev = None
    for stage in todo:
        n_arrays = -(-len(manifest.stage_tasks(stage.name)) // per_pack)
        spec = sbatch_spec(cfg, run_dir, stage.name, n_arrays, stage_devices(stage), None)
        last = stage.name == manifest.data["stages"][-1]["name"]
        script = write_sbatch(spec, layout.sbatch_script(stage.name, last, 0))
        var = f"JOB_{stage.name.upper().replace('-', '_')}"
        dep: list[str] = [f"--dependency=afterok:${prev}", f"--{KILL_ON_INVALID_DEP}=yes"] if prev else []
        commands.append(f"{var}=$(sbatch --parsable {' '.join(dep + [shlex.quote(str(script))])})")
        prev = var
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


def write_preview(cfg: DictConfig, variants: dict, stages: list[Stage], run_id: str, run_dir: Path) -> int:
    """dry_run=true: the run dir with the plan and preview.txt (and the Slurm scripts); nothing submitted."""
    from slurm_router.rundir.manifest import create_run_dir

    manifest = create_run_dir(cfg, run_id, run_dir, stages, cfg.launcher.kind, lock=False)
    lines = [f"dry_run=true: a preview of run {run_id}; nothing was trained or submitted", *plan_lines(cfg, stages)]
    if cfg.launcher.kind != "local":
        commands = slurm_scripts(cfg, manifest, stages)
        how = (
            "launcher=slurm submits the same arrays through submitit (one map_array per stage); as sbatch:"
            if cfg.launcher.kind == "slurm"
            else "submit commands, in order:"
        )
        lines += [how, *(f"  {c}" for c in commands), f"(all of them: bash {run_dir / SUBMIT_SCRIPT})"]
    lines.append(f"to run it: the same command without dry_run=true (status {run_dir}: never submitted)")
    text = "\n".join(lines)
    (run_dir / PREVIEW_FILE).write_text(text + "\n")
    manifest.set(state=PREVIEWED, preview=str(run_dir / PREVIEW_FILE))
    print(text)
    print(f"run_dir: {run_dir}")
    return 0
