"""Settings that the run's other settings leave unread: one line naming the key and the fix when the user sets one
(on the command line, or in a variant's overrides), instead of a run that silently trains without it.

Each rule names keys that are read only under a condition of the config (base.steps only with a base stage,
router.speed_ema only with router.speed_model=ema, ...). A key the user set is refused when no config of the run
reads it: not the run's own and not any variant's. A key that a variant's own overrides set is refused when that
variant does not read it. A value that comes from a config group or an experiment (conf/*.yaml) is not the
user's: `+experiment=lora_ab base.enabled=false` leaves the experiment's base.steps alone. The data.* keys have
their own check (config/checks.py, check_data_keys); tests/test_every_setting.py walks every key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from slurm_router.config.schema import fusing
from slurm_router.errors import UserError


def _base_stage(c: DictConfig) -> bool:
    """As artifacts/base_cache.needs_base_stage: a model built from a config trains a base stage first."""
    return bool(c.base.enabled) and c.model.kind == "gpt2"


def _packed_for_sure(c: DictConfig) -> bool:
    """As train/packed.py choose_packing for a GPT-2 (which can take packed rows); a model=hf checkpoint may not."""
    packing = str(c.train.packing).lower()
    return c.model.kind == "gpt2" and (packing == "true" or (packing == "auto" and not c.train.compile))


@dataclass(frozen=True)
class Rule:
    keys: tuple[str, ...]
    reads: Callable[[DictConfig], bool]  # whether a config reads these keys
    why: Callable[[DictConfig], str]  # the setting that leaves them unread, in words
    fix: str


LORA_KEYS = ("r", "alpha", "dropout", "target_modules", "use_rslora", "use_dora")
RULES = (
    Rule(
        ("base.steps", "base.lr", "base.global_batch_size", "base.cache_dir"),
        _base_stage,
        lambda c: (
            "with model=hf (no base stage: the checkpoint is the base)"
            if c.base.enabled
            else "with base.enabled=false (no base stage)"
        ),
        "set base.enabled=true, or drop it",
    ),
    Rule(
        ("base.enabled",),
        lambda c: c.model.kind == "gpt2" or not c.base.enabled,
        lambda c: "by model=hf (a local checkpoint has learned already: no base stage)",
        "drop base.enabled=true",
    ),
    Rule(
        ("model.name_or_path",),
        lambda c: c.model.kind == "hf",
        lambda c: f"by model.kind={c.model.kind} (a GPT-2 built from model.n_layer, model.n_embd, ...)",
        "add model=hf, or drop it",
    ),
    Rule(
        ("model.base_dropout",),
        lambda c: c.model.kind == "hf",
        lambda c: f"by model.kind={c.model.kind} (the GPT-2 built here has no dropout)",
        "add model=hf, or drop it",
    ),
    Rule(
        tuple(f"model.{k}" for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")),
        lambda c: c.model.kind == "gpt2",
        lambda c: "by model=hf (the checkpoint has its own shape)",
        "drop it",
    ),
    Rule(
        ("model.dtype", *(f"model.lora.{k}" for k in LORA_KEYS)),
        lambda c: bool(c.model.lora.enabled),
        lambda c: "with model.lora.enabled=false (full fine-tuning: no adapter, fp32 weights)",
        "set model.lora.enabled=true, or drop it",
    ),
    Rule(
        ("router.attention_weight", "router.attention_ref_len"),
        lambda c: c.router.cost == "tokens_attention",
        lambda c: f"with router.cost={c.router.cost}",
        "set router.cost=tokens_attention, or drop it",
    ),
    Rule(
        ("router.affinity_boundaries",),
        lambda c: c.router.policy == "affinity",
        lambda c: f"with router.policy={c.router.policy}",
        "add router=affinity, or drop it",
    ),
    Rule(
        ("router.speed_ema",),
        lambda c: c.router.speed_model == "ema",
        lambda c: f"with router.speed_model={c.router.speed_model}",
        "set router.speed_model=ema, or drop it",
    ),
    Rule(
        ("train.pad_to_multiple",),
        lambda c: not _packed_for_sure(c),
        lambda c: f"with train.packing={str(c.train.packing).lower()} (packed rows have no padding)",
        "set train.packing=false (padded micro-batches), or drop it",
    ),
    Rule(
        ("router.row_cost",),
        lambda c: str(c.train.packing).lower() != "false",
        lambda c: "with train.packing=false (the row cost is a packed row's)",
        "set train.packing=auto, or drop it",
    ),
    Rule(
        ("train.fused_layout",),
        fusing,
        lambda c: "with resources.fuse_variants=1 (no fused tasks)",
        "set resources.fuse_variants=K (K >= 2) or auto, or drop it",
    ),
    Rule(
        ("launcher.cpus_per_device",),
        lambda c: c.launcher.get("cpus_per_task") is None,
        lambda c: f"with launcher.cpus_per_task={c.launcher.get('cpus_per_task')} (the CPUs per task, as given)",
        "drop one of the two",
    ),
    Rule(
        ("auto_seeds.max", "auto_seeds.budget_device_hours", "auto_seeds.min_effect"),
        lambda c: c.get("seeds") == "auto",
        lambda c: (
            f"with seeds={OmegaConf.to_container(c.seeds) if OmegaConf.is_list(c.seeds) else c.seeds} (a fixed "
            "number of seeds: no reserves to add)"
        ),
        "set seeds=auto prune=true, or drop it",
    ),
    Rule(
        ("launcher.mail_user",),
        lambda c: bool(c.launcher.get("mail_type")),
        lambda c: "without launcher.mail_type (Slurm sends no mail)",
        "set launcher.mail_type=END,FAIL, or drop it",
    ),
)
RULE_OF = {key: rule for rule in RULES for key in rule.keys}


def _leaves(value: Any, prefix: str) -> list[str]:
    """The dotted keys of a value set at `prefix`: itself, or each leaf of a mapping (base={steps: 5})."""
    if OmegaConf.is_dict(value):
        value = OmegaConf.to_container(value)
    if isinstance(value, dict) and value:
        return [k for name, v in value.items() for k in _leaves(v, f"{prefix}.{name}" if prefix else str(name))]
    return [prefix] if prefix else []


def set_keys(overrides: list[str]) -> list[str]:
    """The dotted keys the user's overrides set (a config group's choice sets no key here). A -m sweep's values
    are its variants' overrides, checked variant by variant (refuse_unread)."""
    from slurm_router.config.sweep import parse_overrides

    keys: list[str] = []
    for o in parse_overrides(overrides):
        if o.is_delete() or o.is_sweep_override():
            continue
        value = o.value()
        keys += _leaves(value, o.key_or_group) if isinstance(value, dict) else [o.key_or_group]
    return keys


def _refusal(key: str, rule: Rule, c: DictConfig, where: str = "") -> UserError:
    value = OmegaConf.select(c, key)
    shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return UserError(f"{where}{key}={shown!r} is not read {rule.why(c)}, so it would be ignored: {rule.fix}")


def refuse_unread(cfg: DictConfig, variants: dict[str, DictConfig], keys: Iterable[str]) -> None:
    """UserError (one line) for a key in `keys` (the user's) that no config of the run reads, or a key of a
    variant's own overrides that the variant does not read. variants: each variant's merged config."""
    configs = [cfg, *variants.values()]
    for key in keys:
        rule = RULE_OF.get(key)
        if rule is not None and not any(rule.reads(c) for c in configs):
            raise _refusal(key, rule, cfg)
    for name, overrides in (cfg.variants or {}).items():
        for key in _leaves(overrides, ""):
            rule = RULE_OF.get(key)
            if rule is not None and name in variants and not rule.reads(variants[name]):
                raise _refusal(key, rule, variants[name], where=f"variants.{name}: ")
