"""Tiny Llama-, Qwen2-, GPT-2-, Phi- and Gemma-2-architecture checkpoints for tests, made on the spot (nothing is downloaded).

Each is a transformers config with random weights written with save_pretrained, and a byte-level BPE tokenizer
trained on the fly by the `tokenizers` library on a few standard-library sources, with the special tokens its
architecture uses and a chat template set:

    make_checkpoint(tmp_path / "llama", "llama")     -> the folder, ready for model=hf model.name_or_path=...

Llama: BOS <s> and EOS </s>, no pad token. Qwen2: no BOS, EOS <|im_end|>, pad <|endoftext|>. GPT-2: one
<|endoftext|> for BOS and EOS, no pad, learned positions (n_positions). Phi (as Phi-2): GPT-2's tokens, an
LM head with a bias (drawn non-zero: a fresh one is zero), dropout 0.1. Gemma-2: <bos>, <eos>, <pad>, final logit
soft-capping at 0.1 (Gemma-2 ships 30.0, about its logits' reach; a tiny model's logits are near 0.2), sliding-window attention.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from pathlib import Path

ARCHITECTURES = ("llama", "qwen2", "gpt2")

# ChatML, as Qwen2 and many others ship it: every turn <|im_start|>role\n...<|im_end|>\n
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama-2 style: [INST] user [/INST] assistant </s>, a system turn folded into the first user turn
LLAMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ '<<SYS>>' + m['content'] + "
    "'<</SYS>>' }}{% elif m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
)

SPECIAL = {
    "llama": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "qwen2": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "additional_special_tokens": ["<|im_start|>"]},
    "gpt2": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    "phi": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    "gemma2": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
}
TEMPLATE = {"llama": LLAMA_CHAT, "qwen2": CHATML, "gpt2": CHATML, "phi": CHATML, "gemma2": CHATML}


def _corpus() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text(encoding="utf-8") for name in ("json/decoder.py", "textwrap.py", "bisect.py")]


@functools.lru_cache(maxsize=None)
def _tokenizer_json(arch: str, vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = SPECIAL[arch]
    names = [specials[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in specials]
    names += specials.get("additional_special_tokens", [])
    names = list(dict.fromkeys(names))
    tok = Tokenizer(models.BPE(unk_token=specials.get("unk_token")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=names,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok.to_str()


def _model_config(arch: str, vocab_size: int, specials: dict):
    from transformers import Gemma2Config, GPT2Config, LlamaConfig, PhiConfig, Qwen2Config

    if arch == "llama":
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=specials["bos_token"],
            eos_token_id=specials["eos_token"],
        )
    if arch == "qwen2":
        return Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            eos_token_id=specials["eos_token"],
            pad_token_id=specials.get("pad_token"),
        )
    if arch == "phi":
        return PhiConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            resid_pdrop=0.1,
            bos_token_id=specials["bos_token"],
            eos_token_id=specials["eos_token"],
        )
    if arch == "gemma2":
        return Gemma2Config(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            final_logit_softcapping=0.1,
            bos_token_id=specials["bos_token"],
            eos_token_id=specials["eos_token"],
            pad_token_id=specials["pad_token"],
        )
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=512,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=specials["bos_token"],
        eos_token_id=specials["eos_token"],
    )


def make_checkpoint(
    folder: str | Path, arch: str = "llama", vocab_size: int = 512, seed: int = 0, chat_template: bool = True
) -> Path:
    """A tiny causal LM of architecture `arch` (llama | qwen2 | gpt2 | phi | gemma2) with its tokenizer, saved in
    `folder`."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's bars would land in the tests' stderr
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = SPECIAL[arch]
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(arch, vocab_size)), **specials)
    if chat_template:
        fast.chat_template = TEMPLATE[arch]
    ids = {k: fast.convert_tokens_to_ids(v) for k, v in specials.items() if isinstance(v, str)}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_model_config(arch, len(fast), ids))
    if arch == "phi":  # a trained head's bias is not zero
        torch.nn.init.normal_(model.lm_head.bias, std=1.0)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def chat_rows(n: int = 64) -> list[dict]:
    """Chat samples (OpenAI-style role/content lists) with a system turn and two exchanges, varied lengths."""
    rows = []
    for i in range(n):
        words = " ".join(f"word{j % 17}" for j in range(3 + (i * 7) % 23))
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": "You answer briefly."},
                    {"role": "user", "content": f"What is {i} plus {i % 5}? {words}"},
                    {"role": "assistant", "content": f"{i} plus {i % 5} is {i + i % 5}."},
                    {"role": "user", "content": "And doubled?"},
                    {"role": "assistant", "content": f"Doubled it is {2 * (i + i % 5)}."},
                ]
            }
        )
    return rows


def prompt_completion_rows(n: int = 64) -> list[dict]:
    rows = []
    for i in range(n):
        words = " ".join(f"item{j % 13}" for j in range(2 + (i * 5) % 19))
        rows.append(
            {
                "prompt": f"List the first {i % 7 + 1} items of: {words}\nAnswer:",
                "completion": " " + ", ".join(words.split()[: i % 7 + 1]) + ".",
            }
        )
    return rows
