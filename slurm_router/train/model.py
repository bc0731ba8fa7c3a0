"""The model: a GPT-2-shaped causal LM built from a transformers config (no download) or a local checkpoint,
optionally wrapped in a peft LoRA adapter."""
from __future__ import annotations

import os
import warnings

import torch


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
