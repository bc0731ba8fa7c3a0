"""A config's variants and training seeds: each variant's merged config, the seeds it replicates over, and
validate(), every check that needs no data (the whole ordered pipeline: slurm_router.cli.checks).
"""

from __future__ import annotations

import pickle
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slurm_router.config.checks import check_values, explain
from slurm_router.config.metrics import check_eval_config
from slurm_router.config.schema import NAME_RE
from slurm_router.errors import UserError
from slurm_router.verdict import AUTO_FIRST

SEEDS_HINT = (
    "seeds=N (N training seeds from seed on), a list of distinct whole numbers >= 0, e.g. seeds=[0,5,9], or "
    "seeds=auto with prune=true"
)
MAX_SEEDS = 1000
AUTO = "auto"


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def training_seeds(cfg: DictConfig) -> list[int]:
    """A variant's training seeds, one task each (LoRA init and data order; cfg.seed keeps the base model's init
    and the held-out eval batches): seeds=N gives seed, seed+1, ..., seed+N-1; seeds=[...] the list as given;
    seeds=auto the first auto_seeds.max (each after the first 2 a reserve that runs only while the contest is
    undecided). Raises UserError (one line naming seeds) for anything else."""
    value = cfg.seeds
    if value == AUTO:
        return [cfg.seed + i for i in range(auto_cap(cfg))]
    if OmegaConf.is_list(value) or isinstance(value, (list, tuple)):
        seeds, shown = list(value), "[" + ",".join(map(str, value)) + "]"
        if not seeds:
            raise UserError(f"seeds=[] is empty: give at least one seed: {SEEDS_HINT}")
        bad = next((s for s in seeds if not _whole(s) or s < 0), None)
        if bad is not None or len(seeds) > MAX_SEEDS:
            what = f"{bad!r} is not a whole number >= 0" if bad is not None else f"more than {MAX_SEEDS} seeds"
            raise UserError(f"seeds={shown}: {what}: {SEEDS_HINT}")
        twice = next((s for i, s in enumerate(seeds) if s in seeds[:i]), None)
        if twice is not None:
            raise UserError(f"seeds={shown}: seed {twice} is listed twice: each replicate needs its own seed")
        return seeds
    if not _whole(value):
        raise UserError(f"seeds={value!r} is not a whole number: {SEEDS_HINT}")
    if not 1 <= value <= MAX_SEEDS:
        raise UserError(
            f"seeds={value} is out of range: it must be >= 1 and <= {MAX_SEEDS} (the number of training "
            "seeds per variant), or a list such as seeds=[0,5,9]"
        )
    return [cfg.seed + i for i in range(value)]


def auto_cap(cfg) -> int:
    """seeds=auto's replicates per variant at most (auto_seeds.max), checked."""
    cap = (cfg.get("auto_seeds") or {}).get("max", 6)
    if not _whole(cap) or not AUTO_FIRST < cap <= MAX_SEEDS:
        raise UserError(
            f"auto_seeds.max={cap!r}: seeds=auto starts each variant with {AUTO_FIRST} seeds and adds reserves up "
            f"to this cap: give a whole number from {AUTO_FIRST + 1} to {MAX_SEEDS}, e.g. auto_seeds.max=6"
        )
    return cap


def is_auto(cfg) -> bool:
    return cfg.get("seeds") == AUTO


def variant_configs(cfg: DictConfig) -> dict[str, DictConfig]:
    """Each variant's full config: the experiment's config with that variant's overrides merged in."""
    out: dict[str, DictConfig] = {}
    if not isinstance(cfg.variants, DictConfig):
        raise UserError("variants must be a mapping of name -> overrides, e.g. variants: {r8: {model: {lora: {r: 8}}}}")
    common: Any = cfg.copy()
    common.variants = {}  # merged without the variants, a sweep's 100 variants stay linear, and a fresh
    common = pickle.dumps(common)  # copy is unpickled for each (3x faster than OmegaConf.merge's deepcopy)
    for name, overrides in cfg.variants.items():
        name = str(name)
        if not NAME_RE.match(name):
            raise UserError(
                f"variants.{name!r}: a variant name must be 1-64 letters, digits, '_', '.', '+', '-' "
                "and start with a letter or digit (it names folders and Slurm jobs)"
            )
        if name == "base":
            raise UserError("variants.base: 'base' is the name of the base stage; rename the variant")
        if overrides is not None and not isinstance(overrides, DictConfig):
            raise UserError(f"variants.{name} must be a mapping of overrides, e.g. {{train: {{lr: 1e-3}}}}")
        if overrides is not None and "variants" in overrides:
            raise UserError(f"variants.{name}: a variant cannot declare variants")
        if overrides is not None:
            _refuse_top_level(name, overrides)
        try:
            # unsafe_merge takes over its inputs: a fresh copy, and the overrides as plain containers
            out[name] = cast(
                DictConfig,
                OmegaConf.unsafe_merge(pickle.loads(common), OmegaConf.to_container(overrides) if overrides else {}),
            )
        except OmegaConfBaseException as e:
            raise explain(e, where=f"variants.{name}: ") from None
    return out


