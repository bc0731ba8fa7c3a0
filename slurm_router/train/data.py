"""Corpora -> token samples with target masks, a deterministic train/val split, and the seeded global-batch sampler.

Plain text: documents are cut at `data.split_on` (for Python source: top-level definitions), then into pieces
of at most `data.max_len` tokens, each starting with the start token (BOS, or end-of-text where the tokenizer
has no BOS); every token but the first is a target. So lengths vary like real fine-tuning data, which is what the
router balances. Prompt/completion and chat records (records.py, chat.py) are one sample each, whose targets
are the completion (+ a closing end-of-text) or the assistant turns; one longer than `data.max_len` keeps its
first max_len tokens, and is left out if that leaves it no target (docs/design/model.md, "Target masks").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterator, cast

import numpy as np

from slurm_router.errors import UserError
from slurm_router.train.chat import ChatError
from slurm_router.train.records import Fields, checked_records, jsonl_rows, record_fields
from slurm_router.train.sources import reader


@dataclass
class Split:
    """Samples stored flat: tokens[starts[i]:starts[i] + lengths[i]] is sample i; is_target over the same range
    says which of its tokens are targets (predicted from the token before: never the first), n_targets[i] counts
    them. The loss and its token count use the targets; the router's cost uses lengths (every token computed)."""

    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    is_target: np.ndarray
    n_targets: np.ndarray
    sources: np.ndarray | None = None  # per sample, the file (or row) it comes from: one cluster in the verdict

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, i: int) -> np.ndarray:
        s = self.starts[i]
        return self.tokens[s : s + self.lengths[i]]

    def target_mask(self, i: int) -> np.ndarray:
        s = self.starts[i]
        return self.is_target[s : s + self.lengths[i]]

    def count_targets(self, ids) -> int:
        """Target tokens of these samples: the global batch's loss divides by this."""
        return int(self.n_targets[np.asarray(ids, dtype=np.int64)].sum()) if len(ids) else 0

    def source(self, i: int) -> int:
        return int(self.sources[i]) if self.sources is not None else i

    @classmethod
    def build(
        cls, samples: list[np.ndarray], masks: list[np.ndarray | None] | None = None, sources: list[int] | None = None
    ) -> "Split":
        """masks[i] None (or no masks): plain text, every token but the first is a target. sources[i]: the file
        sample i comes from (default: each sample its own)."""
        lengths = np.array([len(s) for s in samples], dtype=np.int64)
        starts = np.zeros(len(samples), dtype=np.int64)
        if len(samples):
            starts[1:] = np.cumsum(lengths)[:-1]
        flat = np.concatenate(samples).astype(np.int32) if samples else np.zeros(0, np.int32)
        is_target = np.ones(len(flat), dtype=bool)
        is_target[starts[lengths > 0]] = False
        for i, m in enumerate(masks or []):
            if m is not None and lengths[i]:
                is_target[starts[i] : starts[i] + lengths[i]] = m
                is_target[starts[i]] = False
        running = np.concatenate(([0], np.cumsum(is_target, dtype=np.int64)))
        src = np.asarray(sources if sources is not None else range(len(samples)), dtype=np.int64)
        return cls(flat, starts, lengths, is_target, running[starts + lengths] - running[starts], src)


@dataclass
class Corpus:
    train: Split
    val: Split
    n_documents: int
    description: str
    max_len: int = 0
    n_truncated: int = 0  # prompt/completion or chat samples cut to data.max_len (kept or dropped)
    n_dropped: int = 0  # ... of them whose every target token the cut removed (left out)
    n_without_targets: int = 0  # conversations without an assistant turn: nothing to learn (left out)
    n_empty: int = 0  # the user's text rows or files with nothing but whitespace (left out)

    def counts_note(self) -> str:
        """What data.max_len cut or left out, for the data line the command prints ('' when nothing)."""
        notes = []
        if self.n_truncated:
            dropped = f", {self.n_dropped} of them dropped (no target tokens left)" if self.n_dropped else ""
            notes.append(f"{self.n_truncated} truncated to data.max_len={self.max_len}{dropped}")
        if self.n_empty:
            notes.append(f"{self.n_empty} empty (no text) left out")
        if self.n_without_targets:
            notes.append(f"{self.n_without_targets} without an assistant turn left out")
        return "".join(f"; {n}" for n in notes)


def _is_val(name: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha1(name.encode("utf-8", "surrogateescape")).digest()[:4], "little")
    return h / 2**32 < val_fraction


