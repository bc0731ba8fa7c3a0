"""Data sources (`data.kind`): each in a module here whose `SOURCE` (or `SOURCES[kind]`) names the data.* keys it reads, and its line in
SOURCES. The one place the config branches on data.kind; a new source is one module and one line (its reader of
documents: train/sources.py)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SOURCES: dict[str, str] = {  # data.kind -> its module (its SOURCE, or SOURCES[kind]); the choices' order
    "stdlib": "slurm_router.config.data_sources.texts",
    "text_dir": "slurm_router.config.data_sources.texts",
    "jsonl": "slurm_router.config.data_sources.rows",
    "parquet": "slurm_router.config.data_sources.rows",
    "synthetic": "slurm_router.config.data_sources.synthetic",
}
TEXT = ("kind", "max_len", "val_fraction", "max_documents", "split_on")  # what every text source reads
FIELDS = ("path", "text_field", "prompt_field", "completion_field", "messages_field")  # a row's fields


@dataclass(frozen=True)
class DataSource:
    """reads: the data.* keys it reads (names under data). unread: those its values leave unread (a record format,
    a length distribution) -> the fix, for a config's data section."""

    reads: tuple[str, ...]
    unread: Callable[[Any], dict[str, str]] = lambda data: {}


def source(kind: str) -> DataSource:
    module = importlib.import_module(SOURCES[kind])
    return module.SOURCES[kind] if hasattr(module, "SOURCES") else module.SOURCE
