"""Atomic saves: write a temporary file, fsync, rename. A reader never sees half a file."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch


def atomic_write_bytes(path: str | os.PathLike, write) -> None:
    """Call write(fileobj) into a temp file beside `path`, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, lambda f: f.write(text.encode("utf-8")))


def save_base(state: dict, weights_path: str, meta: dict) -> None:
    """The base stage's weights and its held-out loss, into the shared cache. Meta last: it marks completeness."""
    atomic_write_bytes(weights_path, lambda f: torch.save(state, f))
    atomic_write_text(Path(weights_path).with_name("meta.json"), json.dumps(meta, indent=1))
