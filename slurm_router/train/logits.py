"""The model's own vocabulary logits from its last hidden states, for the chunked loss (train.loss_chunk_tokens).

The chunked loss cannot call the causal LM's forward (that would build every token's logits at once); it runs the
base model, then this: the LM head as a module (its weight, its bias as Phi and GPT-J have, a LoRA layer on it),
then the logit post-processing transformers applies in that forward. Which post-processing is read from the
forward's source, between its last hidden state and its loss, and each step must be one this module reproduces:
Gemma-2/3's final soft-capping (config.final_logit_softcapping), Cohere's logit_scale, Granite's
config.logits_scaling. Any other statement there (Falcon-H1's lm_head_multiplier, MiniCPM3 scaling the hidden
states first, a model type transformers adds next year) makes the model one the chunked loss refuses (why_not),
so a chunked run never trains on logits the model would not compute.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import textwrap
from collections.abc import Callable
from typing import Any

import torch

from slurm_router.errors import UserError

Step = Callable[[Any, torch.Tensor], torch.Tensor]  # (the causal LM, logits) -> logits


def _softcap(lm: Any, logits: torch.Tensor) -> torch.Tensor:
    cap = lm.config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


# each known statement block after the LM head, as transformers writes it (comments stripped), and what it does
KNOWN: tuple[tuple[tuple[str, ...], Step], ...] = (
    (
        (
            "if self.config.final_logit_softcapping is not None:",
            "logits = logits / self.config.final_logit_softcapping",
            "logits = torch.tanh(logits)",
            "logits = logits * self.config.final_logit_softcapping",
        ),
        _softcap,
    ),
    (("logits = logits * self.logit_scale",), lambda lm, x: x * lm.logit_scale),
    (("logits = logits / self.config.logits_scaling",), lambda lm, x: x / lm.config.logits_scaling),
    (("logits = logits.float()",), lambda lm, x: x),  # the loss takes fp32 logits anyway
)
# the LM head's own line, and what may come between the last hidden state and it (which positions get logits)
HEAD = re.compile(
    r"(lm_)?logits = self\.lm_head\(hidden_states(\[:, slice_indices, :\])?\)(\.float\(\)|\.contiguous\(\))?"
)
BEFORE_HEAD = re.compile(
    r"slice_indices = .*|hidden_states = slice_logits_to_keep\(hidden_states, logits_to_keep\)"
    r"|if hidden_states\.shape\[1\] == \(input_ids if input_ids is not None else inputs_embeds\)\.shape\[1\]:"
)
_OUT = r"(outputs|transformer_outputs)(\.last_hidden_state|\[0\])"
HIDDEN = re.compile(rf"hidden_states = ({_OUT}|slice_logits_to_keep\({_OUT}, logits_to_keep\))")
END = re.compile(r"(loss = None|if labels is not None|return\b)")


def _recipe(forward_source: str) -> tuple[tuple[Step, ...], str | None]:
    """(the post-processing steps, None) or ((), the statement the chunked loss cannot reproduce)."""
    lines = [re.sub(r"\s+#.*$", "", s.strip()) for s in textwrap.dedent(forward_source).splitlines()]
    lines = [s for s in lines if s and not s.startswith("#")]
    at = next((i for i, s in enumerate(lines) if "lm_head(" in s), None)
    if at is None:
        return (), "its forward calls no lm_head"
    if not HEAD.fullmatch(lines[at]):
        return (), lines[at]
    start = max((i for i in range(at) if HIDDEN.fullmatch(lines[i])), default=None)
    if start is None:
        return (), "its forward takes its last hidden state in a way this toolkit does not know"
    odd = next((s for s in lines[start + 1 : at] if not BEFORE_HEAD.fullmatch(s)), None)
    if odd is not None:
        return (), odd
    after = lines[at + 1 :]
    after = after[: next((i for i, s in enumerate(after) if END.match(s)), len(after))]
    steps: list[Step] = []
    while after:
        match = next(((block, step) for block, step in KNOWN if tuple(after[: len(block)]) == block), None)
        if match is None:
            return (), after[0]
        steps.append(match[1])
        after = after[len(match[0]) :]
    return tuple(steps), None


@functools.lru_cache(maxsize=None)
def _class_parts(cls: Any) -> tuple[tuple[Step, ...], str | None]:
    """_recipe of a model class's forward, once per class: reading the source costs more than a chunk's loss."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return (), "its forward's source cannot be read"
    return _recipe(source)


def _parts(lm: Any) -> tuple[tuple[Step, ...], str | None]:
    cls: Any = type(lm)
    return _class_parts(cls)


def why_not(lm: Any) -> str | None:
    """None when chunked_logits computes exactly the logits `lm` (a transformers causal LM) computes, else the
    statement of its forward that it cannot reproduce."""
    return _parts(lm)[1]


def chunked_logits(lm: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The logits `lm` computes from these last hidden states (any leading shape): its LM head module, then its
    post-processing. Raises for a model why_not refuses (the submission refused it first)."""
    steps, reason = _parts(lm)
    if reason is not None:
        raise RuntimeError(f"train.loss_chunk_tokens: {type(lm).__name__}: cannot reproduce {reason!r}")
    logits = lm.get_output_embeddings()(hidden)
    for step in steps:
        logits = step(lm, logits)
    return logits


def check_chunked_loss(cfg: Any, where: str = "") -> None:
    """model=hf with train.loss_chunk_tokens, before anything is written: UserError naming the key and the model
    type when the chunked loss cannot compute the logits the checkpoint's model computes (its meta-device build)."""
    from slurm_router.train.model import meta_model

    lm: Any = meta_model(os.path.expanduser(cfg.model.name_or_path), cfg.model.name_or_path)
    reason = why_not(lm)
    if reason is not None:
        raise UserError(
            f"{where}train.loss_chunk_tokens={cfg.train.loss_chunk_tokens}: the chunked loss cannot reproduce how a "
            f"{lm.config.model_type} model ({type(lm).__name__}) computes its logits ({reason}): drop "
            "train.loss_chunk_tokens (the plain loss is exact)"
        )
