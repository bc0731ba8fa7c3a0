"""resources.fuse_variants=K: the variants stage's tasks grouped into fused tasks of up to K (issue 28).

A fused task trains its variants over one shared frozen base in one process (the worker's member group; the math in
train/fused_lora.py), so its tasks must agree on everything but what each variant owns: its adapter (model.lora.*),
its optimizer and schedule (train.lr, weight_decay, grad_clip, warmup_steps), its batch (train.global_batch_size)
and its training seed. Tasks are grouped in the local queue's order (plan.queue_order: seed by seed across
variants), each joining the first open group it agrees with; the group's first task is its leader (variant 0),
the one that runs, and the others are its members (fused_into the leader), each keeping its own tasks/<name>/.
A task that cannot join (DoRA, LoRA dropout, a kept base dropout, no LoRA, a setting no group shares) runs alone, said in one line.
The base stage is never fused (make_plan calls this for the variants stage only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from slurm_router.config import model_families
from slurm_router.rundir.spec import TaskSpec
from slurm_router.train import base_dropout

# what the tasks of one fused task may set apart (besides the training seed, TaskSpec.seed)
MAY_DIFFER = ("train.lr", "train.weight_decay", "train.grad_clip", "train.warmup_steps", "train.global_batch_size")
MAY_DIFFER_UNDER = "model.lora."
SHOWN = "model.lora.*, " + ", ".join(MAY_DIFFER) + " and the training seed"


def not_fusable(config: dict) -> str | None:
    """Why a task with this resolved config can never share a fused task ('KEY=VALUE: why'), or None."""
    lora = (config.get("model") or {}).get("lora") or {}
    if not lora.get("enabled", True):
        return "model.lora.enabled=false: full fine-tuning has no adapter over a shared frozen base"
    if lora.get("use_dora"):
        return "model.lora.use_dora=true: DoRA is not fused"
    if float(lora.get("dropout") or 0.0) > 0:
        return (
            f"model.lora.dropout={lora['dropout']}: LoRA dropout would draw every variant's masks from one random "
            "stream (set model.lora.dropout=0 to fuse it)"
        )
    kept = base_dropout.why_not_fused(config.get("model") or {})
    if kept:
        return kept
    train = config.get("train") or {}  # what the fused worker does not do, never ignored
    if str(train.get("packing", "auto")).lower() == "false":
        return "train.packing=false: a fused task trains packed rows (set train.packing=auto to fuse it)"
    if train.get("compile"):
        return "train.compile=true: the fused model is not compiled (drop train.compile to fuse it)"
    if int(train.get("loss_chunk_tokens") or 0) > 0:
        return (
            f"train.loss_chunk_tokens={train['loss_chunk_tokens']}: the fused loss takes every variant's logits "
            "at once (drop it to fuse)"
        )
    return not_packable(config.get("model") or {})


def not_packable(model: dict) -> str | None:
    """A model=hf checkpoint that cannot take packed rows (sliding windows, capped attention scores: as the worker's
    train/packed.py why_not_packable finds on its meta-device build), which a fused task must train."""
    found = model_families.named(model.get("kind"))
    if found is None or found.packs_rows:  # a family that takes packed rows for sure (model=gpt2), or none
        return None
    from slurm_router.train.model import meta_model
    from slurm_router.train.packed import why_not_packable

    path = str(model.get("name_or_path"))
    reason = why_not_packable(meta_model(os.path.expanduser(path), path))
    return f"model.name_or_path={path}: {reason}; a fused task trains packed rows" if reason else None


def flat(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (model.lora.r); an empty mapping is a leaf."""
    out: dict[str, Any] = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def shared_settings(config: dict) -> dict[str, Any]:
    """The flattened config keys every task of one fused task must hold equal."""
    return {k: v for k, v in flat(config).items() if k not in MAY_DIFFER and not k.startswith(MAY_DIFFER_UNDER)}


