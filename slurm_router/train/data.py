"""Corpora -> token samples, a deterministic train/val split, and the seeded global-batch sampler.

A sample is one piece of a document: documents are cut at `data.split_on` (for Python source: top-level
definitions), then into pieces of at most `data.max_len` tokens, each starting with the end-of-text token.
So lengths vary like real fine-tuning data, which is what the router balances.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from slurm_router.config import UserError

MAX_FILE_BYTES = 64 << 20          # a single text file above this is almost surely not a text corpus


class ByteTokenizer:
    """Bytes are tokens 0-255; 256 is end-of-text (also used as padding, which the loss masks out)."""
    vocab_size = 257
    eot_id = 256
    pad_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int32)


# The files a transformers tokenizer is read from; a checkpoint with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")


class HFTokenizer:
    """A local transformers tokenizer (model=hf). A checkpoint without one is named as such (not blamed on the
    data, which it would otherwise turn into no tokens)."""

    def __init__(self, path: str, setting: str = "model.name_or_path"):
        fix = (f"save the tokenizer beside the weights (tokenizer.save_pretrained('{path}')) or copy its files "
               "from the model this checkpoint was trained from")
        if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
            raise UserError(f"{setting}: the checkpoint {path} has no tokenizer (none of "
                            f"{', '.join(TOKENIZER_FILES)}): {fix}")
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if not len(self.encode("Hello, world.")):
            raise UserError(f"{setting}: the tokenizer in {path} turns text into no tokens (its files are "
                            f"incomplete: {', '.join(sorted(f.name for f in Path(path).iterdir()))}): {fix}")
        self.vocab_size = len(self.tok)
        model_vocab = _config_value(Path(path) / "config.json", "vocab_size")
        if isinstance(model_vocab, int) and self.vocab_size > model_vocab:
            raise UserError(f"{setting}: the tokenizer in {path} has {self.vocab_size} tokens, more than the "
                            f"model's vocab_size={model_vocab} (config.json): they come from different models; "
                            f"{fix}")
        self.eot_id = self.tok.eos_token_id if self.tok.eos_token_id is not None else 0
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eot_id

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False), dtype=np.int32)


def _config_value(config: Path, key: str):
    try:
        return json.loads(config.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def make_tokenizer(model_cfg):
    if model_cfg.kind == "hf":
        return HFTokenizer(os.path.expanduser(model_cfg.name_or_path), f"model.name_or_path={model_cfg.name_or_path!r}")
    return ByteTokenizer()


@dataclass
class Split:
    """Samples stored flat: tokens[starts[i]:starts[i] + lengths[i]] is sample i."""
    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, i: int) -> np.ndarray:
        s = self.starts[i]
        return self.tokens[s:s + self.lengths[i]]

    @classmethod
    def build(cls, samples: list[np.ndarray]) -> "Split":
        lengths = np.array([len(s) for s in samples], dtype=np.int64)
        starts = np.zeros(len(samples), dtype=np.int64)
        if len(samples):
            starts[1:] = np.cumsum(lengths)[:-1]
        flat = np.concatenate(samples).astype(np.int32) if samples else np.zeros(0, np.int32)
        return cls(flat, starts, lengths)


@dataclass
class Corpus:
    train: Split
    val: Split
    n_documents: int
    description: str


def _is_val(name: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha1(name.encode("utf-8", "surrogateescape")).digest()[:4], "little")
    return h / 2**32 < val_fraction


def stdlib_documents() -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip.intersection(rel.parts[:-1]):
            continue
        try:
            yield str(rel), path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue   # a few stdlib files are deliberately not UTF-8 (encoding tests)


def text_dir_documents(path: str) -> Iterator[tuple[str, str]]:
    root = Path(os.path.expanduser(path))
    if not root.is_dir():
        raise UserError(f"data.path={path!r} is not a folder: give a folder of text files (data=text_dir)")
    for p in _text_files(root):
        if p.stat().st_size > MAX_FILE_BYTES:
            raise UserError(f"data file {p} is larger than {MAX_FILE_BYTES >> 20} MiB: split it or remove it")
        raw = _read(p)
        if b"\0" in raw[:8192]:
            raise UserError(f"data file {p} looks binary (NUL bytes): data=text_dir reads text files only")
        try:
            yield str(p.relative_to(root)), raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"data file {p} is not UTF-8 text (byte {e.start}): convert it or remove it") from None


def _text_files(root: Path) -> list[Path]:
    """Every file under root but hidden ones, sorted. A folder that cannot be listed or a link to nothing is an
    error naming it (never silently less data); FIFOs, sockets and devices are not text files and are skipped."""
    def unreadable(e: OSError):
        raise UserError(f"data folder {e.filename} cannot be read ({e.strerror}): make it readable or remove it")
    files = []
    for folder, _, names in os.walk(root, onerror=unreadable):
        for name in (n for n in names if not n.startswith(".")):
            p = Path(folder) / name
            if p.is_symlink() and not p.exists():
                raise UserError(f"data file {p} is a dangling symbolic link (to {os.readlink(p)}): "
                                "fix the link or remove it")
            if p.is_file():
                files.append(p)
    return sorted(files)


def _read(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError as e:
        raise UserError(f"data file {p} cannot be read ({e.strerror or type(e).__name__}): "
                        "make it readable or remove it") from None


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def jsonl_documents(path: str, field: str) -> Iterator[tuple[str, str]]:
    """JSON Lines as the format defines them: one JSON object a line, and lines end at '\\n' only, never at
    U+2028, U+0085 or the others str.splitlines() splits at (json.dumps(..., ensure_ascii=False) writes those
    raw inside strings); CRLF line ends, a UTF-8 byte order mark, blank lines and a last line without '\\n'
    all load."""
    p = Path(os.path.expanduser(path))
    if p.is_symlink() and not p.exists():
        raise UserError(f"data.path={path!r} is a dangling symbolic link (to {os.readlink(p)}): fix it")
    if p.is_dir():
        raise UserError(f"data.path={path!r} is a folder, not a file: give a .jsonl file with one JSON object a "
                        "line (data=text_dir reads a folder of text files)")
    if not p.is_file():
        raise UserError(f"data.path={path!r} is not a file: give a .jsonl file with one JSON object a line")
    raw = _read(p)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise UserError(f"data file {p} is not UTF-8 (line {line}, byte {e.start}): convert it to UTF-8") from None
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"line {n} of {p} is not valid JSON ({e.msg}): one JSON object a line") from None
        except RecursionError:
            raise UserError(f"line {n} of {p} is JSON nested too deeply to read: one JSON object a line") from None
        if not isinstance(row, dict):
            raise UserError(f"line {n} of {p} is a JSON {_JSON_TYPES[type(row)].split()[-1]}, not an object with "
                            f"a {field!r} field: data=jsonl reads one object a line, e.g. {{\"{field}\": \"...\"}}")
        if field not in row:
            fields = ", ".join(map(repr, list(row)[:8])) or "none"
            raise UserError(f"line {n} of {p} has no field {field!r} (its fields: {fields}): set data.text_field "
                            "to the field holding the text")
        if not isinstance(row[field], str):
            raise UserError(f"line {n} of {p}: field {field!r} is {_JSON_TYPES[type(row[field])]}, not a string: "
                            "set data.text_field to the field holding the text")
        yield f"{n}", row[field]


def _pieces(tokens: np.ndarray, max_len: int, eot: int) -> Iterator[np.ndarray]:
    body = max_len - 1
    for i in range(0, len(tokens), body):
        yield np.concatenate(([eot], tokens[i:i + body])).astype(np.int32)


def build_corpus(data_cfg, tokenizer) -> Corpus:
    """Tokenize and split. Raises UserError for a missing path or an empty corpus."""
    if data_cfg.kind == "synthetic":
        return synthetic_corpus(data_cfg, tokenizer)
    if data_cfg.kind in ("text_dir", "jsonl") and not data_cfg.path:
        raise UserError(f"data.path is required with data={data_cfg.kind}: add data.path=/your/path")
    docs = {"stdlib": lambda: stdlib_documents(),
            "text_dir": lambda: text_dir_documents(data_cfg.path),
            "jsonl": lambda: jsonl_documents(data_cfg.path, data_cfg.text_field)}[data_cfg.kind]()
    train, val, n_docs = [], [], 0
    for name, text in docs:
        if data_cfg.max_documents and n_docs >= data_cfg.max_documents:
            break
        n_docs += 1
        target = val if _is_val(name, data_cfg.val_fraction) else train
        for part in text.split(data_cfg.split_on) if data_cfg.split_on else [text]:
            if part.strip():
                target.extend(_pieces(tokenizer.encode(part), data_cfg.max_len, tokenizer.eot_id))
    where = data_cfg.path or "the standard library"
    if not train:
        raise UserError(f"the corpus at {where!r} has no training text (data={data_cfg.kind}): "
                        "point data.path at non-empty text")
    if not val:
        # Too few documents for the hash split: hold out the last sample rather than fail.
        val.append(train.pop())
        if not train:
            raise UserError(f"the corpus at {where!r} is too small: it needs at least two text samples")
    return Corpus(Split.build(train), Split.build(val), n_docs, f"{data_cfg.kind}:{where}")


def synthetic_corpus(data_cfg, tokenizer) -> Corpus:
    rng = np.random.default_rng(12345)
    n = data_cfg.n_samples
    if data_cfg.length_dist == "fixed":
        lengths = np.full(n, data_cfg.mean_len)
    elif data_cfg.length_dist == "uniform":
        lengths = rng.integers(data_cfg.min_len, 2 * data_cfg.mean_len - data_cfg.min_len + 1, n)
    else:
        mu = np.log(data_cfg.mean_len) - data_cfg.sigma ** 2 / 2
        lengths = rng.lognormal(mu, data_cfg.sigma, n).round()
    lengths = np.clip(lengths, data_cfg.min_len, data_cfg.max_len).astype(np.int64)
    vocab = min(tokenizer.vocab_size, 256)
    samples = [np.concatenate(([tokenizer.eot_id], rng.integers(0, vocab, int(L) - 1))) for L in lengths]
    n_val = max(1, int(n * data_cfg.val_fraction))
    return Corpus(Split.build(samples[n_val:]), Split.build(samples[:n_val]), n, "synthetic")


class GlobalBatchSampler:
    """The global batch of each step: a seeded permutation per epoch, independent of devices and policy."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
        return self._perms[epoch]

    def batch(self, step: int) -> list[int]:
        out, pos = [], step * self.batch_size
        while len(out) < self.batch_size:
            epoch, offset = divmod(pos, self.n)
            take = min(self.batch_size - len(out), self.n - offset)
            out.extend(int(i) for i in self._perm(epoch)[offset:offset + take])
            pos += take
        return out


def eval_batches(val: Split, n_batches: int, batch_size: int, seed: int) -> list[list[int]]:
    """Fixed held-out batches (same for every variant and the base, so their losses compare)."""
    order = np.random.default_rng([seed, 999]).permutation(len(val))
    ids = [int(i) for i in order[:n_batches * batch_size]]
    return [ids[i:i + batch_size] for i in range(0, len(ids), batch_size)]
