"""The model: a GPT-2-shaped causal LM built from a transformers config (no download) or a local checkpoint,
optionally wrapped in a peft LoRA adapter."""
from __future__ import annotations

import json
import os
import warnings
import zipfile
from pathlib import Path

import torch

from slurm_router.config import UserError

# What transformers loads a causal LM's weights from, in its order of preference.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def build_model(model_cfg, vocab_size: int, seed: int, base_weights: str | None = None,
                lora: bool = True) -> torch.nn.Module:
    """Same seed -> the same initial weights on every worker (replicas start identical)."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    if model_cfg.kind == "hf":
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(model_cfg.name_or_path),
                                                     local_files_only=True, torch_dtype=torch.float32)
    else:
        # Dropout off: routing must never change the math, and dropout masks would depend on the split.
        config = GPT2Config(vocab_size=vocab_size, n_positions=model_cfg.n_positions, n_embd=model_cfg.n_embd,
                            n_layer=model_cfg.n_layer, n_head=model_cfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
        model = GPT2LMHeadModel(config)
    if base_weights:
        state = torch.load(base_weights, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    if lora and model_cfg.lora.enabled:
        from peft import LoraConfig, get_peft_model
        cfg = LoraConfig(r=model_cfg.lora.r, lora_alpha=model_cfg.lora.alpha, lora_dropout=model_cfg.lora.dropout,
                         target_modules=list(model_cfg.lora.target_modules), task_type="CAUSAL_LM")
        with warnings.catch_warnings():
            # GPT-2's Conv1D layers make peft warn about fan_in_fan_out; peft handles it.
            warnings.simplefilter("ignore")
            torch.manual_seed(seed + 1)
            model = get_peft_model(model, cfg)
    return model


def check_checkpoint(model_cfg, max_len: int) -> None:
    """model=hf: the local checkpoint has a config and whole weights, found before the run dir is written (it is
    read only at training time, in every worker), and its learned positions hold data.max_len tokens. Cheap:
    headers only. Raises UserError naming the file."""
    if model_cfg.kind != "hf":
        return
    where, setting = Path(os.path.expanduser(model_cfg.name_or_path)), f"model.name_or_path={model_cfg.name_or_path!r}"
    save = f"save the model there with model.save_pretrained('{model_cfg.name_or_path}')"
    config = where / "config.json"
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{setting}: the checkpoint {where} has no config.json: {save}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{setting}: {config} cannot be read ({getattr(e, 'strerror', None) or e}): {save}") from None
    if not isinstance(settings, dict):
        raise UserError(f"{setting}: {config} is not a transformers config (a JSON object): {save}")
    positions = settings.get("n_positions")                  # GPT-2's learned positions: a hard limit
    if isinstance(positions, int) and max_len > positions:
        raise UserError(f"data.max_len={max_len} exceeds the n_positions={positions} of {config}: "
                        f"set data.max_len={positions} or lower")
    found = next((where / f for f in WEIGHT_FILES if (where / f).exists()), None)
    if found is None:
        raise UserError(f"{setting}: the checkpoint {where} has no model weights (none of {', '.join(WEIGHT_FILES)}): "
                        f"{save}")
    for path in _shards(found, setting, save) if found.name.endswith(".index.json") else [found]:
        problem = _weights_problem(path)
        if problem:
            raise UserError(f"{setting}: weights file {path} {problem}: copy it again or {save}")


def _shards(index: Path, setting: str, save: str) -> list[Path]:
    try:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{setting}: {index} cannot be read ({type(e).__name__}): {save}") from None
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise UserError(f"{setting}: weights file {index.parent / missing[0]} is missing ({len(missing)} of the "
                        f"{len(shards)} shards {index.name} lists): copy it again or {save}")
    return [index.parent / s for s in shards]


def _weights_problem(path: Path) -> str | None:
    """Why a weights file cannot load, from its header alone (None: it looks whole)."""
    try:
        size = path.stat().st_size
        if size == 0:
            return "is empty"
        with open(path, "rb") as f:
            head = f.read(8)
            if path.suffix != ".safetensors":     # a torch.save zip: a truncated one lost its central directory
                return None if head[:2] != b"PK" or zipfile.is_zipfile(f) else "is truncated (not a whole zip file)"
            if len(head) < 8:
                return f"is truncated ({size} bytes)"
            n = int.from_bytes(head, "little")
            if n > size - 8:
                return f"is truncated or not a safetensors file ({size} bytes; its header says {n} for itself)"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except OSError as e:
        return f"cannot be read ({e.strerror or type(e).__name__})"
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return "is not a safetensors file (its header cannot be read)"
    if size != 8 + n + end:
        return f"is truncated or damaged ({size} bytes; its header declares {8 + n + end})"
    return None


def compile_backbone(model: torch.nn.Module) -> None:
    """torch.compile the transformer stack in place (the loss and the LM head stay eager: they may be chunked)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    lm.base_model.compile()


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    return total, sum(p.numel() for p in trainable_parameters(model))


def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full model's weights, LoRA merged out (for the base stage's cache)."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
