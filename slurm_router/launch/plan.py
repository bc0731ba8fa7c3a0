"""Experiment -> stages of task specs. A task trains one variant (or the base) on `devices` devices.

The base stage (a model built from a config has learned nothing yet) is trained once and cached by the hash
of everything that shapes it (slurm_router.artifacts.base_cache), so later runs and every variant reuse it while the
cache is whole. Variants fine-tune from it.

Replicates: each variant runs once per training seed (`seeds`, config.variants.training_seeds), all in the one variants
stage (one array job). With one seed a task is named as its variant (r8); with several, `<variant>-s<seed>`
(r8-s0, r8-s1). A task's `seed` picks its LoRA init and data order; the base and the held-out eval batches keep
the config's `seed`, so every replicate starts from the same base and is evaluated on the same batches.

Fused variants (resources.fuse_variants=K, launch/fuse.py): the variants stage's compatible tasks, in queue order,
in groups of up to K; a group's first task (its leader) is the one that runs and trains them all, the others are
in Stage.fused. The stage's tasks, in queue order and indexed 0..N-1 (the Slurm array), are the leaders and the
tasks alone.
"""

from __future__ import annotations

from typing import Callable, cast

from omegaconf import DictConfig, OmegaConf

from slurm_router.artifacts import base_cache
from slurm_router.config.model_families import from_checkpoint
from slurm_router.config.schema import FUSE_AUTO
from slurm_router.config.variants import training_seeds
from slurm_router.errors import UserError
from slurm_router.launch.fuse import fuse_tasks
from slurm_router.rundir.spec import Stage, TaskSpec, task_name
from slurm_router.train import base_dropout
from slurm_router.verdict import AUTO_FIRST
from slurm_router.worker.auto_seeds import reserve_index

# model keys that shape the base's weights (lora and dtype do not: every variant can fine-tune the same base)
SHAPE_KEYS = ("kind", "name_or_path", "n_layer", "n_head", "n_embd", "n_positions", "vocab_size")


# LoRA over a model built from a config with no base stage trains adapters on random weights: say so in the plan
RANDOM_BASE = (
    "note: no base stage and no checkpoint: LoRA fine-tunes a randomly initialised model (its losses compare "
    "settings, not fine-tuning); +experiment=lora_ab trains a base first, model=hf model.name_or_path=DIR uses yours"
)


def check_fits_base(cfg: DictConfig, variants: dict[str, DictConfig]) -> None:
    """Every variant fine-tunes the one base stage: a variant (or a sweep) that changes the model's shape could
    not load its weights. UserError naming the variant and the key."""
    if not base_cache.needs_base_stage(cfg):
        return
    for name, vcfg in variants.items():
        for key in SHAPE_KEYS:
            if vcfg.model[key] != cfg.model[key]:
                raise UserError(
                    f"variants.{name}: model.{key}={vcfg.model[key]} differs from the base stage's "
                    f"model.{key}={cfg.model[key]}: every variant fine-tunes the one base "
                    "(base.enabled=true); change it for the whole run, or set base.enabled=false"
                )


def make_plan(
    cfg: DictConfig,
    variants: dict[str, DictConfig],
    run_id: str,
    run_dir: str,
    auto_fuse: Callable[[int], tuple[int, str]] | None = None,
) -> list[Stage]:
    """The run's stages. auto_fuse: n variant tasks -> (K, why) for resources.fuse_variants=auto (the launcher's
    Launcher.auto_fuse_variants: only it knows the devices its tasks get)."""
    stages: list[Stage] = []
    base_weights = None
    if base_cache.needs_base_stage(cfg):
        base_weights = str(base_cache.weights_path(cfg))
        base_task = TaskSpec(
            run_id=run_id,
            run_dir=run_dir,
            experiment=cfg.experiment,
            name="base",
            stage="base",
            variant="base",
            index=0,
            devices=cfg.resources.devices_per_task,
            config=cast(dict, OmegaConf.to_container(cfg, resolve=True)),
            steps=cfg.base.steps,
            lr=cfg.base.lr,
            global_batch_size=cfg.base.global_batch_size,
            lora=False,
            save_weights=base_weights,
            seed=cfg.seed,
        )
        # reused only when whole (meta.json, and model.pt matching its sha256 sidecar); else trained again, and
        # then the cache folder must take the weights: checked now, before the run dir is written
        cached = base_cache.usable(base_weights)
        if not cached:
            base_cache.check_room(cfg)
        stages.append(Stage("base", [base_task], cached=cached))
    tasks: list[TaskSpec] = []
    for name, vcfg in variants.items():
        config, seeds = cast(dict, OmegaConf.to_container(vcfg, resolve=True)), training_seeds(vcfg)
        for seed in seeds:
            tasks.append(
                TaskSpec(
                    run_id=run_id,
                    run_dir=run_dir,
                    experiment=cfg.experiment,
                    name=task_name(name, seed, len(seeds)),
                    stage="variants",
                    variant=name,
                    index=len(tasks),
                    devices=vcfg.resources.devices_per_task,
                    config=config,
                    steps=vcfg.train.steps,
                    lr=vcfg.train.lr,
                    global_batch_size=vcfg.train.global_batch_size,
                    lora=bool(vcfg.model.lora.enabled),
                    base_weights=base_weights,
                    seed=seed,
                )
            )
    for line in dict.fromkeys(base_dropout.plan_line(v.model) for v in variants.values()):
        if line:  # a checkpoint that ships dropout: what the base does with it, once per distinct setting
            print(line, flush=True)
    if base_weights is None and any(not from_checkpoint(v.model) and v.model.lora.enabled for v in variants.values()):
        print(RANDOM_BASE, flush=True)  # the bare command, and a sweep without +experiment
    if cfg.get("prune"):  # the Slurm array's index order too: replicates side by side, a throttled array included
        tasks = queue_order(tasks)
        for i, t in enumerate(tasks):
            t.index = i
    fused: list[TaskSpec] = []
    # seeds=auto: only the first round is fused; a reserve waits for its round's call (worker/auto_seeds.py), so it
    # runs alone, queued after every group
    reserves = [t for t in tasks if reserve_index(t) is not None]
    tasks = [t for t in tasks if t not in reserves]
    width = cfg.resources.fuse_variants
    if width == FUSE_AUTO:
        if auto_fuse is None:
            raise UserError(
                "resources.fuse_variants=auto: this launcher cannot choose K; set resources.fuse_variants=K"
            )
        width, why = auto_fuse(len(tasks))
        print(why, flush=True)
    if int(width) > 1:  # compatible tasks trained as one, over one base (launch/fuse.py)
        fusion = fuse_tasks(queue_order(tasks), int(width))
        tasks, fused = fusion.runs, fusion.fused
        summary = fusion.summary(int(width), cfg.resources.fuse_variants)
        if reserves:
            summary += (
                f"; seeds=auto's {len(reserves)} reserve(s) (each variant's seeds after its first {AUTO_FIRST}) "
                "run alone, after them"
            )
        for line in [*fusion.notes, summary]:
            print(line, flush=True)
    tasks += reserves  # after the groups (fuse_tasks indexed them 0..N-1; a member has its leader's index)
    for i, t in enumerate(tasks):
        t.index = i
    stages.append(Stage("variants", tasks, depends_on=[s.name for s in stages], fused=fused))
    return stages


