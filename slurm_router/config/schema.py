"""Config schema: dataclasses registered in Hydra's ConfigStore, the choices and ranges each key allows.
Values live in conf/*.yaml; this file only says what is allowed. The checks: checks.py, variants.py.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, Dict, Iterable, List, Optional, cast

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from slurm_router.config import conditions as when
from slurm_router.config.conditions import FUSE_AUTO, fusing
from slurm_router.config.metrics import EvalConfig
from slurm_router.config.model_families.gpt2 import BYTE_VOCAB_SIZE
from slurm_router.config.sections import AutoSeedsConfig as AutoSeedsConfig
from slurm_router.config.sections import BaseStageConfig as BaseStageConfig
from slurm_router.config.sections import DataConfig as DataConfig
from slurm_router.config.sections import LoraConfig as LoraConfig
from slurm_router.config.sections import ModelConfig as ModelConfig
from slurm_router.config.sections import ResourcesConfig as ResourcesConfig
from slurm_router.config.sections import TrackerConfig as TrackerConfig
from slurm_router.config.sections import TrainConfig as TrainConfig
from slurm_router.config.settings import Setting, declaration, setting, walk
from slurm_router.router.types import RouterSettings

__all__ = ["BYTE_VOCAB_SIZE", "FUSE_AUTO", "fusing"]  # their homes: config/model_families/gpt2.py, config/conditions.py


@dataclass
class RouterConfig:
    """The router's knobs; their defaults (and meanings) live once, in router.types.RouterSettings."""

    policy: str = setting(
        RouterSettings.policy, reader="router/router.py: POLICIES[self.settings.policy]"
    )  # round_robin | least_loaded | affinity | balanced
    cost: str = setting(
        RouterSettings.cost, reader='router/packing.py: settings.cost == "tokens_attention"'
    )  # tokens | tokens_attention
    attention_weight: float = setting(
        RouterSettings.attention_weight,
        reader="router/packing.py: settings.attention_weight / settings.attention_ref_len",
        read_if=when.ATTENTION_COST,
        example="0.5",
    )  # cost=tokens_attention: the quadratic term's weight
    attention_ref_len: int = setting(
        RouterSettings.attention_ref_len,
        reader="router/packing.py: settings.attention_weight / settings.attention_ref_len",
        read_if=when.ATTENTION_COST,
        example="1024",
    )  # cost=tokens_attention: its length scale
    microbatch_overhead_tokens: int = setting(
        RouterSettings.microbatch_overhead_tokens, reader="router/packing.py: settings.microbatch_overhead_tokens"
    )  # a micro-batch's fixed cost
    memory_headroom: float = setting(
        RouterSettings.memory_headroom, bounds=(0, 1, False), reader="router/router.py: self.settings.memory_headroom"
    )  # a device's memory budget: this x its total memory
    max_tokens_per_microbatch: Optional[int] = setting(
        RouterSettings.max_tokens_per_microbatch, reader="router/packing.py: settings.max_tokens_per_microbatch"
    )  # cap (null: memory)
    affinity_boundaries: List[int] = setting(
        factory=list,
        reader="router/policies.py: settings.affinity_boundaries",
        read_if=when.AFFINITY,
        example="[64,128]",
    )  # policy=affinity: sample-length bucket edges
    speed_model: str = setting(
        RouterSettings.speed_model, reader="router/router.py: make_speed_model(self.settings.speed_model"
    )  # robust | ema | none (router/speed_model.py)
    speed_ema: float = setting(
        RouterSettings.speed_ema, reader="router/router.py: self.settings.speed_ema", read_if=when.EMA, example="0.5"
    )  # speed_model=ema: the weight of the newest step
    row_cost: str = setting(
        RouterSettings.row_cost,
        reader='router/router.py: self.settings.row_cost == "fitted"',
        read_if=when.PACKED,
        example="fixed",
    )  # packed rows: fitted (from step times, router/cost_model.py) | fixed


@dataclass
class LauncherConfig:
    """What every launcher has. One schema per launcher (LAUNCHER_SCHEMAS), registered in the `launcher` group: a
    key that the chosen launcher does not have is an error naming the launchers that have it (launcher_key_error)."""

    kind: str = setting(
        MISSING, reader="cli/checks.py: launcher_class(cfg.launcher.kind)"
    )  # each schema's own default; its backend in slurm_router.scheduler.registry

    @classmethod
    def declared(cls) -> dict[str, Setting]:
        """The hook by which a launcher declares its keys (by their names under launcher): a backend whose schema
        lives elsewhere declares them here (Slurm's: backends/slurm/settings.py) instead of on each field.
        Every launcher's kind is read where the command picks its launcher."""
        return {"kind": declaration_of(LauncherConfig, "kind")}

    @classmethod
    def check(cls, launcher: DictConfig, where: str = "") -> None:
        """The launcher's own checks beyond its keys' choices and bounds (UserError, `where` leading the line)."""