def shown(value: Any) -> str:
    """A config value as a command line writes it (true, [c_attn,c_proj], (unset))."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(shown, value)) + "]"
    return "(unset)" if value is _UNSET else str(value)


_UNSET = object()


def difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first shared setting (in key order) on which two tasks differ, or None."""
    for key in sorted(a.keys() | b.keys()):
        if a.get(key, _UNSET) != b.get(key, _UNSET):
            return key
    return None


@dataclass
class Fusion:
    """A variants stage's tasks after grouping: what runs, what is fused into it, and why any task runs alone."""

    runs: list[TaskSpec]  # leaders and tasks alone, in queue order, indexed 0..N-1 (the Slurm array)
    fused: list[TaskSpec]  # every other task of a group: fused_into its leader, never run itself
    notes: list[str] = field(default_factory=list)  # one line per variant that cannot join, naming the key

    def summary(self, k: int, typed: Any = None) -> str:
        """'resources.fuse_variants=2: 4 variant task(s) run as 2 task(s): 4 fused into 2 (one base in memory
        each), 0 alone' (a line of the command's first ones); typed: the value the user gave, when it is not K
        (auto: 'resources.fuse_variants=auto (K=2): ...')."""
        leaders = [t for t in self.runs if t.members]
        n_fused = len(leaders) + len(self.fused)
        setting = f"resources.fuse_variants={k}" if typed in (None, k) else f"resources.fuse_variants={typed} (K={k})"
        if not leaders:
            return f"{setting}: none of the {len(self.runs)} variant task(s) can be fused: each runs alone"
        return (
            f"{setting}: {len(self.runs) + len(self.fused)} variant task(s) run as "
            f"{len(self.runs)} task(s): {n_fused} fused into {len(leaders)} (one base in memory each), "
            f"{len(self.runs) - len(leaders)} alone"
        )


def fuse_tasks(order: list[TaskSpec], k: int) -> Fusion:
    """Group the variants stage's tasks, in the queue's order (plan.queue_order), into fused tasks of up to k.
    What runs keeps that order (a Slurm array, and its %P throttle, start the lower indexes first), indexed
    0..N-1; a member takes its leader's index (the array task it runs in). Sets the leaders' members and the
    members' fused_into."""
    groups: list[list[TaskSpec]] = []
    keys: list[dict[str, Any] | None] = []  # each group's shared settings; None: a task that is never fused
    why: dict[str, str] = {}  # task name -> why it joined no group (said only if it ends alone)
    for t in order:
        reason = not_fusable(t.config)
        key = None if reason else shared_settings(t.config)
        at = next((i for i, g in enumerate(groups) if key is not None and keys[i] == key and len(g) < k), None)
        if at is not None:
            groups[at].append(t)
            continue
        fusable = [(g[0], kk) for g, kk in zip(groups, keys) if kk is not None]
        if key is not None and fusable and all(kk != key for _, kk in fusable):  # no group agrees, full or not
            first, theirs = fusable[0]
            differs = difference(key, theirs)
            if differs:
                mine, other = shown(key.get(differs, _UNSET)), shown(theirs.get(differs, _UNSET))
                reason = f"{differs}={mine} ({first.variant} has {other}); only {SHOWN} may differ within a fused task"
        if reason:
            why[t.name] = reason
        groups.append([t])
        keys.append(key)
    leader_of = {t.name: g[0] for g in groups for t in g}
    for g in groups:
        g[0].members, g[0].fused_into = [t.name for t in g[1:]], None
        for t in g[1:]:
            t.members, t.fused_into = [], g[0].name
    runs = [t for t in order if t.fused_into is None]
    for i, t in enumerate(runs):
        t.index = i
    fused = [t for t in order if t.fused_into is not None]
    for t in fused:
        t.index = leader_of[t.name].index
    notes: list[str] = []
    for t in order:  # one line per variant and reason, for the tasks that run alone
        line = f"resources.fuse_variants: variant {t.variant} runs unfused: {why.get(t.name)}"
        if t.name in why and not t.members and t.fused_into is None and line not in notes:
            notes.append(line)
    return Fusion(runs, fused, notes)
