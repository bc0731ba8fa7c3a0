"""Settings that the run's other settings leave unread: one line naming the key and the fix when the user sets one
(on the command line, or in a variant's overrides), instead of a run that silently trains without it.

A key read only under a condition of the config (base.steps only with a base stage, router.speed_ema only with
router.speed_model=ema, ...) declares it beside its field (its read_if: config/settings.py, config/conditions.py). A key the user set is refused when no config of the run
reads it: not the run's own and not any variant's. A key that a variant's own overrides set is refused when that
variant does not read it. A value that comes from a config group or an experiment (conf/*.yaml) is not the
user's: `+experiment=lora_ab base.enabled=false` leaves the experiment's base.steps alone. The data.* keys have
their own check (config/checks.py, check_data_keys); tests/test_every_setting.py walks every key.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from slurm_router.config.schema import declared
from slurm_router.config.settings import Condition
from slurm_router.errors import UserError


def rule_of(key: str) -> Condition | None:
    """The condition a key is read under (its declaration's read_if), or None: read whenever it is set. Asked each
    time: a backend adds its launchers' keys when it loads."""
    found = declared().get(key)
    return found[0].read_if if found else None


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


def _refusal(key: str, rule: Condition, c: DictConfig, where: str = "") -> UserError:
    value = OmegaConf.select(c, key)
    shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return UserError(f"{where}{key}={shown!r} is not read {rule.why(c)}, so it would be ignored: {rule.fix_for(c)}")


def refuse_unread(cfg: DictConfig, variants: dict[str, DictConfig], keys: Iterable[str]) -> None:
    """UserError (one line) for a key in `keys` (the user's) that no config of the run reads, or a key of a
    variant's own overrides that the variant does not read. variants: each variant's merged config."""
    configs = [cfg, *variants.values()]
    for key in keys:
        rule = rule_of(key)
        if rule is not None and not any(rule.reads(c) for c in configs):
            raise _refusal(key, rule, cfg)
    for name, overrides in (cfg.variants or {}).items():
        for key in _leaves(overrides, ""):
            rule = rule_of(key)
            if rule is not None and name in variants and not rule.reads(variants[name]):
                raise _refusal(key, rule, variants[name], where=f"variants.{name}: ")
