"""The members a task trains (docs/design/fused.md, "The fused worker"): a plain task trains one member, its whole
model; a fused task trains K, LoRA variants over one shared frozen base (resources.fuse_variants=K).

Each member keeps what its separate task would have: its task directory (events, adapters, result), its own
optimizer over its own weights, its own training seed (LoRA init, data order), learning-rate schedule, weight
decay and gradient clipping. What the members of a group share is the model's frozen part, the router, the
process group and one checkpoint file (in the leader's checkpoints/).

The group is what the worker's one loop iterates over: each step every member still in it draws its own global
batch, learns from its own gradients and writes its own rows; a member leaves the group when it diverges or is
pruned, and the task ends when the last one does.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from omegaconf import OmegaConf

from slurm_router.rundir import events as ev
from slurm_router.rundir.layout import TaskPaths
from slurm_router.rundir.spec import TaskSpec
from slurm_router.train import fused_lora
from slurm_router.train.data import GlobalBatchSampler
from slurm_router.train.model import build_model, compile_backbone, count_parameters, trainable_parameters
from slurm_router.train.optim import lr_at, make_optimizer
from slurm_router.train.packed import choose_packing


class MemberAdapter:
    """A fused member as the adapter saver sees a peft model: its peft_config and save_pretrained, which writes
    the member's adapter alone in peft's format (fused_lora.save_adapter)."""

    def __init__(self, member: fused_lora.Member):
        self.member = member
        self.peft_config = {"default": member.peft_config}

    def save_pretrained(self, folder) -> None:
        fused_lora.save_adapter(self.member, folder)


@dataclass
class Member:
    """One member of a task's group: k is its index in the group (0 = the task itself, the leader)."""

    k: int
    spec: TaskSpec
    cfg: Any
    named: dict[str, torch.nn.Parameter]  # its trainable weights by name: what its checkpoint entry holds
    optimizer: torch.optim.Optimizer
    sampler: GlobalBatchSampler
    adapter_model: Any  # what its adapters are saved from (a peft model, or a MemberAdapter)
    n_trainable: int
    events: ev.EventWriter | None = None  # this rank's events file in its task directory
    train_losses: list[float] = field(default_factory=list)
    ended: dict | None = None  # its result, once it left the group (completed, pruned, diverged, not_needed)
    last_eval: tuple[list[float], list[int]] = ([], [])  # the latest evaluation's per-batch loss sums and tokens
    last_metrics: dict = field(default_factory=dict)  # its eval.metrics' scores at the latest evaluation
    last_val: float = float("nan")  # its held-out loss at the latest evaluation
    _adapters: Any = None

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.named.values())

    @property
    def writer(self) -> ev.EventWriter:
        return cast(ev.EventWriter, self.events)

    # ---- the learning-rate schedule and the optimizer step: the member's own ----------------------------
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

    # ---- its checkpoint entry -----------------------------------------------------------------------------
    def state(self) -> dict:
        """Its trainable weights (never the frozen base: that comes from the base cache again), optimizer, losses
        and end."""
        return {
            "model": {n: p.detach().cpu().clone() for n, p in self.named.items()},
            "optimizer": self.optimizer.state_dict(),
            "train_losses": list(self.train_losses),
            "ended": self.ended,
        }

    def restore(self, state: dict, device: torch.device, what: str) -> None:
        missing = [n for n in self.named if n not in state["model"]]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} {what} (e.g. {missing[0]})")
        with torch.no_grad():
            for name, value in state["model"].items():
                self.named[name].copy_(value.to(device))
        self.optimizer.load_state_dict(state["optimizer"])
        self.train_losses, self.ended = list(state["train_losses"]), state.get("ended")

    # ---- what it leaves behind ----------------------------------------------------------------------------
    def adapters(self, tokenizer):
        """Rank 0: what saves its adapter/ and adapter-best/ (the artifacts' AdapterSaver), made on first use."""
        if self._adapters is None:
            from slurm_router.artifacts.adapters import AdapterSaver

            self._adapters = AdapterSaver(self.spec, self.cfg, tokenizer)
        return self._adapters

    def write_result(self, result: dict) -> None:
        """Rank 0: its result.json, as the job writes a task's."""
        from slurm_router.fileio import atomic_write_text

        atomic_write_text(TaskPaths(self.spec.task_dir).result, json.dumps(result, indent=1))


