"""Fused multi-LoRA: K LoRA variants of one frozen base in one forward and backward (docs/design/fused.md,
"Fused variants").

Each target layer of the base becomes a FusedLoraLayer: the base layer runs once over every token of every
variant, and variant k's low-rank update (x A_k^T) B_k^T * scaling_k is added to variant k's tokens only. A
variant's tokens are contiguous in the flattened batch (its rows of a padded batch, or its spans of a packed
row, laid out variant after variant: fused_packed_batch), so a loop over segments of slices is enough: no
gather, no scatter. The union of the variants' target layers is wrapped; a layer a variant does not adapt passes
that variant's tokens through the base alone.

Each variant is exactly as if alone:
- its LoRA weights start as peft initialised them when the variant was built alone with its own seed (fuse()
  takes them from peft models built that way, then drops all but one copy of the base);
- its loss is its own token losses over its own target count, so one backward of the sum of the variants'
  losses gives each variant the gradients of its separate run (nothing of the base is trained);
- its optimizer, learning rate, weight decay and gradient clipping (over its own weights only) are its own
  (Member.params is what they act on);
- it saves in peft's format (save_adapter): peft alone loads it onto the base.
LoRA dropout, or the base's own kept dropout (model.base_dropout=keep), would draw its masks from one stream for
all variants, so such a variant is not fused (why_not_fusable says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from slurm_router.train import base_dropout

PEFT_PREFIX = "base_model.model."  # peft's names: base_model.model.<the base's module path>


class Segments:
    """Which variant owns which tokens of the batch being computed: (variant, start, end) in the flattened
    (rows x width) token order, covering every token once, in order. Set before each forward."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int, int]] = []
        self.only: int | None = None  # every token is this variant's (eval.metrics: one variant's model alone)