def queue_order(tasks: list[TaskSpec]) -> list[TaskSpec]:
    """The variants stage's tasks seed by seed across variants (r8-s0, r32-s0, r8-s1, r32-s1, ...): a queue that
    runs fewer tasks at a time than there are then trains every variant's replicates side by side, so prune=true
    can compare them early (verdict/pruning.py). The base stage (one task) and one-seed runs keep their order; so does
    a stage with fused tasks (resources.fuse_variants), which make_plan put in this order already, as it does a
    prune=true run's stage (its index order is the Slurm array's: a throttled array, launcher.array_parallelism,
    starts the waiting tasks in it as running ones end or are pruned)."""
    if any(getattr(t, "members", None) for t in tasks):
        return list(tasks)
    by_variant: dict[str, list[TaskSpec]] = {}
    for t in tasks:
        by_variant.setdefault(t.variant, []).append(t)
    rounds = max((len(v) for v in by_variant.values()), default=0)
    return [v[i] for i in range(rounds) for v in by_variant.values() if i < len(v)]


def trained_variants(stage: Stage) -> Callable[[TaskSpec], list[str]]:
    """A task of `stage` -> the variants it trains: its own, then its fused members' (resources.fuse_variants)."""
    variant_of = {t.name: t.variant for t in stage.fused}
    return lambda t: [t.variant, *(variant_of.get(m, m) for m in t.members)]


def prune_blind_variants(
    order: list[TaskSpec], at_once: int, variants: Callable[[TaskSpec], list[str]] = lambda t: [t.variant]
) -> list[str]:
    """The variants that prune=true can never stop when `at_once` tasks of `order` run at a time (equal task
    times assumed): a replicate sees the rows of the tasks queued before it and beside it, and is compared only
    when it and another variant have 2 seeds there. A fused task trains `variants(task)` side by side."""
    blind = []
    for variant in dict.fromkeys(v for t in order for v in variants(t)):
        for i, t in enumerate(order):
            if variant not in variants(t):
                continue
            seen: dict[str, int] = {}
            for v in (v for u in order[: i + max(1, at_once)] for v in variants(u)):
                seen[v] = seen.get(v, 0) + 1
            if seen[variant] >= 2 and any(n >= 2 for v, n in seen.items() if v != variant):
                break
        else:
            blind.append(variant)
    return blind


def prune_layout_note(
    order: list[TaskSpec], at_once: int, variants: Callable[[TaskSpec], list[str]] = lambda t: [t.variant]
) -> str | None:
    """One line when prune=true cannot compare some variants with this queue (None when every one can), with
    the number of tasks at a time that lets every one be compared."""
    blind = prune_blind_variants(order, at_once, variants)
    if not blind:
        return None
    need = next(
        (k for k in range(at_once + 1, len(order) + 1) if not prune_blind_variants(order, k, variants)), len(order)
    )
    return (
        f"prune=true: with {at_once} task(s) at a time, {', '.join(blind)} can never be compared with 2 seeds of "
        f"another variant, so cannot be pruned: run {need} tasks at a time (launcher.cpu_slots={need} without "
        "GPUs), or more seeds"
    )