@dataclass
class LocalLauncherConfig(LauncherConfig):
    kind: str = "local"
    cpu_slots: Optional[int] = setting(
        None, bounds=(1, 4096, True), reader='backends/local/launcher.py: cfg.launcher.get("cpu_slots")'
    )  # without GPUs: CPU worker slots (default: the core count)


# OmegaConf 2.3 cannot hold typing.Literal fields, so `kind` is a str whose allowed values are these schemas'
# own defaults (CHOICES["launcher.kind"]); no other code spells the kinds out. A scheduler's backend adds its
# launchers' schemas when it loads (scheduler/registry.py add_launcher_schema; Slurm's: backends/slurm/config.py);
# the command loads every backend before it composes a config.
LAUNCHER_SCHEMAS: list[type[LauncherConfig]] = [LocalLauncherConfig]


def declaration_of(schema: type, name: str) -> Setting:
    return declaration(next(f for f in dataclasses.fields(schema) if f.name == name))


def launcher_schema(kind: str) -> type[LauncherConfig]:
    return next(s for s in LAUNCHER_SCHEMAS if s.kind == kind)


def launcher_setting(launcher: dict | DictConfig | None, key: str) -> Any:
    """A launcher value from a task's resolved config, or its schema default (the one place defaults live)."""
    launcher = launcher or {}
    if key in launcher:
        return launcher[key]
    for schema in LAUNCHER_SCHEMAS:  # a field with a default_factory (a list, a nested config) is no attribute
        found = {f.name: f for f in dataclasses.fields(schema)}.get(key)
        if found is not None:
            return (
                cast(Callable[[], Any], found.default_factory)()
                if found.default is dataclasses.MISSING
                else found.default
            )
    raise KeyError(f"launcher.{key}: no launcher schema has it")


@dataclass
class Config:
    experiment: str = setting(
        "default",
        reader="launch/plan.py: experiment=cfg.experiment",
        sweep="one experiment per run (it names the run directory): sweep keys within it, or run each experiment on its own",
    )  # the run's name: runs are written under run_root/<experiment>/<time>/
    seed: int = setting(
        0,
        bounds=(0, None, True),
        reader="launch/plan.py: seed=cfg.seed",
        sweep="seed is the base model's init and the held-out eval batches, shared by every variant so that their losses compare: for replicates set seeds=3 (training seeds: LoRA init and data order)",
    )  # the base model's init and the held-out eval batches
    # training seeds (LoRA init, data order), one task per variant and seed: N (seed, seed+1, ..., seed+N-1) or a
    # list [0, 5, 9]; 1 = one task per variant, named as the variant (training_seeds); auto (with prune=true): 2
    # seeds each, then one more at a time while the contest is undecided, up to auto_seeds.max (worker/auto_seeds.py)
    seeds: Any = setting(
        1,
        takes="int, list or auto",
        reader="config/variants.py: value = cfg.seeds",
        sweep="seeds=N already runs every variant once per training seed: set it once, e.g. seeds=3",
        variant="every variant runs with the same training seeds",
    )
    auto_seeds: AutoSeedsConfig = setting(
        factory=AutoSeedsConfig,
        sweep="seeds=auto's cap and budget hold for the run's contest: set them once, e.g. auto_seeds.max=6",
    )
    # stop a clear loser at an in-training evaluation (train.eval_every), by the verdict's statistics: prune.py
    prune: bool = setting(
        False,
        reader='worker/decisions.py: bool(cfg.get("prune"))',
        sweep="prune compares the variants with each other while they train: set it once, prune=true",
        variant="it compares the variants with each other",
    )
    # print the plan (stages, tasks, devices, predicted memory, array sizes, worst-case device-hours; the Slurm
    # scripts and submit commands) and write only the preview: nothing trains or is submitted (launch/preview.py)
    dry_run: bool = setting(False, reader="cli/run.py: if cfg.dry_run")
    run_root: str = setting(
        "runs", reader="rundir/manifest.py: Path(cfg.run_root)", sweep="a run has one run directory"
    )  # where runs are written
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    launcher: Any = setting(
        MISSING, sweep="a run has one launcher: run each launcher on its own"
    )  # one of LAUNCHER_SCHEMAS, picked by the launcher group (conf/launcher/)
    train: TrainConfig = field(default_factory=TrainConfig)
    base: BaseStageConfig = setting(
        factory=BaseStageConfig,
        sweep="the base stage is trained once for the run and shared by every variant: run each base on its own",
    )
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    variants: Dict[str, Any] = setting(
        factory=dict,
        reader="config/variants.py: cfg.variants.items()",
        sweep="a variant's own keys are not swept: sweep the key itself (e.g. train.lr=1e-3,3e-3), and the grid multiplies the experiment's variants",
    )  # name -> overrides, e.g. {model: {lora: {r: 8}}}
    tracker: TrackerConfig = setting(
        factory=TrackerConfig,
        sweep="a run's trackers log every variant: name several at once, e.g. tracker=[tensorboard,mlflow]",
    )  # picked by the tracker group (conf/tracker/)
    eval: EvalConfig = field(default_factory=EvalConfig)  # task metrics and the primary one (config/metrics.py)


