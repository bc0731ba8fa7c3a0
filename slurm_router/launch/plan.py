"""Experiment -> stages of task specs. A task trains one variant (or the base) on `devices` devices.

The base stage (a model built from a config has learned nothing yet) is trained once and cached by the hash
of everything that shapes it (slurm_router.artifacts.base_cache), so later runs and every variant reuse it while the
cache is whole. Variants fine-tune from it.

Replicates: each variant runs once per training seed (`seeds`, config.variants.training_seeds), all in the one variants
stage (one array job). With one seed a task is named as its variant (r8); with several, `<variant>-s<seed>`
(r8-s0, r8-s1). A task's `seed` picks its LoRA init and data order; the base and the held-out eval batches keep
the config's `seed`, so every replicate starts from the same base and is evaluated on the same batches.
"""

from __future__ import annotations

from typing import cast

from omegaconf import DictConfig, OmegaConf

from slurm_router.artifacts import base_cache
from slurm_router.config.variants import training_seeds
from slurm_router.errors import UserError
from slurm_router.rundir.spec import Stage, TaskSpec, task_name

# model keys that shape the base's weights (lora and dtype do not: every variant can fine-tune the same base)
SHAPE_KEYS = ("kind", "name_or_path", "n_layer", "n_head", "n_embd", "n_positions", "vocab_size")


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


def make_plan(cfg: DictConfig, variants: dict[str, DictConfig], run_id: str, run_dir: str) -> list[Stage]:
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
    stages.append(Stage("variants", tasks, depends_on=[s.name for s in stages]))
    return stages
