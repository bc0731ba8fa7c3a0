"""What a run will do, before it does it: Hydra's `--cfg job|all [--resolve]` (the composed config and each
variant's overrides) and `dry_run=true` (stages, tasks, devices, predicted peak memory per device against the
device's memory, array sizes, worst-case device-hours; for the Slurm launchers the rendered scripts and the exact
submit commands in order, dependencies and the report job included). A preview writes its run dir (the plan:
config.yaml, task.json files, the manifest marked `previewed`) and preview.txt, and nothing else: nothing is
trained, queued, snapshotted or reported; `status RUN_DIR` says it was never submitted."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from slurm_router.config.testing_aids import CPU_MEMORY_CAP_ENV, EVERY, testing_aids
from slurm_router.launch.base import reserve_rounds
from slurm_router.launch.fuse import flat
from slurm_router.rundir.layout import PREVIEW_FILE
from slurm_router.rundir.spec import Stage, TaskSpec

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

    from slurm_router.scheduler.registry import backend_of

    remote = backend_of(cfg.launcher.kind).devices(cfg)  # a scheduler's devices: known once the job starts
    if remote is not None:
        return remote
    import torch

    if torch.cuda.is_available():
        total = int(torch.cuda.get_device_properties(0).total_memory)
        return "cuda", total, f"GPU 0 here ({torch.cuda.get_device_name(0)})"
    cap = testing_aids().cpu_memory_cap(EVERY)
    if cap:
        return "cpu", cap, CPU_MEMORY_CAP_ENV
    return "cpu", int(psutil.virtual_memory().total), "this machine's RAM (CPU workers share it)"


@functools.lru_cache(maxsize=64)
def _peak(model_json: str, lora: bool, global_batch: int, devices: int, kind: str) -> int:
    return predicted_peak(OmegaConf.create(json.loads(model_json)), lora, global_batch, devices, kind)


def predicted_peak(task_cfg: DictConfig, lora: bool, global_batch: int, devices: int, kind: str) -> int:
    """One device's predicted peak for its share of a step in one micro-batch at full length: the router's
    memory model seeded from the model's sizes on the meta device (as backends/local/launcher.py packable_tasks)."""
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
    from slurm_router.scheduler.registry import backend_of

    backend = backend_of(cfg.launcher.kind)
    queued = backend.queued  # a scheduler's arrays, each job with its time limit
    per_array_task = backend.colocated_tasks(cfg)
    kind, total, source = _device_memory(cfg)
    limit_h = backend.time_limit_h(cfg)
    lines = [
        f"launcher={cfg.launcher.kind}; devices are {kind}: {source}" + (f", {_gib(total)}" if total else ""),
        "predicted peaks: one micro-batch at data.max_len per device (the router splits a step that does not fit"
        + ("; a CPU worker's RSS adds the interpreter and torch" if kind == "cpu" else "")
        + ")",
    ]
    worst, n_tasks, n_device_tasks = 0.0, 0, 0
    for i, stage in enumerate(stages):
        word = f" ({backend.dependency_word})" if backend.dependency_word else ""  # Slurm's: afterok
        after = f", after stage {', '.join(stage.depends_on)}{word}" if stage.depends_on else ""
        if stage.cached:
            lines.append(f"stage {stage.name}: cached (an earlier run trained it): not run")
            continue
        devices = max(int(t.devices) for t in stage.tasks)
        rounds = reserve_rounds(stage) if per_array_task == 1 else [stage]  # as a queue submits it (chains_rounds)
        arrays = -(-len(rounds[0].tasks) // per_array_task)
        array = f"; one {backend.name.capitalize()} array of {arrays} task(s)" + (
            f" ({per_array_task} tasks co-located each)" if per_array_task > 1 else ""
        )
        if len(rounds) > 1:
            array += (
                f", then seeds=auto's reserves, one array per round ({' + '.join(str(len(r.tasks)) for r in rounds[1:])}"
                " task(s)), each queued after the round before has ended"
            )
        fused_as = (
            f" ({len(stage.tasks) + len(stage.fused)} variant task(s) run as {len(stage.tasks)}: "
            f"{sum(len(t.group) for t in stage.tasks if t.members)} fused into "
            f"{sum(1 for t in stage.tasks if t.members)} by resources.fuse_variants={cfg.resources.fuse_variants}, "
            "each fused task holding one base in memory)"
            if stage.fused
            else ""
        )
        lines.append(
            f"stage {i + 1} {stage.name}{after}: {len(stage.tasks)} task(s) x {devices} device(s)"
            + fused_as
            + (array if queued else "")
        )
        members = {t.name: t for t in stage.fused}
        groups: dict[tuple, list[TaskSpec]] = {}  # one line per task group: the same variants, settings and peak
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
            fused = tuple(t.group) if t.members else ()
            key = (
                fused and tuple(members[m].variant for m in t.members),
                _per_variant(t, [members[m] for m in t.members]),
                f"{_gib(peak)}{against}",
            )
            groups.setdefault(key, []).append(t)
        for (_, settings, peak_text), group in groups.items():
            per = f" (one variant's: each task trains {len(group[0].group)})" if group[0].members else ""
            lines.append(f"  {_group_label(group, members)}: {settings}; peak per device {peak_text}{per}")
        n_tasks += len(stage.tasks)
        n_device_tasks += len(stage.tasks) * devices
        if limit_h:
            worst += len(stage.tasks) * devices * limit_h
    if queued:
        lines.append(
            f"worst case: {n_device_tasks} device(s) over {n_tasks} task(s) x {cfg.launcher.timeout_min} min "
            f"(launcher.timeout_min) = {worst:.2f} device-hours, plus the report job (1 CPU)"
        )
    else:
        at_once = _local_devices(cfg, kind)
        lines.append(
            f"worst case: {n_tasks} task(s) needing {n_device_tasks} device(s) in all"
            + (f", at most {min(at_once[0], n_device_tasks)} at once ({at_once[1]})" if at_once else "")
            + "; launcher=local has no time limit, so no bound on device-hours (a task runs until its steps are done)"
        )
    return lines


def _seeds(seeds: list[int]) -> str:
    """'seed 0', 'seeds 0, 1', 'seeds 2-5'."""
    seeds = sorted(seeds)
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"seeds {seeds[0]}-{seeds[-1]}"
    return "seeds " + ", ".join(map(str, seeds))


def _group_label(group: list[TaskSpec], members: dict[str, TaskSpec]) -> str:
    """A task group's line head: 'r8 + r32 fused, seeds 0, 1 (tasks r8-s0, r8-s1)', 'r8, r32, seeds 2-5 (8 tasks)',
    'base, seed 0'. A fused task is named after its first member; the line names every member."""

    def seed(t: TaskSpec) -> int:
        return int(t.seed) if t.seed is not None else 0

    if group[0].members:
        variants = " + ".join([group[0].variant, *(members[m].variant for m in group[0].members)])
        names = ", ".join(t.name for t in group)
        return f"{variants} fused, {_seeds([seed(t) for t in group])} (task{'s' if len(group) > 1 else ''} {names})"
    by_variant: dict[str, list[int]] = {}
    for t in group:
        by_variant.setdefault(t.variant or t.name, []).append(seed(t))
    if len({tuple(v) for v in by_variant.values()}) == 1:  # every variant the same seeds
        head = f"{', '.join(by_variant)}, {_seeds(next(iter(by_variant.values())))}"
    else:
        head = "; ".join(f"{v} {_seeds(s)}" for v, s in by_variant.items())
    return head + (f" ({len(group)} tasks)" if len(group) > 1 and len(by_variant) > 1 else "")


def _local_devices(cfg: DictConfig, kind: str) -> tuple[int, str] | None:
    """(devices a local run uses at once, where the count comes from), None when unknown."""
    import os

    if kind == "cpu":
        slots = cfg.launcher.get("cpu_slots") or os.cpu_count() or 1
        return int(slots), "launcher.cpu_slots" if cfg.launcher.get("cpu_slots") else f"{slots} cores"
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:
        return None
    return (n, f"this machine's {n} GPU(s)") if n else None


def _per_variant(task: TaskSpec, members: list[TaskSpec]) -> str:
    """'10 steps, global batch 16, lr 0.001': a fused task's settings that its variants may set apart (launch/fuse.py
    MAY_DIFFER) shown for each variant where they differ: 'lr 0.001 (r4), 0.005 (r16)'."""
    group = [task, *members]
    parts = []
    for what, field, fmt in (
        ("steps", "steps", "{}"),
        ("global batch", "global_batch_size", "{}"),
        ("lr", "lr", "{:g}"),
    ):
        values = [fmt.format(getattr(t, field)) for t in group]
        if len(set(values)) == 1:
            parts.append(f"{values[0]} {what}" if what == "steps" else f"{what} {values[0]}")
        else:
            each = ", ".join(f"{v} ({t.variant})" for v, t in zip(values, group))
            parts.append(f"{what}: {each}" if what == "steps" else f"{what} {each}")
    return ", ".join(parts)


def write_preview(
    cfg: DictConfig, variants: dict, stages: list[Stage], run_id: str, run_dir: Path, predicted: dict | None = None
) -> int:
    """dry_run=true: the run dir with the plan, its forecast (launch/forecast.py) and preview.txt (and the Slurm
    scripts); nothing submitted."""
    from slurm_router.launch import forecast
    from slurm_router.rundir.manifest import create_run_dir
    from slurm_router.scheduler.registry import backend_of

    packages = backend_of(cfg.launcher.kind).packages
    manifest = create_run_dir(cfg, run_id, run_dir, stages, cfg.launcher.kind, lock=False, packages=packages)
    run_id, run_dir = manifest.data["run_id"], manifest.layout.root  # another run may have taken the name first
    lines = [f"dry_run=true: a preview of run {run_id}; nothing was trained or submitted", *plan_lines(cfg, stages)]

    forecast.save(predicted, run_dir)  # before the scheduler's scripts: launcher.time_limit=auto reads it
    lines += backend_of(cfg.launcher.kind).preview(cfg, manifest, stages)  # the scheduler's scripts, if any
    lines += forecast.lines(predicted)
    lines.append(f"to run it: the same command without dry_run=true (status {run_dir}: never submitted)")
    lines.append(
        f"the preview is kept in {run_dir}; the run list leaves previews out, and "
        f"python -m slurm_router.status --run-root {run_dir.parents[1]} --clean-previews deletes them"
    )
    text = "\n".join(lines)
    (run_dir / PREVIEW_FILE).write_text(text + "\n")
    manifest.set(state=PREVIEWED, preview=str(run_dir / PREVIEW_FILE))
    print(text)
    print(f"run_dir: {run_dir}")
    return 0
