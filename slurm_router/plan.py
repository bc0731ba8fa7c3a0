"""Experiment -> stages of task specs. A task trains one variant (or the base) on `devices` devices.

The base stage (a model built from a config has learned nothing yet) is trained once and cached by the hash
of everything that shapes it, so later runs and every variant reuse it. Variants fine-tune from it.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from slurm_router.layout import BASE_META, BASE_WEIGHTS, RunLayout



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


def base_cache_dir(cfg: DictConfig) -> Path:
    root = cfg.base.cache_dir or os.environ.get("SLURM_ROUTER_CACHE") or "~/.cache/slurm_router"
    return Path(os.path.expanduser(root)) / "base"


def base_hash(cfg: DictConfig) -> str:
    """Everything that shapes the base model: model shape, data, base schedule, seed (not LoRA, not router)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model.pop("lora", None)
    base = OmegaConf.to_container(cfg.base, resolve=True)
    base.pop("cache_dir", None)
    base.pop("enabled", None)
    key = {"model": model, "data": OmegaConf.to_container(cfg.data, resolve=True), "base": base,
           "seed": cfg.seed, "format": 1}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def needs_base_stage(cfg: DictConfig) -> bool:
    # A local checkpoint (model=hf) has already learned: its own loss at step 0 is the base's.
    return bool(cfg.base.enabled) and cfg.model.kind == "gpt2"


def make_plan(cfg: DictConfig, variants: dict[str, DictConfig], run_id: str, run_dir: str) -> list[Stage]:
    stages: list[Stage] = []
    base_weights = None
    if needs_base_stage(cfg):
        cache = base_cache_dir(cfg) / base_hash(cfg)
        base_weights = str(cache / BASE_WEIGHTS)
        base_task = TaskSpec(run_id=run_id, run_dir=run_dir, experiment=cfg.experiment, name="base", stage="base",
                             variant="base", index=0, devices=cfg.resources.devices_per_task,
                             config=OmegaConf.to_container(cfg, resolve=True), steps=cfg.base.steps,
                             lr=cfg.base.lr, global_batch_size=cfg.base.global_batch_size, lora=False,
                             save_weights=base_weights)
        cached = (cache / BASE_WEIGHTS).is_file() and (cache / BASE_META).is_file()
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
