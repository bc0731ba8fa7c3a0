"""The model: a causal LM built from a transformers config (model=gpt2_*: GPT-2-shaped, no download) or loaded
from a local checkpoint (model=hf: any architecture AutoModelForCausalLM loads), wrapped in a peft LoRA adapter
for a variant. Frozen weights in model.dtype, trainable weights in fp32 (docs/design/model.md, "The model")."""

from __future__ import annotations

import functools
import json
import os
import warnings
import zipfile
from pathlib import Path
from typing import Any, cast

import torch

from slurm_router.config.lora_targets import check_target_modules, target_module_names
from slurm_router.config.model_families import from_checkpoint
from slurm_router.errors import UserError
from slurm_router.train import base_dropout
from slurm_router.train.tokenizer import ByteTokenizer

# What transformers loads a causal LM's weights from, in its order of preference.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def frozen_dtype(model_cfg, device: torch.device | str | None = None) -> torch.dtype:
    """model.dtype of the frozen weights: auto is bf16 on a GPU (half the bytes of fp32), fp32 on CPU."""
    if model_cfg.dtype == "bf16" or (model_cfg.dtype == "auto" and torch.device(device or "cpu").type == "cuda"):
        return torch.bfloat16
    return torch.float32


def quiet_transformers() -> None:
    """No progress bars, warnings or advice lines from transformers in a task's log (loading, save_pretrained)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def build_model(
    model_cfg,
    vocab_size: int,
    seed: int,
    base_weights: str | None = None,
    lora: bool = True,
    device: torch.device | str | None = None,
    gradient_checkpointing: bool = False,
    lora_seed: int | None = None,
) -> torch.nn.Module:
    """The model a task trains, on the CPU (the caller moves it to `device`, which decides model.dtype=auto).

    Weights: base_weights (a folder: the base stage's save_pretrained cache, base_cache.py) instead of the
    checkpoint at model.name_or_path (model=hf) or a GPT-2 built from model_cfg. Same seed -> the same initial
    weights on every worker (replicas start identical); the LoRA weights are seeded with lora_seed + 1 (a
    replicate's training seed; default: seed). A LoRA variant keeps its frozen weights in model.dtype and its
    trainable LoRA weights in fp32 (peft's autocast_adapter_dtype); full training (the base stage,
    model.lora.enabled=false) keeps fp32 master weights whatever model.dtype says (autocast still computes in
    bf16 on a GPU)."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    quiet_transformers()
    adapt = lora and model_cfg.lora.enabled
    dtype = frozen_dtype(model_cfg, device) if adapt else torch.float32
    torch.manual_seed(seed)
    folder = base_weights or None
    model: Any
    if folder or from_checkpoint(model_cfg):
        model = AutoModelForCausalLM.from_pretrained(
            folder or os.path.expanduser(model_cfg.name_or_path), local_files_only=True, dtype=dtype
        )
    else:
        # Dropout off: routing must never change the math, and dropout masks would depend on the split.
        config = GPT2Config(
            vocab_size=vocab_size,
            n_positions=model_cfg.n_positions,
            n_embd=model_cfg.n_embd,
            n_layer=model_cfg.n_layer,
            n_head=model_cfg.n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=ByteTokenizer.eot_id,  # the byte-level tokenizer's end-of-text starts every sample
            eos_token_id=ByteTokenizer.eot_id,
        )
        model = GPT2LMHeadModel(config)
    if not folder and not from_checkpoint(model_cfg):
        model.to(dtype)  # built in fp32 (the seeded init), kept in dtype; from_pretrained loaded it in dtype
    elif getattr(model_cfg, "base_dropout", "zero") != base_dropout.KEEP:  # a task.json from before the key: zero
        base_dropout.turn_off(model)  # before peft: LoRA's own dropout is the variant's
    if gradient_checkpointing:  # layer activations recomputed in backward; a KV cache is of no use in training
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name for it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if adapt:
        from peft import LoraConfig, get_peft_model

        lc = model_cfg.lora
        cfg = LoraConfig(
            r=lc.r,
            lora_alpha=lc.alpha,
            lora_dropout=lc.dropout,
            use_rslora=lc.use_rslora,
            use_dora=lc.use_dora,
            target_modules=lora_targets(model_cfg, model),
            task_type="CAUSAL_LM",
        )
        with warnings.catch_warnings():
            # GPT-2's Conv1D layers make peft warn about fan_in_fan_out; peft handles it.
            warnings.simplefilter("ignore")
            torch.manual_seed((seed if lora_seed is None else lora_seed) + 1)
            model = get_peft_model(model, cfg)  # autocast_adapter_dtype (default): LoRA weights in fp32
    return model.train()  # from_pretrained returns a model in eval mode


def lora_targets(model_cfg, model: torch.nn.Module) -> str | list[str] | None:
    """peft's target_modules for model.lora.target_modules: auto -> None (peft's own default layers for this
    architecture, e.g. q_proj and v_proj for Llama) or all-linear where peft has none; all-linear; a list."""
    names = target_module_names(model_cfg.lora.target_modules)
    if names is not None:
        return names
    if model_cfg.lora.target_modules == "auto":
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

        return None if cast(Any, model).config.model_type in PEFT_DEFAULTS else "all-linear"
    return "all-linear"


def lora_layers(model: torch.nn.Module) -> list[str]:
    """The dotted names of the layers peft's LoRA can adapt (linear, embedding, convolution)."""
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, Conv1D)
    return [name for name, m in model.named_modules() if name and isinstance(m, kinds)]


def check_architecture(model_cfg, where: str = "") -> None:
    """model=hf, before anything is written: the checkpoint is a causal LM transformers knows, and
    model.lora.target_modules names layers it has (UserError listing the ones it has). Its architecture is
    built on the meta device from config.json: no memory, no weights read."""
    model = meta_model(os.path.expanduser(model_cfg.name_or_path), model_cfg.name_or_path)
    names = target_module_names(model_cfg.lora.target_modules, where) if model_cfg.lora.enabled else None
    if names:
        check_target_modules(names, lora_layers(model), type(model).__name__, where)


@functools.lru_cache(maxsize=8)
def meta_model(path: str, setting: str) -> torch.nn.Module:
    """The causal LM of the checkpoint at `path` on the meta device (shapes and names only)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    quiet_transformers()
    where = f"model.name_or_path={setting!r}"
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # an unknown model_type, custom code, a config transformers cannot parse
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"{where}: transformers cannot read the config.json of {path} ({first}): give a "
            "causal-LM checkpoint saved with save_pretrained"
        ) from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(
            f"{where}: the checkpoint is a {config.model_type} model ({type(config).__name__}), not a "
            "causal language model AutoModelForCausalLM can load: give a decoder-only checkpoint "
            "(llama, qwen2, mistral, gpt2, ...)"
        )
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"{where}: transformers cannot build the {config.model_type} model its config.json "
            f"describes ({first}): fix config.json or save the model again"
        ) from None


def check_checkpoint(model_cfg, max_len: int) -> None:
    """model=hf: the local checkpoint has a config and whole weights, found before the run dir is written (it is
    read only at training time, in every worker), and its learned positions hold data.max_len tokens. Cheap:
    headers only. Raises UserError naming the file."""
    if not from_checkpoint(model_cfg):
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
    positions = settings.get("n_positions")  # GPT-2's learned positions: a hard limit
    if isinstance(positions, int) and max_len > positions:
        raise UserError(
            f"data.max_len={max_len} exceeds the n_positions={positions} of {config}: "
            f"set data.max_len={positions} or lower"
        )
    found = next((where / f for f in WEIGHT_FILES if (where / f).exists()), None)
    if found is None:
        raise UserError(
            f"{setting}: the checkpoint {where} has no model weights (none of {', '.join(WEIGHT_FILES)}): {save}"
        )
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
        raise UserError(
            f"{setting}: weights file {index.parent / missing[0]} is missing ({len(missing)} of the "
            f"{len(shards)} shards {index.name} lists): copy it again or {save}"
        )
    return [index.parent / s for s in shards]


def _weights_problem(path: Path) -> str | None:
    """Why a weights file cannot load, from its header alone (None: it looks whole)."""
    try:
        size = path.stat().st_size
        if size == 0:
            return "is empty"
        with open(path, "rb") as f:
            head = f.read(8)
            if path.suffix != ".safetensors":  # a torch.save zip: a truncated one lost its central directory
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
    lm: Any = cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model
    lm.base_model.compile()


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    return total, sum(p.numel() for p in trainable_parameters(model))


def parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(frozen, trainable) weight bytes, each parameter at its own dtype (tied weights counted once)."""
    frozen = trainable = 0
    for p in model.parameters():
        if p.requires_grad:
            trainable += p.numel() * p.element_size()
        else:
            frozen += p.numel() * p.element_size()
    return frozen, trainable


def adapter_input_features(model: torch.nn.Module) -> int:
    """Per token, the input features of every LoRA-adapted layer (the memory model's adapter activations)."""
    return sum(
        a.in_features
        for m in model.modules()
        if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)
        for a in cast(Any, m).lora_A.values()
    )


def memory_shape(model, cfg, device: torch.device) -> dict:
    """What the memory model's seed needs (MemoryModel.from_model_bytes): the weights' real bytes, the shape,
    and the activations' precision (bf16 under autocast, microbatch.autocast, or with bf16 frozen weights).
    Under autocast, fp32 frozen weights also get bf16 copies that backward keeps: the workspace."""
    c = model.config
    frozen, trainable = parameter_bytes(model)
    autocast = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
    bf16 = autocast or any(p.dtype == torch.bfloat16 for p in model.parameters())
    copies = sum(2 * p.numel() for p in model.parameters() if not p.requires_grad and p.dtype == torch.float32)
    return {
        "frozen_bytes": frozen,
        "trainable_bytes": trainable,
        "compute_bytes": 2 if bf16 else 4,
        "workspace_bytes": copies if autocast else 0,
        "hidden_size": c.n_embd if hasattr(c, "n_embd") else c.hidden_size,
        "n_layers": getattr(c, "n_layer", None) or c.num_hidden_layers,
        "n_heads": getattr(c, "n_head", None) or getattr(c, "num_attention_heads", None),
        "adapter_features": adapter_input_features(model),
        "gradient_checkpointing": bool(cfg.train.gradient_checkpointing),
    }
