"""The tokenizers a corpus is cut with: the built-in byte tokenizer (model=gpt2 built from a config) or a local
transformers checkpoint's own (model=hf), behind one small interface (encode, start_id, pad_id, vocab_size)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from slurm_router.config.model_families import from_checkpoint
from slurm_router.config.schema import BYTE_VOCAB_SIZE
from slurm_router.errors import UserError
from slurm_router.train.chat import chat_tokens


class ByteTokenizer:
    """Bytes are tokens 0-255; 256 is end-of-text: it starts every sample, ends a prompt/completion one and pads
    (padding is never a target). It has no chat template: chat data needs model=hf."""

    vocab_size = BYTE_VOCAB_SIZE
    eot_id = 256
    pad_id = 256
    start_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        """Text of token ids (end-of-text and anything past the bytes left out)."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


# The files a transformers tokenizer is read from; a checkpoint with none of them has no tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


class HFTokenizer:
    """A local transformers tokenizer (model=hf). A checkpoint without one is named as such (not blamed on the
    data, which it would otherwise turn into no tokens)."""

    def __init__(self, path: str, setting: str = "model.name_or_path"):
        self.path, self.setting = path, setting
        fix = (
            f"save the tokenizer beside the weights (tokenizer.save_pretrained('{path}')) or copy its files "
            "from the model this checkpoint was trained from"
        )
        if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
            raise UserError(
                f"{setting}: the checkpoint {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): {fix}"
            )
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if not len(self.encode("Hello, world.")):
            raise UserError(
                f"{setting}: the tokenizer in {path} turns text into no tokens (its files are "
                f"incomplete: {', '.join(sorted(f.name for f in Path(path).iterdir()))}): {fix}"
            )
        self.vocab_size = len(self.tok)
        model_vocab = _config_value(Path(path) / "config.json", "vocab_size")
        if isinstance(model_vocab, int) and self.vocab_size > model_vocab:
            raise UserError(
                f"{setting}: the tokenizer in {path} has {self.vocab_size} tokens, more than the "
                f"model's vocab_size={model_vocab} (config.json): they come from different models; "
                f"{fix}"
            )
        self.eot_id = self.tok.eos_token_id if self.tok.eos_token_id is not None else 0
        # a sample starts with BOS (Llama), else with EOS as a separator (GPT-2, Qwen2); padding, never a
        # target, is the pad token or else EOS
        self.start_id = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.eot_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eot_id

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False), dtype=np.int32)

    def decode(self, ids) -> str:
        return str(self.tok.decode([int(i) for i in ids], skip_special_tokens=True))

    def check_chat(self) -> None:
        """Chat data is rendered with the tokenizer's chat template and located by character offsets."""
        if not self.tok.chat_template:
            raise UserError(
                f"{self.setting}: the tokenizer in {self.path} has no chat template, which "
                "data.messages_field needs: save one beside it (tokenizer.chat_template = TEMPLATE; "
                f"tokenizer.save_pretrained('{self.path}') writes chat_template.jinja), or give the data "
                "as data.prompt_field + data.completion_field"
            )
        if not self.tok.is_fast:
            raise UserError(
                f"{self.setting}: the tokenizer in {self.path} is a slow (Python) tokenizer without "
                "character offsets, which data.messages_field needs: save its fast version beside it "
                "(tokenizer.json)"
            )

    def chat(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, is-target mask): the assistant turns of the conversation rendered with the chat template."""
        return chat_tokens(self.tok, messages)


def _config_value(config: Path, key: str):
    try:
        return json.loads(config.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def make_tokenizer(model_cfg):
    if from_checkpoint(model_cfg):
        return HFTokenizer(os.path.expanduser(model_cfg.name_or_path), f"model.name_or_path={model_cfg.name_or_path!r}")
    return ByteTokenizer()