def _refuse_top_level(name: str, overrides: DictConfig) -> None:
    """A key whose declaration says it is set once, at the top level (its `variant`: why), in a variant's own
    overrides: one line naming it."""
    from slurm_router.config.schema import declared

    for key, (found, _) in declared().items():
        if found.variant and OmegaConf.select(overrides, key, default=_ABSENT) is not _ABSENT:
            subject = f"{key} is" if "." not in key else "it is"
            raise UserError(
                f"variants.{name}.{key}: {subject} set once, at the top level ({found.variant}): set {key}= outside "
                "the variant"
            )


_ABSENT = object()


def validate(cfg: DictConfig) -> dict[str, DictConfig]:
    """All checks that need no data: returns the variants' configs. Raises UserError."""
    if not NAME_RE.match(str(cfg.experiment)):
        raise UserError(f"experiment={cfg.experiment!r}: use 1-64 letters, digits, '_', '.', '+', '-'")
    check_values(cfg)
    check_eval_config(cfg)
    training_seeds(cfg)
    variants = variant_configs(cfg)
    for name, vcfg in variants.items():
        check_values(vcfg, where=f"variants.{name}: ")
    if not variants:
        variants = {"main": cfg.copy()}
    if is_auto(cfg) and not cfg.prune:
        raise UserError(
            "seeds=auto adds replicates only where the prune contest is undecided: set prune=true with it "
            "(seeds=auto prune=true), or give a number, e.g. seeds=3"
        )
    budget = (cfg.get("auto_seeds") or {}).get("budget_device_hours")
    if budget is not None and budget <= 0:  # a number: the schema types it
        raise UserError(
            f"auto_seeds.budget_device_hours={budget:g}: give a number of device-hours > 0, e.g. 2.5, or null "
            "(no budget: reserves run until the contest is decided or auto_seeds.max)"
        )
    effect = (cfg.get("auto_seeds") or {}).get("min_effect")
    if effect is not None and effect <= 0:  # a number: the schema types it
        raise UserError(
            f"auto_seeds.min_effect={effect:g}: give the smallest difference worth more seeds, > 0, in the primary "
            "metric's units (e.g. 0.02 nats per token), or null (reserves run until a variant is pruned)"
        )
    if cfg.prune:
        check_prune(cfg, variants)
    return variants


def check_prune(cfg: DictConfig, variants: dict[str, DictConfig]) -> None:
    """prune=true compares variants at their in-training evaluations: it needs two variants that evaluate."""
    if len(variants) < 2:
        raise UserError(
            "prune=true compares variants with each other, and this run has one: give two or more "
            "variants (variants: or a -m sweep), or leave prune off"
        )
    if len(training_seeds(cfg)) < 2:
        raise UserError(
            "prune=true needs seeds >= 2 (e.g. seeds=3): with one training seed per variant its interval "
            "cannot include training noise, and eval-sample noise alone would stop equally good "
            "variants (prune.py)"
        )
    for name, vcfg in variants.items():
        if not vcfg.train.eval_every or vcfg.train.eval_every >= vcfg.train.steps:
            own = (vcfg.train.eval_every, vcfg.train.steps) != (cfg.train.eval_every, cfg.train.steps)
            where = f"variants.{name}: " if own else ""  # the variant's own setting, or everyone's
            steps = vcfg.train.steps
            fix = (
                f"set e.g. {where.rstrip(': ') + '.' if own else ''}train.eval_every={max(1, steps // 4)} "
                "(it looks at the evaluations from half of training on)"
                if steps >= 2
                else "train more than one step"
            )
            raise UserError(
                f"{where}prune=true needs train.eval_every > 0 and below train.steps={steps} "
                f"(it decides at the in-training evaluations; train.eval_every={vcfg.train.eval_every}): {fix}"
            )
