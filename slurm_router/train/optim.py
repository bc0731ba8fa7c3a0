"""Optimizer and learning-rate schedule (linear warm-up, cosine decay to 10%)."""

from __future__ import annotations

import math

import torch


def make_optimizer(params, lr: float, weight_decay: float, device: torch.device) -> torch.optim.Optimizer:
    # fused AdamW on GPU (one kernel for all parameters); the default foreach path on CPU.
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=device.type == "cuda")


def lr_at(step: int, total_steps: int, peak_lr: float, warmup_steps: int) -> float:
    if warmup_steps and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
