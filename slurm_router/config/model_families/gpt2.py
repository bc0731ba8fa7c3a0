"""model.kind=gpt2: a GPT-2 built from the config (model.n_layer, n_head, n_embd, ...), read by the byte-level
tokenizer; a base stage trains it first when base.enabled."""

from __future__ import annotations

from slurm_router.config.lora_targets import gpt2_lora_layers
from slurm_router.config.model_families import ModelFamily
from slurm_router.errors import UserError

# The byte-level tokenizer (train/tokenizer.py) model=gpt2 reads text with: 256 bytes + end-of-text.
BYTE_VOCAB_SIZE = 257


def check(cfg, where: str) -> None:
    if cfg.model.vocab_size < BYTE_VOCAB_SIZE:
        raise UserError(
            f"{where}model.vocab_size={cfg.model.vocab_size} is smaller than the byte-level tokenizer's "
            f"{BYTE_VOCAB_SIZE} tokens (model=gpt2 builds with it): set model.vocab_size>={BYTE_VOCAB_SIZE}"
        )
    if cfg.data.max_len > cfg.model.n_positions:
        raise UserError(
            f"{where}data.max_len={cfg.data.max_len} exceeds model.n_positions={cfg.model.n_positions}: "
            "lower data.max_len or raise model.n_positions"
        )


FAMILY = ModelFamily(
    kind="gpt2",
    from_checkpoint=False,
    trains_base_stage=True,
    packs_rows=True,
    leaves_unread={
        "model.name_or_path": (
            "by model.kind=gpt2 (a GPT-2 built from model.n_layer, model.n_embd, ...)",
            "add model=hf, or drop it",
        ),
        "model.base_dropout": ("by model.kind=gpt2 (the GPT-2 built here has no dropout)", "add model=hf, or drop it"),
    },
    lora_layers=lambda cfg: (gpt2_lora_layers(cfg.model.n_layer), "GPT2LMHeadModel"),
    check=check,
)
