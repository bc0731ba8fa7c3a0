"""model.base_dropout: what a model=hf checkpoint's own dropout does while its frozen base is fine-tuned.

zero (the default): every dropout of the loaded model is 0, in its config (attn_pdrop, attention_dropout,
hidden_dropout, ...: some forwards read it there) and in the modules it built from it (nn.Dropout layers,
attention modules' float rates). The base is frozen, so its dropout only adds noise, and noise whose masks depend
on how a batch is split: routing, packing, the device count and fusing would each change the loss curve.
keep: the checkpoint trains with the dropout it ships. Every variant then runs unfused (fused variants would draw
their masks from one random stream), and the "same math" claims hold in expectation only: the masks drawn depend
on the split. LoRA's own dropout (model.lora.dropout) is peft's and is never touched here.

The plan says which, in one line, when the checkpoint ships a nonzero rate (plan_line).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from slurm_router.config import model_families

KEEP = "keep"
# rates a causal LM never reads (sequence-summary and classifier heads): neither reported nor worth a line
UNUSED_PREFIXES = ("summary_", "classifier_")


def _is_rate(key: str, value: Any) -> bool:
    name = key.lower()
    return ("dropout" in name or "pdrop" in name) and isinstance(value, (int, float)) and not isinstance(value, bool)


def _rates(settings: dict, prefix: str = "") -> dict[str, float]:
    """The nonzero dropout rates of a config.json's settings (nested configs as dotted keys), in key order."""
    out: dict[str, float] = {}
    for key, value in sorted(settings.items()):
        if isinstance(value, dict):
            out.update(_rates(value, f"{prefix}{key}."))
        elif _is_rate(key, value) and value > 0 and not key.startswith(UNUSED_PREFIXES):
            out[prefix + key] = float(value)
    return out


def shipped(name_or_path: str | None) -> dict[str, float]:
    """The nonzero dropout rates in the checkpoint's config.json ({} when it has none or cannot be read: the
    checkpoint's own checks, model.check_checkpoint, say what is wrong with it)."""
    if not name_or_path:
        return {}
    try:
        settings = json.loads((Path(os.path.expanduser(name_or_path)) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return _rates(settings) if isinstance(settings, dict) else {}


def _listed(rates: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in rates.items())


def _from_checkpoint(model: Any) -> bool:
    """A model section whose family loads a checkpoint (model=hf): only a checkpoint ships dropout rates."""
    found = model_families.named(model.get("kind"))
    return found is not None and found.from_checkpoint


def plan_line(model: Any) -> str | None:
    """The plan's line on the base's dropout (model: a variant's model config), or None when nothing drops out."""
    rates = shipped(model.get("name_or_path")) if _from_checkpoint(model) else {}
    if not rates:
        return None
    if str(model.get("base_dropout")) == KEEP:
        return (
            f"base dropout: kept (model.base_dropout=keep: {_listed(rates)}): variants run unfused, and routing, "
            "packing and the device count change which masks are drawn (the same loss curve in expectation, "
            "not step for step)"
        )
    return (
        f"base dropout: set to 0 (model.base_dropout=zero; the checkpoint ships {_listed(rates)}; "
        "model.base_dropout=keep keeps it)"
    )


def why_not_fused(model: Any) -> str | None:
    """launch/fuse.py: 'model.base_dropout=keep: why' for a model config whose kept dropout forbids fusing."""
    if str(model.get("base_dropout")) != KEEP or not _from_checkpoint(model):
        return None
    rates = shipped(model.get("name_or_path"))
    if not rates:
        return None
    return (
        f"model.base_dropout=keep: the checkpoint's dropout ({_listed(rates)}) would draw every variant's masks "
        "from one random stream (set model.base_dropout=zero to fuse it)"
    )


def turn_off(model: Any) -> None:
    """Every dropout rate of a transformers model set to 0, before peft adds its own (LoRA dropout stays)."""
    import torch

    _zero_config(model.config)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for key, value in list(vars(module).items()):  # e.g. LlamaAttention.attention_dropout, a float
            if _is_rate(key, value) and value > 0:
                setattr(module, key, 0.0)


def _zero_config(config: Any) -> None:
    from transformers import PretrainedConfig

    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):  # a composite model's text_config, ...
            _zero_config(value)
        elif _is_rate(key, value) and value > 0:
            setattr(config, key, 0.0)


def active(model: Any) -> list[str]:
    """The dropout still drawing masks in a model's base (module names, or module.attribute for a rate an
    attention module keeps as a float), peft's LoRA dropout left out."""
    import torch

    out = []
    for name, m in model.named_modules():
        if "lora_dropout" in name:
            continue
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            out.append(name)
        out += [f"{name}.{k}" for k, v in vars(m).items() if _is_rate(k, v) and v > 0]
    return out
