"""Packed micro-batches: a device's samples laid end to end in one row, no padding (train.packing).

The linear layers, the embeddings and the loss see only real tokens. What keeps the samples apart:
- position_ids restart at 0 at every sample (absolute position embeddings and rotary ones alike);
- attention never crosses a sample boundary: an attention function registered through transformers'
  AttentionInterface (ATTENTION) runs causal SDPA once per sample over its span of the row. Samples of one
  length share one SDPA call. With no spans given (evaluation, padded batches) it is plain SDPA;
- no target crosses a boundary: the first token of every sample is never a target, so the row's last token
  of sample i never learns to predict sample i+1's first (a padded batch gets the same by its padding).
So a packed micro-batch computes the same token losses as the padded one, up to float reduction order
(tests/test_packed.py). docs/design/model.md, "Packed micro-batches".
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

ATTENTION = "slurm_router_packed"
SPANS = "packed_spans"  # the model kwarg that carries the row's sample spans down to the attention
# what transformers' attention layers pass that needs nothing here, set or not: the positions are in the rotary
# embeddings already, and training keeps no cache. Any other keyword must be unset (None or False; is_causal None or
# True): set, it changes the attention (a window, capped scores, sinks, a bias) and per-sample causal SDPA would not
HARMLESS = frozenset({"position_ids", "cache_position", "use_cache"})


def packed_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    packed_spans: tuple | None = None,
    **kwargs,
):
    """transformers' attention-function signature: query/key/value are (batch, heads, tokens, head_dim); returns
    (batch, tokens, heads, head_dim) and no weights. packed_spans: ((start, end), ...) of one packed row."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    refuse_unimplemented(module, attention_mask, packed_spans is not None, kwargs)
    if packed_spans is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    by_length: dict[int, list[int]] = defaultdict(list)
    for start, end in packed_spans:
        by_length[end - start].append(start)
    pieces: dict[int, torch.Tensor] = {}  # span start -> that sample's attention output
    for length, starts in by_length.items():
        causal = length > 1
        if len(starts) == 1:
            s = starts[0]
            pieces[s] = F.scaled_dot_product_attention(
                query[:, :, s : s + length],
                key[:, :, s : s + length],
                value[:, :, s : s + length],
                dropout_p=dropout,
                is_causal=causal,
                scale=scaling,
            )
            continue
        # samples of one length: one SDPA call over them stacked along the batch dimension
        q, k, v = (torch.cat([t[:, :, s : s + length] for s in starts]) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal, scale=scaling)
        pieces.update((s, o[i : i + 1]) for i, s in enumerate(starts))
    # the spans tile the row in order: one concatenation (no per-sample in-place copies for autograd to undo)
    out = torch.cat([pieces[start] for start, _ in packed_spans], dim=2)
    return out.transpose(1, 2).contiguous(), None


def refuse_unimplemented(module, attention_mask, packed: bool, kwargs: dict) -> None:
    """ValueError naming the first argument this function would otherwise drop: a keyword set that is not HARMLESS
    (sliding_window=4096, softcap=50.0, s_aux=the sinks, is_causal=False), or a mask (in a packed row the spans
    are the mask; without spans SDPA takes only a 4-D one: a 2-D mask would broadcast over the wrong dimensions)."""
    odd = next(
        (
            (name, value)
            for name, value in kwargs.items()
            if not (name in HARMLESS or value is None or value is (True if name == "is_causal" else False))
        ),
        None,
    )
    if odd is None and attention_mask is not None and (packed or attention_mask.dim() != 4):
        odd = ("attention_mask", f"a {attention_mask.dim()}-D mask")
    if odd is not None:
        name, value = odd
        shown = value if isinstance(value, (bool, int, float, str)) else type(value).__name__
        raise ValueError(
            f"{type(module).__name__} passes {name}={shown} to the packed attention, which does not implement it "
            "(per-sample causal SDPA): train this model with train.packing=false"
        )


def register() -> None:
    """Make ATTENTION known to transformers (idempotent); no mask function: the spans are the mask."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, packed_attention)


def why_not_packable(model: torch.nn.Module) -> str | None:
    """None when the model's attention goes through transformers' AttentionInterface (it can take packed rows),
    else the reason it cannot, for the one line that says the task trains padded."""
    lm: Any = cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(lm, "_supports_attention_backend", False):
        return f"{type(lm).__name__} does not route its attention through transformers' AttentionInterface"
    config = lm.config
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager", ATTENTION):
        return f"{type(lm).__name__} uses attn_implementation={config._attn_implementation!r}"
    # per-sample causal SDPA is full causal attention: a sliding window or logit soft-capping would be lost
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"{type(lm).__name__} uses sliding-window attention (sliding_window={config.sliding_window})"
    if getattr(config, "attn_logit_softcapping", None):
        return f"{type(lm).__name__} soft-caps its attention logits"
    return None


def enable(model: torch.nn.Module) -> None:
    """Route the model's attention through packed_attention (plain SDPA where no spans are given)."""
    register()
    lm: Any = cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model
    lm.set_attn_implementation(ATTENTION)


def choose_packing(model: torch.nn.Module, train_cfg, say: bool) -> bool:
    """train.packing for this task: auto is on unless train.compile (a row's length changes every step: it
    would recompile); on for a model that cannot take packed rows, it trains padded, with one line (say: rank 0)
    saying why. Packing on enables the attention function."""
    told = str(train_cfg.packing).lower()
    if told == "false" or (told == "auto" and train_cfg.compile):
        return False
    reason = why_not_packable(model)
    if reason is not None:
        if say:
            print(f"train.packing={told}: {reason}; this task trains padded micro-batches", flush=True)
        return False
    enable(model)
    return True


def packed_tensors(split, ids, device: torch.device):
    """(inputs (1, T), labels (1, T), number of targets, their flat positions, model kwargs) for one packed row
    of the samples `ids`, in the order given. labels are -100 at every non-target and at each sample's first
    token (so the shift never makes a sample's first token the target of the previous sample's last)."""
    seqs = [split.sample(i) for i in ids]
    lengths = [len(s) for s in seqs]
    bounds = np.cumsum([0, *lengths])
    inputs = np.concatenate(seqs).astype(np.int64)
    is_target = np.concatenate([split.target_mask(i) for i in ids]).astype(bool)
    is_target[bounds[:-1]] = False
    labels = np.where(is_target, inputs, -100)
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    index = np.flatnonzero(is_target[1:])  # position t predicts token t + 1
    tensors = [
        torch.from_numpy(inputs)[None],
        torch.from_numpy(labels)[None],
        torch.from_numpy(index),
        torch.from_numpy(positions)[None],
    ]
    if device.type == "cuda":  # pinned host memory: the copy overlaps with compute
        tensors = [t.pin_memory() for t in tensors]
    inputs_t, labels_t, index_t, positions_t = (t.to(device, non_blocking=True) for t in tensors)
    spans = tuple((int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]))
    return inputs_t, labels_t, len(index), index_t, {"position_ids": positions_t, SPANS: spans}