class FusedLoraLayer(nn.Module):
    """One target layer of the base, shared by the variants that adapt it."""

    def __init__(self, base: nn.Module, segments: Segments):
        super().__init__()
        self.base, self.segments = base, segments
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        self.scaling: dict[int, float] = {}

    def add(self, k: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        self.lora_A[str(k)] = nn.Parameter(a.detach().clone())
        self.lora_B[str(k)] = nn.Parameter(b.detach().clone())
        self.scaling[k] = float(scaling)

    def _delta(self, k: int, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Variant k's low-rank update of x, as peft computes it (the input in the LoRA weights' dtype, the sum in
        the output's); None where k does not adapt this layer."""
        key = str(k)
        if key not in self.lora_A:
            return None
        a, b = self.lora_A[key], self.lora_B[key]
        return ((x.to(a.dtype) @ a.t()) @ b.t() * self.scaling[k]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.segments.only is not None:  # a metric function scores one variant through the shared model
            delta = self._delta(self.segments.only, x, out.dtype)
            return out if delta is None else out + delta
        n = out.shape[:-1].numel()
        whole = [(k, a, b) for k, a, b in self.segments.ranges if b > a]
        if len(whole) == 1 and whole[0][1:] == (0, n):  # one variant's tokens only (fused_layout=per_variant)
            delta = self._delta(whole[0][0], x, out.dtype)
            return out if delta is None else out + delta
        flat_x, flat_out = x.reshape(n, x.shape[-1]), out.reshape(n, out.shape[-1])
        pieces = []
        for k, start, end in self.segments.ranges:
            piece = flat_out[start:end]
            delta = self._delta(k, flat_x[start:end], piece.dtype)
            pieces.append(piece if delta is None else piece + delta)
        return torch.cat(pieces).view(out.shape)


@dataclass
class Member:
    """One variant of a fused model: its peft config (it saves adapter_config.json) and its LoRA weights by the
    base's module path (what its optimizer, clipping and adapter act on)."""

    peft_config: Any
    layers: dict[str, tuple[nn.Parameter, nn.Parameter]] = field(default_factory=dict)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for path in sorted(self.layers) for p in self.layers[path]]


@dataclass
class FusedModel:
    model: nn.Module  # the transformers causal LM, its target layers FusedLoraLayers
    segments: Segments
    members: list[Member]


def why_not_fusable(model: nn.Module) -> str | None:
    """None when a peft LoRA model can join a fused group, else why not (one line)."""
    config = getattr(model, "peft_config", {}).get("default")
    if config is None or type(config).__name__ != "LoraConfig":
        return "it is not a LoRA variant (full training keeps its own weights)"
    if getattr(config, "use_dora", False):
        return "DoRA's magnitude vectors rescale the whole layer output, not the variant's rows alone"
    if float(getattr(config, "lora_dropout", 0.0) or 0.0) > 0:
        return "LoRA dropout > 0 would draw its masks from one random stream for every variant"
    kept = base_dropout.active(model)
    if kept:  # model.base_dropout=keep (the plan ran such a variant alone: launch/fuse.py)
        return f"the base's dropout ({kept[0]}, ...) would draw its masks from one random stream for every variant"
    return None


def lora_weights(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """A peft LoRA model's adapter 'default': base module path -> (A (r, in), B (out, r), scaling)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            layer = cast(Any, module)
            path = name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name
            out[path] = (layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"])
    return out


def fuse(models: list[nn.Module]) -> FusedModel:
    """One base, K variants: `models` are the variants built alone (peft LoRA models over the same base weights,
    each with its own seed). The first one's base is kept; the others' are dropped once their LoRA weights are
    copied. ValueError (why) when a model cannot be fused."""
    for k, m in enumerate(models):
        reason = why_not_fusable(m)
        if reason:
            raise ValueError(f"variant {k} cannot be fused: {reason}")
    return fuse_parts(
        models[0], [lora_weights(m) for m in models], [cast(Any, m).peft_config["default"] for m in models]
    )


def fuse_parts(first: nn.Module, weights: list[dict], configs: list[Any]) -> FusedModel:
    """fuse() from the first variant's model and every variant's lora_weights and peft config: a caller that builds
    the variants one at a time keeps only one base in memory (the worker's fused group)."""
    base = cast(Any, first).unload()  # the transformers model, its LoRA layers removed (not merged)
    segments = Segments()
    layers: dict[str, FusedLoraLayer] = {}
    for path in sorted({p for w in weights for p in w}):
        parent_path, _, attr = path.rpartition(".")
        parent = base.get_submodule(parent_path) if parent_path else base
        layers[path] = FusedLoraLayer(getattr(parent, attr), segments)
        setattr(parent, attr, layers[path])
    members = []
    for k, (w, config) in enumerate(zip(weights, configs)):
        member = Member(config)
        for path, (a, b, scaling) in w.items():
            layers[path].add(k, a, b, scaling)
            member.layers[path] = (layers[path].lora_A[str(k)], layers[path].lora_B[str(k)])
        members.append(member)
    for p in base.parameters():  # the base is frozen; only the members' LoRA weights train
        p.requires_grad_(False)
    for member in members:
        for p in member.params:
            p.requires_grad_(True)
    return FusedModel(base, segments, members)


def save_adapter(member: Member, folder: str | Path) -> None:
    """The variant's adapter as peft saves it (adapter_config.json, adapter_model.safetensors): PeftModel.
    from_pretrained(base, folder) loads it alone."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    member.peft_config.save_pretrained(str(folder))
    state = {}
    for path, (a, b) in member.layers.items():
        state[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a.detach().cpu().contiguous()
        state[f"{PEFT_PREFIX}{path}.lora_B.weight"] = b.detach().cpu().contiguous()
    save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})


@dataclass
class FusedBatch:
    """One packed row of every variant's samples, variant after variant: the model's inputs and what the loss
    needs to give each variant its own."""

    inputs: torch.Tensor  # (1, T)
    targets: torch.Tensor  # (T,): the token each position predicts, -100 where none
    model_kwargs: dict  # position_ids and packed spans (train/packed.py)
    ranges: list[tuple[int, int, int]]  # (variant, start, end) token ranges: Segments.ranges
    variant_of: torch.Tensor  # (T,): the variant of each position
    n_targets: list[int]  # each variant's target tokens in this row
    n_tokens: list[int]  # each variant's tokens in this row


def fused_packed_batch(split, ids_per_variant: list[list[int]], device: torch.device) -> FusedBatch:
    """Variant k's samples ids_per_variant[k] (its own global batch), all in one packed row, variant after
    variant, so each variant's tokens are one contiguous range."""
    from slurm_router.train.packed import packed_tensors

    ids = [i for group in ids_per_variant for i in group]
    inputs, labels, _, _, kwargs = packed_tensors(split, ids, device)
    ranges, variant_of, n_tokens, start = [], [], [], 0
    for k, group in enumerate(ids_per_variant):
        n = int(sum(int(split.lengths[i]) for i in group))
        ranges.append((k, start, start + n))
        variant_of.append(np.full(n, k, dtype=np.int64))
        n_tokens.append(n)
        start += n
    targets = F.pad(labels[:, 1:], (0, 1), value=-100).reshape(-1)
    n_targets = [int((targets[a:b] != -100).sum()) for _, a, b in ranges]
    return FusedBatch(
        inputs,
        targets,
        kwargs,
        ranges,
        torch.from_numpy(np.concatenate(variant_of)).to(device),
        n_targets,
        n_tokens,
    )


def fused_loss(
    fused: FusedModel, batch: FusedBatch, divide_by: list[float], as_tensor: bool = False
) -> tuple[torch.Tensor, Any]:
    """(the sum over variants of each variant's token-loss sum over divide_by[k] (its global target count: what
    its separate run divides by), each variant's token-loss sum). One backward of the first gives every variant
    the gradients of its separate run. as_tensor: the sums as a (K,) tensor on the device (no host sync)."""
    fused.segments.ranges = batch.ranges
    logits = fused.model(input_ids=batch.inputs, use_cache=False, **batch.model_kwargs).logits
    per_token = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), batch.targets, ignore_index=-100, reduction="none"
    )
    k = len(batch.ranges)
    sums = torch.zeros(k, dtype=per_token.dtype, device=per_token.device).index_add(0, batch.variant_of, per_token)
    scale = torch.tensor([1.0 / max(1.0, d) for d in divide_by], dtype=sums.dtype, device=sums.device)
    return (sums * scale).sum(), sums if as_tensor else sums.detach().cpu().tolist()
