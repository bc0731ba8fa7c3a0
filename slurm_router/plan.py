"""Experiment -> stages of task specs. A task trains one variant (or the base) on `devices` devices.

The base stage (a model built from a config has learned nothing yet) is trained once and cached by the hash
of everything that shapes it (slurm_router.base_cache), so later runs and every variant reuse it while the
cache is whole. Variants fine-tune from it.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from slurm_router import base_cache
from slurm_router.layout import RunLayout


@dataclass
class TaskSpec:
    run_id: str
    run_dir: str
    experiment: str
    name: str                       # "base" or the variant's name; names tasks/<name>/
    stage: str                      # "base" | "variants"
    variant: str
    index: int                      # position in its stage (Slurm array index)
    devices: int
    config: dict                    # the variant's fully resolved config
    steps: int
    lr: float
    global_batch_size: int
    lora: bool
    base_weights: Optional[str] = None      # load these weights before training (variants)
    save_weights: Optional[str] = None      # save the trained weights here (base stage)
    attempt: int = 0

    @property
    def task_dir(self) -> Path:
        return RunLayout(self.run_dir).task(self.name).dir

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TaskSpec":
        return cls(**json.loads(Path(path).read_text()))


@dataclass
class Stage:
    name: str
    tasks: list[TaskSpec]
    cached: bool = False            # the base stage found in the cache: nothing to run
    depends_on: list[str] = field(default_factory=list)


def make_plan(cfg: DictConfig, variants: dict[str, DictConfig], run_id: str, run_dir: str) -> list[Stage]:
    stages: list[Stage] = []
    base_weights = None
    if base_cache.needs_base_stage(cfg):
        base_weights = str(base_cache.weights_path(cfg))
        base_task = TaskSpec(run_id=run_id, run_dir=run_dir, experiment=cfg.experiment, name="base", stage="base",
                             variant="base", index=0, devices=cfg.resources.devices_per_task,
                             config=OmegaConf.to_container(cfg, resolve=True), steps=cfg.base.steps,
                             lr=cfg.base.lr, global_batch_size=cfg.base.global_batch_size, lora=False,
                             save_weights=base_weights)
        # reused only when whole (meta.json, and model.pt matching its sha256 sidecar); else trained again, and
        # then the cache folder must take the weights: checked now, before the run dir is written
        cached = base_cache.usable(base_weights)
        if not cached:
            base_cache.check_room(cfg)
        stages.append(Stage("base", [base_task], cached=cached))
    tasks = []
    for i, (name, vcfg) in enumerate(variants.items()):
        tasks.append(TaskSpec(run_id=run_id, run_dir=run_dir, experiment=cfg.experiment, name=name,
                              stage="variants", variant=name, index=i, devices=vcfg.resources.devices_per_task,
                              config=OmegaConf.to_container(vcfg, resolve=True), steps=vcfg.train.steps,
                              lr=vcfg.train.lr, global_batch_size=vcfg.train.global_batch_size,
                              lora=bool(vcfg.model.lora.enabled), base_weights=base_weights))
    stages.append(Stage("variants", tasks, depends_on=[s.name for s in stages]))
    return stages
