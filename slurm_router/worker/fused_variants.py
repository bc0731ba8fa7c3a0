"""A fused task's variants (docs/design/fused.md, "Fused variants"): what each one owns inside the one process
group of its task (worker/fused.py), and the model they share.

Each variant keeps what its separate task would have: its task directory (events, adapters, result), its own
optimizer over its own LoRA weights, its own training seed (LoRA init, data order), learning rate, weight decay
and gradient clipping. What they share is the frozen base (one copy: train/fused_lora.py), the router, and the
checkpoint file (in the leader's checkpoints/, one entry per variant)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from omegaconf import OmegaConf

from slurm_router.rundir import events as ev
from slurm_router.rundir.layout import TaskPaths
from slurm_router.rundir.spec import TaskSpec
from slurm_router.train.data import GlobalBatchSampler
from slurm_router.train.fused_lora import (
    FusedModel,
    Member,
    fuse_parts,
    fused_loss,
    fused_packed_batch,
    lora_weights,
    save_adapter,
    why_not_fusable,
)
from slurm_router.train.model import build_model
from slurm_router.train.optim import lr_at, make_optimizer
from slurm_router.worker.microbatch import MicroBatchRunner, autocast


class MemberAdapter:
    """A fused variant as artifacts.adapters.AdapterSaver sees a peft model: its peft_config and save_pretrained,
    which writes the variant's adapter alone in peft's format (fused_lora.save_adapter)."""

    def __init__(self, member: Member):
        self.member = member
        self.peft_config = {"default": member.peft_config}

    def save_pretrained(self, folder) -> None:
        save_adapter(self.member, folder)


@dataclass
class Variant:
    """One variant of a fused task: k is its index in the FusedModel (0 = the leader)."""

    k: int
    spec: TaskSpec
    cfg: Any
    member: Member
    optimizer: torch.optim.Optimizer
    sampler: GlobalBatchSampler
    events: ev.EventWriter | None = None
    train_losses: list[float] = field(default_factory=list)
    ended: dict | None = None  # its result, once it left the group (completed, pruned, diverged)
    last_eval: tuple[list[float], list[int]] = ([], [])
    last_metrics: dict = field(default_factory=dict)  # its eval.metrics' scores at the last evaluation
    _adapters: Any = None

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.member.params

    def named_params(self) -> dict[str, torch.nn.Parameter]:
        out = {}
        for path, (a, b) in sorted(self.member.layers.items()):
            out[f"{path}.lora_A"], out[f"{path}.lora_B"] = a, b
        return out

    def lr(self, step: int) -> float:
        return lr_at(step, self.spec.steps, self.spec.lr, self.cfg.train.warmup_steps)

    def set_lr(self, step: int) -> float:
        lr = self.lr(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def learn(self) -> None:
        """Its own clipping (the norm over its own weights only) and optimizer step."""
        if self.cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def adapters(self, tokenizer):
        """Rank 0: what saves its adapter/ and adapter-best/ (artifacts.adapters.AdapterSaver), made on first use."""
        if self._adapters is None:
            from slurm_router.artifacts.adapters import AdapterSaver

            self._adapters = AdapterSaver(self.spec, self.cfg, tokenizer)
        return self._adapters

    def write_result(self, result: dict) -> None:
        """Rank 0: its result.json, as the job writes a task's (supervisor.worker_entry)."""
        import json

        from slurm_router.fileio import atomic_write_text

        atomic_write_text(TaskPaths(self.spec.task_dir).result, json.dumps(result, indent=1))


def build_fused(specs: list[TaskSpec], vocab_size: int, seed: int, device: torch.device, checkpointing: bool):
    """Each variant built as its separate task builds it (same base, its own LoRA seed and settings), one at a time:
    only its LoRA weights are kept, so at most two bases are in memory at once, and one after. (FusedModel, cfgs)."""
    cfgs = [OmegaConf.create(s.config) for s in specs]
    first, weights, configs = None, [], []
    for spec, cfg in zip(specs, cfgs):
        model = build_model(
            cfg.model,
            vocab_size,
            seed,
            spec.base_weights,
            lora=True,
            device=device,
            gradient_checkpointing=checkpointing,
            lora_seed=spec.seed,
        )
        reason = why_not_fusable(model)
        if reason:
            raise RuntimeError(f"{spec.name} cannot be fused: {reason}")
        weights.append({p: (a.detach().clone(), b.detach().clone(), s) for p, (a, b, s) in lora_weights(model).items()})
        configs.append(cast(Any, model).peft_config["default"])
        if first is None:
            first = model
        del model
    assert first is not None, "a fused task has at least one variant"
    fused: FusedModel = fuse_parts(first, weights, configs)
    return fused, cfgs