@dataclass
class Group:
    """The model a task trains and its members. `fused` is the shared-base model of a fused task (None: one
    member, the whole model)."""

    model: torch.nn.Module
    members: list[Member]
    fused: fused_lora.FusedModel | None
    packed: bool  # the micro-batches are packed rows
    n_params: int
    identity: dict  # what a checkpoint must match to be this task's

    @property
    def alive(self) -> list[Member]:
        return [m for m in self.members if m.ended is None]

    @contextlib.contextmanager
    def alone(self, m: Member) -> Iterator[None]:
        """Member m's model alone (eval.metrics): a fused group's shared model with m's adapter only."""
        if self.fused is None:
            yield
            return
        self.fused.segments.only = m.k
        try:
            yield
        finally:
            self.fused.segments.only = None

    def checkpoint_payload(self) -> dict:
        """The members' part of the task's checkpoint: one member's at the top level, a fused group's by task name."""
        if self.fused is None:
            entry = self.members[0].state()
            del entry["ended"]  # a task alone is never saved after its end
            return entry
        return {"variants": {m.spec.name: m.state() for m in self.members}}

    def load_payload(self, state: dict, device: torch.device) -> None:
        if self.fused is None:
            self.members[0].restore({**state, "ended": None}, device, "trainable tensors")
            return
        for m in self.members:
            m.restore(state["variants"][m.spec.name], device, f"of {m.spec.name}'s LoRA tensors")


def build_group(spec: TaskSpec, cfg: Any, n_train: int, device: torch.device, announce: bool) -> Group:
    """A plain task's one member, or a fused task's K (spec.members names the others)."""
    if spec.members:
        return _fused_group(spec, cfg, n_train, device)
    # the base's init from the config's seed; the LoRA init and the data order from the task's training seed
    model = build_model(
        cfg.model,
        cfg.model.vocab_size,
        cfg.seed,
        spec.base_weights,
        lora=spec.lora,
        device=device,
        gradient_checkpointing=cfg.train.gradient_checkpointing,
        lora_seed=spec.seed,
    ).to(device)
    packed = choose_packing(model, cfg.train, announce)
    if cfg.train.compile:
        compile_backbone(model)
    params = trainable_parameters(model)
    n_params, n_trainable = count_parameters(model)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}  # the same weights, in the same order
    member = Member(
        0,
        spec,
        cfg,
        named,
        make_optimizer(params, spec.lr, cfg.train.weight_decay, device),
        GlobalBatchSampler(n_train, spec.global_batch_size, cast(int, spec.seed)),
        model,
        n_trainable,
    )
    identity = {"task": spec.name, "lora": spec.lora, "global_batch_size": spec.global_batch_size}
    return Group(model, [member], None, packed, n_params, identity)


def _fused_group(spec: TaskSpec, cfg: Any, n_train: int, device: torch.device) -> Group:
    specs = spec.group_specs()
    fused, cfgs = build_fused(specs, cfg.model.vocab_size, cfg.seed, device, cfg.train.gradient_checkpointing)
    model = fused.model.to(device)
    if not choose_packing(model, cfg.train, False):
        raise RuntimeError(
            f"{spec.name}: fused variants train packed rows, and this model cannot take them "
            "(train.packing): set resources.fuse_variants=1"
        )
    members = []
    for k, (s, c, lora) in enumerate(zip(specs, cfgs, fused.members)):
        named = {}
        for path, (a, b) in sorted(lora.layers.items()):
            named[f"{path}.lora_A"], named[f"{path}.lora_B"] = a, b
        members.append(
            Member(
                k,
                s,
                c,
                named,
                make_optimizer(lora.params, s.lr, c.train.weight_decay, device),
                GlobalBatchSampler(n_train, s.global_batch_size, cast(int, s.seed)),
                MemberAdapter(lora),
                sum(p.numel() for p in lora.params),
            )
        )
    n_params = sum(p.numel() for p in model.parameters())
    identity = {"task": spec.name, "members": [s.name for s in specs], "fused": True}
    return Group(model, members, fused, True, n_params, identity)


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
        reason = fused_lora.why_not_fusable(model)
        if reason:
            raise RuntimeError(f"{spec.name} cannot be fused: {reason}")
        lora = fused_lora.lora_weights(model)
        weights.append({p: (a.detach().clone(), b.detach().clone(), s) for p, (a, b, s) in lora.items()})
        configs.append(cast(Any, model).peft_config["default"])
        if first is None:
            first = model
        del model
    assert first is not None, "a fused task has at least one variant"
    fused: fused_lora.FusedModel = fused_lora.fuse_parts(first, weights, configs)
    return fused, cfgs
