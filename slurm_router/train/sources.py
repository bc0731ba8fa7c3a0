"""The data sources' readers (data.kind): one class each, registered in READERS; the one place training branches
on data.kind. What the config checks of each is in config/data_sources/; a new source is a class here and its line
in READERS, beside its module there."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterator

import numpy as np

from slurm_router.errors import UserError
from slurm_router.train.records import Fields, checked_records, jsonl_rows, parquet_rows, read_bytes

MAX_FILE_BYTES = 64 << 20  # a single text file above this is almost surely not a text corpus


class Source:
    """A data.kind's reader. needs_path: data.path is required. reads_fields: its rows have fields that
    data.prompt_field, completion_field and messages_field may name (else plain text only). users_text: its
    documents are the user's files or rows (an empty one is counted and reported), not the standard library's."""

    kind = ""
    needs_path = True
    reads_fields = False
    users_text = True

    def documents(self, data_cfg, fields: Fields) -> Iterator[tuple[str, str, object]]:
        """(name, where, record) of every document or row; the name decides its side of the train/val split."""
        raise NotImplementedError

    def generate(self, data_cfg, tokenizer) -> list[np.ndarray] | None:
        """The samples of a generated corpus (nothing read); None: the corpus is read from documents()."""
        return None

    def where(self, data_cfg) -> str:
        """What was read, in the corpus's messages."""
        return data_cfg.path

    def description(self, where: str, label: str) -> str:
        """The plan's words for the corpus."""
        return f"{self.kind} {where}{label}"


class Stdlib(Source):
    """data=stdlib: the standard library's own source files, no data.path."""

    kind, needs_path, users_text = "stdlib", False, False

    def documents(self, data_cfg, fields: Fields) -> Iterator[tuple[str, str, object]]:
        for name, text in stdlib_documents():
            yield name, name, text

    def where(self, data_cfg) -> str:
        return "the standard library"

    def description(self, where: str, label: str) -> str:
        return f"{where}{label}"


class TextDir(Source):
    """data=text_dir: every text file of the folder data.path."""

    kind = "text_dir"

    def documents(self, data_cfg, fields: Fields) -> Iterator[tuple[str, str, object]]:
        for name, text in text_dir_documents(data_cfg.path):
            yield name, name, text


class Jsonl(Source):
    """data=jsonl: one JSON object a line (train/records.py jsonl_rows)."""

    kind, reads_fields = "jsonl", True

    def documents(self, data_cfg, fields: Fields) -> Iterator[tuple[str, str, object]]:
        return checked_records(jsonl_rows(data_cfg.path, fields), fields)


class Parquet(Source):
    """data=parquet: a parquet file or a folder of them (train/records.py parquet_rows)."""

    kind, reads_fields = "parquet", True

    def documents(self, data_cfg, fields: Fields) -> Iterator[tuple[str, str, object]]:
        return checked_records(parquet_rows(data_cfg.path, fields), fields)


class Synthetic(Source):
    """data=synthetic: token sequences with a controllable length distribution (benchmarks), nothing read."""

    kind, needs_path = "synthetic", False

    def generate(self, data_cfg, tokenizer) -> list[np.ndarray] | None:
        rng = np.random.default_rng(12345)
        n = data_cfg.n_samples
        if data_cfg.length_dist == "fixed":
            lengths = np.full(n, data_cfg.mean_len)
        elif data_cfg.length_dist == "uniform":
            lengths = rng.integers(data_cfg.min_len, 2 * data_cfg.mean_len - data_cfg.min_len + 1, n)
        else:
            mu = np.log(data_cfg.mean_len) - data_cfg.sigma**2 / 2
            lengths = rng.lognormal(mu, data_cfg.sigma, n).round()
        lengths = np.clip(lengths, data_cfg.min_len, data_cfg.max_len).astype(np.int64)
        vocab = min(tokenizer.vocab_size, 256)
        return [np.concatenate(([tokenizer.eot_id], rng.integers(0, vocab, int(L) - 1))) for L in lengths]


READERS: dict[str, Source] = {s.kind: s for s in (Stdlib(), TextDir(), Jsonl(), Parquet(), Synthetic())}


def reader(kind: str) -> Source:
    """The reader of a data.kind (checked to be one of config/data_sources/ SOURCES)."""
    return READERS[kind]


def stdlib_documents() -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
    paths = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in skip]  # never walked: site-packages is 30x the stdlib
        paths += [Path(folder, n) for n in names if n.endswith(".py")]
    for path in sorted(paths):
        try:
            yield str(path.relative_to(root)), path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib files are deliberately not UTF-8 (encoding tests)


def text_dir_documents(path: str) -> Iterator[tuple[str, str]]:
    root = Path(os.path.expanduser(path))
    if not root.is_dir():
        raise UserError(f"data.path={path!r} is not a folder: give a folder of text files (data=text_dir)")
    for p in _text_files(root):
        if p.stat().st_size > MAX_FILE_BYTES:
            raise UserError(f"data file {p} is larger than {MAX_FILE_BYTES >> 20} MiB: split it or remove it")
        raw = read_bytes(p)
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
                raise UserError(
                    f"data file {p} is a dangling symbolic link (to {os.readlink(p)}): fix the link or remove it"
                )
            if p.is_file():
                files.append(p)
    return sorted(files)
