"""Token-summed next-token loss, optionally without ever materialising the full fp32 logits.

A GPT-2-small step at 16 x 512 tokens with a 50k vocabulary holds 8k x 50k logits: 1.6 GB in fp32 plus its
gradient, much of eager's time and memory. With `train.loss_chunk_tokens=N` the projection to the vocabulary
and the cross-entropy run N tokens at a time under activation checkpointing: each chunk's logits exist only
while that chunk is computed (forward, then again in backward), so peak memory holds one chunk, not all. The
projection is the model's own LM head and logit post-processing (train/logits.py: a bias, soft-capping, a scale).
The sum is the same as the plain loss up to float reduction order.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from slurm_router.train.logits import chunked_logits


def _lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM under a peft wrapper (LoRA layers are inside it either way)."""
    return cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model


def _chunk_loss(lm: Any, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = chunked_logits(lm, hidden)  # the model's own head and post-processing (bias, soft-capping, scale)
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")


def token_loss_sum(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = 0,
    n_targets: int | None = None,
    target_index: torch.Tensor | None = None,
    model_kwargs: dict | None = None,
) -> tuple[torch.Tensor, int]:
    """(sum of next-token losses over real targets, number of real targets). labels are -100 at every token
    that is not a target: padding, and for masked data the prompt or the non-assistant turns.

    Samples are right-padded, so under causal attention no real token ever attends to a pad: no attention
    mask is passed, which keeps SDPA on its fused causal path (an explicit mask forces a slower kernel).
    n_targets and target_index (flat positions of the real targets, for the chunked loss) come from the host
    when the caller knows them (target_positions): found on the GPU they would make the host wait for it.
    model_kwargs go to the model's forward (a packed row's position_ids and sample spans: train/packed.py). No KV
    cache: training never reads one, and building it costs a copy of every layer's keys and values per step."""
    extra = model_kwargs or {}
    # targets[t] = labels[t + 1]: shifting the labels, not the logits, avoids copying the logits
    targets = F.pad(labels[:, 1:], (0, 1), value=-100).reshape(-1)
    if n_targets is None:
        n_targets = int((targets != -100).sum())
    if chunk_tokens <= 0:
        logits = model(input_ids=inputs, use_cache=False, **extra).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets, ignore_index=-100, reduction="sum")
        return loss, n_targets
    lm: Any = _lm(model)
    hidden = lm.base_model(input_ids=inputs, use_cache=False, **extra).last_hidden_state
    if target_index is None:  # padding positions never reach the vocabulary projection
        target_index = (targets != -100).nonzero().squeeze(1)
    hidden = hidden.reshape(-1, hidden.size(-1)).index_select(0, target_index)
    flat_targets = targets.index_select(0, target_index)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.size(0), chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(_chunk_loss, lm, hidden[start:end], flat_targets[start:end], use_reentrant=False)
    return total, n_targets


def target_positions(lengths: list[int], width: int, masks: list[np.ndarray] | None = None) -> tuple[int, torch.Tensor]:
    """(number of real targets, their flat positions) in a right-padded batch of these sample lengths. The loss
    of row r at position t predicts token t + 1. Without masks every token but the first is a target (plain
    text); masks[r][j] says whether token j of row r is (data.Split.target_mask: completions, assistant turns)."""
    if masks is not None:
        is_target = np.zeros((len(lengths), width + 1), dtype=bool)
        for r, m in enumerate(masks):
            is_target[r, : len(m)] = m
        index = np.flatnonzero(is_target[:, 1:])  # token j is a target -> position j - 1 predicts it
        return len(index), torch.from_numpy(index.astype(np.int64))
    per_row = np.maximum(np.asarray(lengths, dtype=np.int64) - 1, 0)  # targets t = 0 .. n-2 of each row
    offsets = np.arange(int(per_row.sum()), dtype=np.int64) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    index = np.repeat(np.arange(len(per_row), dtype=np.int64) * width, per_row) + offsets
    return int(per_row.sum()), torch.from_numpy(index)
