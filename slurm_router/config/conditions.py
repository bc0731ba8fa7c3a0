"""The conditions a key is read under (a setting's `read_if`, config/settings.py): base.steps only with a base
stage, router.speed_ema only with router.speed_model=ema, ... config/unread.py refuses a key the user set where
its condition leaves it unread. Model families answer for model.kind (config/model_families/)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from slurm_router.config import model_families
from slurm_router.config.settings import Condition

FUSE_AUTO = "auto"  # resources.fuse_variants=auto


def fusing(cfg) -> bool:
    """resources.fuse_variants asks for fused tasks: auto, or K >= 2 (checked: an int or auto)."""
    width = cfg.resources.get("fuse_variants", 1)
    return width == FUSE_AUTO or int(width) >= 2


def _packed_for_sure(c: DictConfig) -> bool:
    """As train/packed.py choose_packing for a family that takes packed rows; a checkpoint's may not."""
    packing = str(c.train.packing).lower()
    return model_families.of(c).packs_rows and (packing == "true" or (packing == "auto" and not c.train.compile))


BASE_STAGE = Condition(  # as artifacts/base_cache.needs_base_stage: a base stage trains first
    lambda c: bool(c.base.enabled) and model_families.of(c).trains_base_stage,
    lambda c: model_families.of(c).no_base_stage if c.base.enabled else "with base.enabled=false (no base stage)",
    "set base.enabled=true, or drop it",
    on=("base.enabled=true",),
)


def family_reads(key: str, off: tuple[str, ...] = (), on: tuple[str, ...] = ()) -> Condition:
    """Read unless the config's model family leaves it unread (its leaves_unread)."""
    return Condition(
        lambda c: key not in model_families.of(c).leaves_unread,
        lambda c: model_families.of(c).leaves_unread[key][0],
        lambda c: model_families.of(c).leaves_unread[key][1],
        off=off,
        on=on,
    )


HF = ("model=hf", "model.name_or_path=/tmp")
BASE_ENABLED = Condition(
    lambda c: not c.base.enabled or "base.enabled" not in model_families.of(c).leaves_unread,
    lambda c: model_families.of(c).leaves_unread["base.enabled"][0],
    lambda c: model_families.of(c).leaves_unread["base.enabled"][1],
    off=HF,
)
HF_ONLY = (), ("model=hf",)  # (off, on) of a key only a checkpoint reads
LORA = Condition(
    lambda c: bool(c.model.lora.enabled),
    lambda c: "with model.lora.enabled=false (full fine-tuning: no adapter, fp32 weights)",
    "set model.lora.enabled=true, or drop it",
    off=("model.lora.enabled=false",),
)
ATTENTION_COST = Condition(
    lambda c: c.router.cost == "tokens_attention",
    lambda c: f"with router.cost={c.router.cost}",
    "set router.cost=tokens_attention, or drop it",
    on=("router.cost=tokens_attention",),
)
AFFINITY = Condition(
    lambda c: c.router.policy == "affinity",
    lambda c: f"with router.policy={c.router.policy}",
    "add router=affinity, or drop it",
    on=("router=affinity",),
)
EMA = Condition(
    lambda c: c.router.speed_model == "ema",
    lambda c: f"with router.speed_model={c.router.speed_model}",
    "set router.speed_model=ema, or drop it",
    on=("router.speed_model=ema",),
)
PADDED = Condition(
    lambda c: not _packed_for_sure(c),
    lambda c: f"with train.packing={str(c.train.packing).lower()} (packed rows have no padding)",
    "set train.packing=false (padded micro-batches), or drop it",
    on=("train.packing=false",),
)
PACKED = Condition(
    lambda c: str(c.train.packing).lower() != "false",
    lambda c: "with train.packing=false (the row cost is a packed row's)",
    "set train.packing=auto, or drop it",
    off=("train.packing=false",),
)
FUSED = Condition(
    fusing,
    lambda c: "with resources.fuse_variants=1 (no fused tasks)",
    "set resources.fuse_variants=K (K >= 2) or auto, or drop it",
    on=("resources.fuse_variants=2",),
)
AUTO_SEEDS = Condition(
    lambda c: c.get("seeds") == "auto",
    lambda c: (
        f"with seeds={OmegaConf.to_container(c.seeds) if OmegaConf.is_list(c.seeds) else c.seeds} (a fixed "
        "number of seeds: no reserves to add)"
    ),
    "set seeds=auto prune=true, or drop it",
    on=("seeds=auto", "prune=true"),
)
