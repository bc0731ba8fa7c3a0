"""A task's spec (tasks/<name>/task.json) and the stages that group them: what a launcher submits and a job
runs, as data. How they are made from a config: slurm_router.launch.plan (docs/design/data-flow.md, "Data flow")."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from slurm_router.rundir.layout import RunLayout


@dataclass
class TaskSpec:
    run_id: str
    run_dir: str
    experiment: str
    name: str  # "base" or the variant's name; names tasks/<name>/
    stage: str  # "base" | "variants"
    variant: str
    index: int  # position in its stage (Slurm array index)
    devices: int
    config: dict  # the variant's fully resolved config
    steps: int
    lr: float
    global_batch_size: int
    lora: bool
    base_weights: Optional[str] = None  # load these weights before training (variants)
    save_weights: Optional[str] = None  # save the trained weights here (base stage)
    attempt: int = 0
    seed: Optional[int] = None  # training seed (LoRA init, data order); None: the config's seed
    # resources.fuse_variants (launch/fuse.py): a fused task's leader (variant 0) names the other tasks of its group
    # in order (members[i] is variant i+1); each of those names its leader and is never run itself
    members: list[str] = field(default_factory=list)
    fused_into: Optional[str] = None

    def __post_init__(self):
        if self.seed is None:  # a task.json written before replicates existed
            self.seed = int(self.config.get("seed", 0))

    @property
    def task_dir(self) -> Path:
        return RunLayout(self.run_dir).task(self.name).dir

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TaskSpec":
        return cls(**json.loads(Path(path).read_text()))

    @property
    def group(self) -> list[str]:
        """The names of the tasks this one trains: itself, then its fused members (one name when not fused)."""
        return [self.name, *self.members]

    def group_specs(self) -> list["TaskSpec"]:
        """The specs of the tasks this one trains, in variant order: itself, then each member's task.json, in
        this attempt (the job counts a fused task's attempts in the leader's folder)."""
        layout = RunLayout(self.run_dir)
        members = [TaskSpec.load(layout.task(name).task_file) for name in self.members]
        for m in members:
            m.attempt = self.attempt
        return [self, *members]


@dataclass
class Stage:
    name: str
    tasks: list[TaskSpec]
    cached: bool = False  # the base stage found in the cache: nothing to run
    depends_on: list[str] = field(default_factory=list)
    # resources.fuse_variants: the tasks trained inside a leader of `tasks` (fused_into set), never run themselves;
    # each keeps its own tasks/<name>/ (create_run_dir writes them all)
    fused: list[TaskSpec] = field(default_factory=list)
    # seeds=auto on a queue: 0 for the stage's first round; N for the part that holds the reserves of replicate N,
    # queued as its own job after the round before has ended (launch/base.py reserve_rounds)
    round: int = 0


def task_name(variant: str, seed: int, n_seeds: int) -> str:
    """tasks/<name>/: the variant's name with one training seed, `<variant>-s<seed>` with several."""
    return variant if n_seeds == 1 else f"{variant}-s{seed}"
