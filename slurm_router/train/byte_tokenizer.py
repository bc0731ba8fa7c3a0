"""The byte tokenizer (data.ByteTokenizer: bytes 0-255 are ids 0-255, 256 is end-of-text) as a transformers
tokenizer, saved beside a model built from a config so that base + adapter load with transformers alone.

It is a `tokenizers` BPE whose vocabulary is the 256 byte-level symbols (GPT-2's byte-to-unicode map, in byte
order, so symbol i is id i) and no merges: every byte stays its own token. `split_special_tokens` keeps a
literal "<|endoftext|>" in a text as its bytes, as ByteTokenizer does; end-of-text (256) is the BOS, EOS and pad
token. tests/test_adapters_export.py proves it encodes like ByteTokenizer.
"""

from __future__ import annotations

EOT = "<|endoftext|>"


def byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode map, as the ByteLevel pre-tokenizer applies it: symbol of byte b at index b.
    Printable Latin-1 bytes stand for themselves; the others are shifted to code points 256 and up."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b if b in printable else next(shifted)) for b in range(256)]


def transformers_byte_tokenizer(max_len: int | None = None):
    """A PreTrainedTokenizerFast that encodes text exactly as ByteTokenizer does (ids 0-256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: b for b, s in enumerate(byte_symbols())}
    vocab[EOT] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # no regex split: the whole text is one word of byte symbols, and with no merges each is one token
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    extra = {"model_max_length": max_len} if max_len else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT, split_special_tokens=True, **extra
    )


def to_transformers(tokenizer, max_len: int | None = None):
    """The transformers tokenizer to save beside a model: a checkpoint's own (data.HFTokenizer.tok), or the byte
    tokenizer's equivalent."""
    own = getattr(tokenizer, "tok", None)
    return own if own is not None else transformers_byte_tokenizer(max_len)
