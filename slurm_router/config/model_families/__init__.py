"""Model families (`model.kind`): each a module here whose `FAMILY` says what the config check needs to know of it,
and its line in FAMILIES. The one place the config branches on model.kind; a new family is one module and one
line (the model itself is built in train/model.py)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FAMILIES: dict[str, str] = {  # model.kind -> its module; the order is the choices' order
    "gpt2": "slurm_router.config.model_families.gpt2",
    "hf": "slurm_router.config.model_families.hf",
}


@dataclass(frozen=True)
class ModelFamily:
    """kind: its model.kind. trains_base_stage: base.enabled trains a base model first (a checkpoint has learned
    already). packs_rows: it takes packed rows for sure (a checkpoint's attention may not: train/packed.py).
    no_base_stage: why base.* is unread with it, in words. leaves_unread: model.* (and base.enabled) keys it does
    not read -> (why, fix). lora_layers: the LoRA layer names of a config, to check target_modules against (None:
    checked on the model, cli/checks.py). check: its own value checks (UserError; `where` leads the line)."""

    kind: str
    from_checkpoint: bool  # loaded from model.name_or_path (its own tokenizer), not built from the config
    trains_base_stage: bool
    packs_rows: bool
    no_base_stage: str = ""
    leaves_unread: dict[str, tuple[str, str]] = field(default_factory=dict)
    lora_layers: Callable[[Any], tuple[list[str], str]] | None = None
    check: Callable[[Any, str], None] = lambda cfg, where: None


def family(kind: str) -> ModelFamily:
    return importlib.import_module(FAMILIES[kind]).FAMILY


def named(kind: Any) -> ModelFamily | None:
    """The family of a model.kind read from a plain mapping (a task's model section), None for none of FAMILIES."""
    return family(kind) if isinstance(kind, str) and kind in FAMILIES else None


def of(cfg) -> ModelFamily:
    """The family of a config (its model.kind, checked to be one of FAMILIES)."""
    return family(str(cfg.model.kind))


def from_checkpoint(model_cfg) -> bool:
    """A model section (a task's too) whose family loads a checkpoint rather than building from the config."""
    return family(str(model_cfg.kind)).from_checkpoint