def make_variants(fused: FusedModel, specs: list[TaskSpec], cfgs: list, n_train: int, device) -> list[Variant]:
    return [
        Variant(
            k,
            spec,
            cfg,
            member,
            make_optimizer(member.params, spec.lr, cfg.train.weight_decay, device),
            GlobalBatchSampler(n_train, spec.global_batch_size, cast(int, spec.seed)),
        )
        for k, (spec, cfg, member) in enumerate(zip(specs, cfgs, fused.members))
    ]


class FusedMicroBatches(MicroBatchRunner):
    """The micro-batch runner over keyed samples (k * N + id). A micro-batch is one fused packed row of its
    variants' samples (layout "row"), or one row per variant through the shared model ("per_variant"); either
    way its gradients are added only once every row's exist (all or nothing, as microbatch.accumulate)."""

    fused: FusedModel
    per_variant: bool
    divide_by: list[float]  # each variant's global target count this step
    variant_sums: torch.Tensor  # (K,) this device's token-loss sums this step, read after the step's sync

    def key(self, key: int) -> tuple[int, int]:
        return divmod(key, len(self.split.lengths))

    def length(self, sample_id: int) -> int:
        return int(self.split.lengths[self.key(sample_id)[1]])

    def _build(self, keys):
        per_variant: list[list[int]] = [[] for _ in self.fused.members]
        for key in keys:
            k, i = self.key(key)
            per_variant[k].append(i)
        if not self.per_variant:
            return [fused_packed_batch(self.split, per_variant, self.device)]
        alone = [[ids if j == k else [] for j in range(len(per_variant))] for k, ids in enumerate(per_variant) if ids]
        return [fused_packed_batch(self.split, rows, self.device) for rows in alone]

    def forward_backward(self, batches) -> tuple[torch.Tensor, int]:
        """Every row's forward and backward, then their gradients added in row order (all or nothing)."""
        done = [self._row(batch) for batch in batches]
        sums = torch.stack([row_sums for _, row_sums in done]).sum(0)
        for row_grads, _ in done:
            for p, g in zip(self.params, row_grads):
                if g is not None:
                    p.grad = torch.empty_like(p).copy_(g) if p.grad is None else p.grad.add_(g)
        self.variant_sums += sums
        return sums.sum(), sum(sum(b.n_targets) for b in batches)

    def _row(self, batch) -> tuple[tuple, torch.Tensor]:
        """One row's gradients of the trainable weights (None where unused) and its per-variant loss sums."""
        with autocast(self.cfg, self.device):
            total, row_sums = fused_loss(self.fused, batch, self.divide_by, as_tensor=True)
        return torch.autograd.grad(total, self.params, allow_unused=True), row_sums.detach()


# ---- the group's checkpoint -------------------------------------------------------------------------------------
def variant_state(v: Variant) -> dict:
    return {
        "model": {n: p.detach().cpu().clone() for n, p in v.named_params().items()},
        "optimizer": v.optimizer.state_dict(),
        "train_losses": list(v.train_losses),
        "ended": v.ended,
    }


def restore_variant(v: Variant, state: dict, device: torch.device) -> None:
    params = v.named_params()
    missing = sorted(set(params) - set(state["model"]))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} of {v.spec.name}'s LoRA tensors (e.g. {missing[0]})")
    with torch.no_grad():
        for name, value in state["model"].items():
            params[name].copy_(value.to(device))
    v.optimizer.load_state_dict(state["optimizer"])
    v.train_losses, v.ended = list(state["train_losses"]), state.get("ended")