# Held out by file when the hash holds out at least this many files (and leaves one to train on): the files are the
# verdict's clusters, and fewer give it too few independent units. Else the last val_fraction of each file's pieces
# (a contiguous span): every file is a cluster, a corpus of a few large files still has a held-out set, and no text
# is on both sides either way. Units too short to split (a row of a jsonl text file: one piece) are held out whole
# when spans would hold out fewer clusters than the hash does.
MIN_HELD_OUT_FILES = 8


def split_files(files: list[tuple[str, list]], val_fraction: float) -> tuple[list, list]:
    """(train, val) of [(piece, None, source)] from [(name, pieces)] of text files, source = the file's index."""
    held = [_is_val(name, val_fraction) for name, _ in files]
    n_val = [min(len(pieces) - 1, int(round(val_fraction * len(pieces)))) if pieces else 0 for _, pieces in files]
    train: list = []
    val: list = []
    if 0 < sum(held) < len(files) and sum(held) >= min(MIN_HELD_OUT_FILES, sum(n > 0 for n in n_val)):
        for k, ((_, pieces), out) in enumerate(zip(files, held)):
            (val if out else train).extend((p, None, k) for p in pieces)
        return train, val
    if not any(n_val) and files:  # too short for the fraction: the last piece of the longest file
        longest = max(range(len(files)), key=lambda k: len(files[k][1]))
        n_val[longest] = 1 if len(files[longest][1]) > 1 else 0
    for k, ((_, pieces), n) in enumerate(zip(files, n_val)):
        train.extend((p, None, k) for p in pieces[: len(pieces) - n])
        val.extend((p, None, k) for p in pieces[len(pieces) - n :])
    return train, val


def jsonl_documents(path: str, field: str) -> Iterator[tuple[str, str]]:
    """(line number, text) of a JSON Lines file of texts in `field` (records.jsonl_rows says what loads)."""
    fields = Fields("text", ("text_field",), (field,))
    for name, _, text in checked_records(jsonl_rows(path, fields), fields):
        yield name, cast(str, text)


def _pieces(tokens: np.ndarray, max_len: int, start: int) -> Iterator[np.ndarray]:
    body = max_len - 1
    for i in range(0, len(tokens), body):
        yield np.concatenate(([start], tokens[i : i + body])).astype(np.int32)


