"""model.kind=hf: a local transformers checkpoint (model.name_or_path, never downloaded): its own shape, its own
tokenizer, no base stage; its LoRA layers are checked on the model (cli/checks.py check_models)."""

from __future__ import annotations

import os
from pathlib import Path

from slurm_router.config.model_families import ModelFamily
from slurm_router.errors import UserError

SHAPE = ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")


def check(cfg, where: str) -> None:
    if not cfg.model.name_or_path:
        raise UserError(f"{where}model.name_or_path is required with model=hf: give a local checkpoint directory")
    if not Path(os.path.expanduser(cfg.model.name_or_path)).is_dir():
        raise UserError(
            f"{where}model.name_or_path={cfg.model.name_or_path!r} is not a directory: "
            "give a local transformers checkpoint (nothing is downloaded)"
        )


FAMILY = ModelFamily(
    kind="hf",
    from_checkpoint=True,
    trains_base_stage=False,
    packs_rows=False,
    no_base_stage="with model=hf (no base stage: the checkpoint is the base)",
    leaves_unread={
        "base.enabled": (
            "by model=hf (a local checkpoint has learned already: no base stage)",
            "drop base.enabled=true",
        ),
        **{f"model.{k}": ("by model=hf (the checkpoint has its own shape)", "drop it") for k in SHAPE},
    },
    check=check,
)