def declared(kind: str | None = None) -> dict[str, tuple[Setting, Any]]:
    """Every key's declaration and type hint, in the schema's order: Config's, with launcher.* those of
    launcher=kind's schema (None: of every launcher, each key once)."""
    return _declared(kind, tuple(LAUNCHER_SCHEMAS))


@functools.cache
def _declared(kind: str | None, schemas: tuple[type, ...]) -> dict[str, tuple[Setting, Any]]:
    out: dict[str, tuple[Setting, Any]] = {}
    for key, found, hint in walk(Config):
        if key != "launcher":
            out[key] = (found, hint)
            continue
        out[key] = (found, hint)
        for schema in LAUNCHER_SCHEMAS if kind is None else [launcher_schema(kind)]:
            for k, s, h in walk(schema, "launcher."):
                out.setdefault(k, (s, h))
    return out


def choices(key: str) -> tuple[str, ...]:
    """The values a key takes, where it is a choice (launcher.kind: its schemas' kinds, as backends add them)."""
    if key == "launcher.kind":
        return tuple(s.kind for s in LAUNCHER_SCHEMAS)
    found = declared().get(key)
    return found[0].choices if found else ()


# key -> its choices; launcher.kind: the schemas' kinds (scheduler/registry.py add_launcher_schema adds to it)
CHOICES: dict[str, tuple[str, ...]] = {k: s.choices for k, (s, _) in declared().items() if s.choices}
CHOICES["launcher.kind"] = choices("launcher.kind")
# key -> (low, high, low_inclusive); None = unbounded. A launcher's keys: launcher_schema(kind).declared()
RANGES: dict[str, tuple[float, float | None, bool]] = {k: s.bounds for k, (s, _) in declared().items() if s.bounds}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")


def _mapping_fields(schema: type, prefix: str = "") -> typing.Iterator[str]:
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if typing.get_origin(hints[f.name]) is dict:
            yield prefix + f.name
        elif dataclasses.is_dataclass(hints[f.name]):
            yield from _mapping_fields(hints[f.name], f"{prefix}{f.name}.")


def free_form_keys() -> tuple[str, ...]:
    """The free-form mappings (Dict fields: `variants`, `launcher.additional_parameters`): keys are the user's to
    choose, so `KEY={a: 1}` and `KEY.a=1` add to them without Hydra's '+' (compose() in config/compose.py). Asked
    each time: a backend adds its launchers' schemas when it loads."""
    launchers = (k for s in LAUNCHER_SCHEMAS for k in _mapping_fields(s, "launcher."))
    return tuple(sorted({*_mapping_fields(Config), *launchers}))


def register_schema() -> None:
    """The root schema, and each launcher's as launcher/<kind>_schema (conf/launcher/<kind>.yaml extends it)."""
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for schema in LAUNCHER_SCHEMAS:
        store.store(group="launcher", name=f"{schema.kind}_schema", node=schema)


def conf_dir() -> str:
    """The installed conf/ folder (works from any directory, for `pip install .` and `-e .` alike)."""
    return str(resources.files("slurm_router.conf"))


def valid_keys(path: str) -> list[str]:
    """The keys the schema allows under a dotted path ('' = top level): for 'unknown key' messages."""
    node = OmegaConf.structured(Config)
    if path:
        node = OmegaConf.select(node, path)
    return sorted(cast(Iterable[str], node.keys())) if isinstance(node, DictConfig) else []
