"""model.lora.target_modules: the layer names a LoRA config may name, checked without building the model (no torch)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from slurm_router.errors import UserError

# Layers of transformers' GPT-2 that peft LoRA can adapt (embeddings, Conv1D projections, the LM head), by their
# dotted names: model=gpt2_* is checked without building it (no torch here); tests/test_hf_models.py checks
# them against the real model. model=hf builds its architecture on the meta device (model.check_architecture).
GPT2_LORA_BLOCK = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
TARGET_MODULES_HINT = "auto (peft's default layers for the architecture), all-linear, or a list of layer names"


def gpt2_lora_layers(n_layer: int) -> list[str]:
    return [
        "transformer.wte",
        "transformer.wpe",
        *(f"transformer.h.{i}.{b}" for i in range(n_layer) for b in GPT2_LORA_BLOCK),
        "lm_head",
    ]


def target_module_names(value: Any, where: str = "") -> list[str] | None:
    """model.lora.target_modules as a list of layer names (one name alone is a list of one); None for auto and
    all-linear, which peft resolves. UserError if it is none of these."""
    if value in ("auto", "all-linear"):
        return None
    is_list = isinstance(value, (list, tuple)) or OmegaConf.is_list(value)
    names = ([value] if value else []) if isinstance(value, str) else list(value) if is_list else None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise UserError(f"{where}model.lora.target_modules={value!r} is not valid: use {TARGET_MODULES_HINT}")
    if not names:
        raise UserError(
            f"{where}model.lora.target_modules is empty: name the layers to adapt, or use {TARGET_MODULES_HINT}"
        )
    return names


def check_target_modules(names: list[str], layers: list[str], model: str, where: str = "") -> None:
    """Each name is a layer LoRA can adapt (peft's rule: a layer's dotted name is it or ends with '.' + it);
    else UserError listing the layers `model` has."""
    for name in names:
        if not any(layer == name or layer.endswith("." + name) for layer in layers):
            have = ", ".join(dict.fromkeys(layer.rsplit(".", 1)[-1] for layer in layers))
            raise UserError(
                f"{where}model.lora.target_modules: {name!r} is not a layer of {model} that LoRA can "
                f"adapt: its layers are {have} (or use auto or all-linear)"
            )
