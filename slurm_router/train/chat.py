"""A conversation -> tokens and target mask, with the tokenizer's own chat template (docs/design/model.md, "Target
masks"). Only assistant turns are targets: their content and the template's end-of-turn token after it.

Templates need no {% generation %} markers: the conversation is rendered up to each assistant turn with
add_generation_prompt=True (where the turn's text starts) and up to the end of that turn (where it ends); both
must be prefixes of the whole rendering (a template that renders earlier turns differently once later ones
follow is not prefix-consistent, and is refused in one line). The whole rendering is tokenized once with
character offsets, and a token is a target when its characters overlap an assistant span. Whitespace the
template writes after a turn's end token (ChatML's '\\n') belongs to the template, not to the answer.
A template that knows no role of a turn may leave the turn out instead of failing (a Llama-2 template renders
no tool turn): every message's content must be in the rendering, or the row is refused.
"""

from __future__ import annotations

import numpy as np

# tool: a tool's output, an input the model reads like a user turn (never a target)
ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
    """This conversation cannot be rendered or located in its rendering (the caller names the row)."""


def _render(tok, messages: list[dict], generation_prompt: bool = False) -> str:
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # the template's own raise_exception(...) or a jinja error
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ChatError(f"the chat template fails on it ({first})") from None


def _check_rendered(text: str, messages: list[dict]) -> None:
    # templates may trim a turn's content ({{ m['content'] | trim }}), so its stripped text is what must appear
    for i, m in enumerate(messages, 1):
        content = m["content"].strip()
        if content and content not in text:
            raise ChatError(
                f"message {i} ({m['role']}): the chat template leaves this turn out of the rendering (it does "
                f"not render the role {m['role']!r}), so the model would never read it: give it as a role the "
                "template renders (a tool's output as a user turn), or use a checkpoint whose template has it"
            )


def assistant_spans(tok, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendering and the character spans [start, end) of its assistant turns."""
    text, spans = _render(tok, messages), []
    _check_rendered(text, messages)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        through = _render(tok, messages[: k + 1])
        if k:
            before = _render(tok, messages[:k], generation_prompt=True)
            start, consistent = len(before), through.startswith(before)
        else:  # an opening assistant turn: nothing to render before it; its content
            start = through.rfind(m["content"])
            consistent = start >= 0
        if not (consistent and text.startswith(through)):
            raise ChatError(
                f"the chat template is not prefix-consistent (the conversation rendered up to "
                f"assistant turn {k + 1} is not the start of the whole rendering), so its assistant "
                "turns cannot be located"
            )
        end = start + len(through[start:].rstrip())
        if end > start:
            spans.append((start, end))
    return text, spans


def chat_tokens(tok, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, is-target mask) of one conversation rendered with tok's chat template."""
    text, spans = assistant_spans(tok, messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return ids, mask