def _prompt_completion(tokenizer, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
    """start + prompt + completion + end-of-text; the completion and the end-of-text (the model learns to stop)
    are the targets. Prompt and completion are tokenized apart, so no token straddles the two."""
    p, c = tokenizer.encode(prompt), tokenizer.encode(completion)
    tokens = np.concatenate(([tokenizer.start_id], p, c, [tokenizer.eot_id])).astype(np.int32)
    mask = np.zeros(len(tokens), dtype=bool)
    mask[1 + len(p) :] = True
    return tokens, mask


def _chat(tokenizer, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        return tokenizer.chat(messages)
    except ChatError as e:
        raise UserError(f"{where}: {e} ({tokenizer.setting})") from None


def _check_chat(tokenizer, data_cfg) -> None:
    if not hasattr(tokenizer, "chat"):
        raise UserError(
            f"data.messages_field={data_cfg.messages_field}: chat data is rendered with the "
            "tokenizer's chat template, and model=gpt2 models (a byte-level tokenizer) have none: use "
            "model=hf model.name_or_path=CHECKPOINT, a checkpoint whose tokenizer has a chat template"
        )
    tokenizer.check_chat()


def build_corpus(data_cfg, tokenizer) -> Corpus:
    """Read, tokenize with target masks, truncate and split. Raises UserError for a missing path, a bad row (named
    by its line or row), chat data without a chat template, or nothing left to train on."""
    source = reader(data_cfg.kind)
    fields = record_fields(data_cfg, source.reads_fields)
    generated = source.generate(data_cfg, tokenizer)
    if generated is not None:
        n_val = max(1, int(len(generated) * data_cfg.val_fraction))
        train_val = Split.build(generated[n_val:]), Split.build(generated[:n_val])
        return Corpus(*train_val, len(generated), source.kind, data_cfg.max_len)
    if source.needs_path and not data_cfg.path:
        raise UserError(f"data.path is required with data={data_cfg.kind}: add data.path=/your/path")
    if fields.format == "chat":
        _check_chat(tokenizer, data_cfg)
    sides: dict[bool, list]
    record: Any
    max_len, sides, n_docs = data_cfg.max_len, {False: [], True: []}, 0
    files: list[tuple[str, list]] = []  # plain text: split by file, or by a span of each (split_files)
    n_truncated = n_dropped = n_without_targets = n_empty = 0
    for name, where, record in source.documents(data_cfg, fields):
        if data_cfg.max_documents and n_docs >= data_cfg.max_documents:
            break
        n_docs += 1
        side = sides[_is_val(name, data_cfg.val_fraction)]
        if fields.format == "text":
            parts = record.split(data_cfg.split_on) if data_cfg.split_on else [record]
            pieces = [
                p
                for part in parts
                if part.strip()
                for p in _pieces(tokenizer.encode(part), max_len, tokenizer.start_id)
            ]
            files.append((name, pieces))
            n_empty += not pieces and source.users_text  # the user's rows and files, not __init__.py
            continue
        tokens, mask = (
            _prompt_completion(tokenizer, *record)
            if fields.format == "prompt_completion"
            else _chat(tokenizer, record, where)
        )
        if not mask[1:].any():  # the first token is never a target: nothing predicts it
            n_without_targets += 1
            continue
        if len(tokens) > max_len:  # keep the start (the prompt, the first turns); the rest is cut
            tokens, mask = tokens[:max_len], mask[:max_len]
            n_truncated += 1
            if not mask[1:].any():
                n_dropped += 1
                continue
        side.append((tokens, mask, n_docs - 1))  # a row is its own cluster
    train, val = split_files(files, data_cfg.val_fraction) if files else (sides[False], sides[True])
    where = source.where(data_cfg)  # only what was read
    if not train and n_dropped:
        raise UserError(
            f"no training sample is left: data.max_len={max_len} cuts every target token out of "
            f"{n_dropped} sample(s) of {where!r} (their prompts or first turns are longer): raise "
            "data.max_len or shorten the prompts"
        )
    if not train and n_without_targets:
        raise UserError(
            f"no conversation of {where!r} has an assistant turn (data.messages_field="
            f"{data_cfg.messages_field}): the loss covers the assistant turns only, so there is nothing "
            "to learn; check the roles"
        )
    if not train:
        raise UserError(
            f"the corpus at {where!r} has no training text (data={data_cfg.kind}): point data.path at non-empty text"
        )
    if not val:
        # Too few documents for the hash split: hold out the last sample rather than fail.
        val.append(train.pop())
        if not train:
            raise UserError(f"the corpus at {where!r} is too small: it needs at least two text samples")
    label = {"text": "", "prompt_completion": " (prompt/completion)", "chat": " (chat)"}[fields.format]
    return Corpus(
        *cast(
            "tuple[Split, Split]",
            (Split.build([t for t, _, _ in s], [m for _, m, _ in s], [k for _, _, k in s]) for s in (train, val)),
        ),
        n_docs,
        source.description(where, label),  # the plan's words
        max_len,
        n_truncated,
        n_dropped,
        n_without_targets,
        n_empty,
    )


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
        out: list[int]
        out, pos = [], step * self.batch_size
        while len(out) < self.batch_size:
            epoch, offset = divmod(pos, self.n)
            take = min(self.batch_size - len(out), self.n - offset)
            out.extend(int(i) for i in self._perm(epoch)[offset : offset + take])
            pos += take
        return out


def eval_batches(val: Split, n_batches: int, batch_size: int, seed: int) -> list[list[int]]:
    """Fixed held-out batches (same for every variant and the base, so their losses compare). A batch holds whole
    sources (at most batch_size samples of one file, drawn by the seed), never part of one: the pieces of a file
    are one cluster, so the verdict's eval batches are independent units (verdict/stats.py)."""
    rng = np.random.default_rng([seed, 999])
    order = rng.permutation(len(val))
    by_source: dict[int, list[int]] = {}
    for i in order:  # sources in the order their first sample is drawn; each source's samples in drawn order
        by_source.setdefault(val.source(int(i)), []).append(int(i))
    batches: list[list[int]] = []
    for ids in by_source.values():  # first fit: the first batch with room, else a new one while there may be
        ids = ids[:batch_size]
        room = next((b for b in batches if len(b) + len(ids) <= batch_size), None)
        if room is None and len(batches) < n_batches:
            room = []
            batches.append(room)
        if room is not None:
            room.extend(ids)
    return batches
