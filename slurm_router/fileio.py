"""Atomic file writes (a temporary file, fsync, rename: a reader never sees half a file) and verified files
(a sha256 sidecar beside the data). A write that fails (disk full, no permission) raises WriteError, one line
naming the path and the cause, and leaves no temporary file. A leaf: it imports only slurm_router.errors."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from slurm_router.errors import UserError

# What the user can do about a failed write, by its cause.
_ADVICE: dict[int | None, str] = {
    errno.ENOSPC: "free space on that file system",
    errno.EDQUOT: "free space within your disk quota",
    errno.EACCES: "make the folder writable",
    errno.EPERM: "make the folder writable",
    errno.EROFS: "choose a writable file system",
}


class WriteError(UserError):
    """A file could not be written (disk full, permission, read-only): one line naming the path and the cause.
    A UserError: the command prints it and exits 2; nothing half-written is left behind."""

    @classmethod
    def of(cls, path: str | os.PathLike, e: OSError) -> "WriteError":
        cause = e.strerror or type(e).__name__
        advice = _ADVICE.get(e.errno, "see the cause")
        return cls(f"cannot write {path}: {cause} ({advice}; nothing was left half-written)")


class _RecordingFile:
    """A file object that remembers the OSError its write raised: torch.save turns one into a RuntimeError
    ('unexpected pos ...') that never says 'No space left on device'."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, b) -> int:
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def _os_error(e: BaseException | None, recorded: OSError | None) -> OSError | None:
    """The OSError behind a failed write: the one a write raised, else `e` or what it was raised from."""
    if recorded is not None:
        return recorded
    while e is not None:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def atomic_write_bytes(path: str | os.PathLike, write) -> None:
    """Call write(fileobj) into a temp file beside `path`, fsync, then rename over `path`. WriteError (one line)
    if the file system refuses (no space, no permission); the temp file is removed either way."""
    path = Path(path)
    tmp, out = None, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            out = _RecordingFile(f)
            write(out)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        cause = (
            None
            if isinstance(e, (KeyboardInterrupt, SystemExit))
            else _os_error(e, cast("OSError | None", out and out.error))
        )
        if cause is not None:
            raise WriteError.of(path, cause) from None
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, lambda f: f.write(text.encode("utf-8")))


# ---- training checkpoints: TaskPaths.checkpoints / step-NNNNNNNN.pt + .json (names: slurm_router.rundir.layout) -----
# The .json sidecar (step, size, sha256) is written after the data file: a checkpoint without its sidecar was
# cut short and is never loaded. A sidecar whose hash does not match its file means the file was damaged later.


class _HashingWriter:
    """A file object that hashes what passes through, so the sha256 costs no second read of the data."""

    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.n += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def sidecar_path(path: str | os.PathLike) -> Path:
    """A verified file's sidecar (its size and sha256): step-N.pt -> step-N.json, model.pt -> model.json."""
    return Path(path).with_suffix(".json")


def save_verified(path: str | os.PathLike, state: dict, **fields) -> dict:
    """torch.save `state` atomically to `path`, hashed on the way out (no second read), then its sidecar
    {**fields, file, time, sha256, bytes}. A file whose sidecar could not be written is removed too: it could
    never be verified. Returns the sidecar's content. WriteError (one line) when the disk refuses."""
    import torch

    out: dict[str, Any]
    path, out = Path(path), {}

    def write(f):
        w = _HashingWriter(f)
        torch.save(state, w)
        out.update(sha256=w.sha.hexdigest(), bytes=w.n)

    atomic_write_bytes(path, write)
    meta = {**fields, "file": path.name, "time": time.time(), **out}
    try:
        atomic_write_text(sidecar_path(path), json.dumps(meta, indent=1))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return meta


def sign_file(path: str | os.PathLike, **fields) -> dict:
    """The sidecar {**fields, file, time, sha256, bytes} of a file already written (a model's save_pretrained
    weights), which verify_file checks it against. Returns the sidecar's content."""
    sha, n = file_sha256(path)
    meta = {**fields, "file": Path(path).name, "time": time.time(), "sha256": sha, "bytes": n}
    atomic_write_text(sidecar_path(path), json.dumps(meta, indent=1))
    return meta


def file_sha256(path: str | os.PathLike) -> tuple[str, int]:
    """(sha256 hex digest, size in bytes) of a file, read in 1 MiB blocks. OSError if it cannot be read."""
    sha, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
            n += len(block)
    return sha.hexdigest(), n


def verify_file(path: str | os.PathLike) -> str | None:
    """None if the file is whole: its size and sha256 match its sidecar's; else why not, in words."""
    path = Path(path)
    sidecar = sidecar_path(path)
    try:
        meta = json.loads(sidecar.read_text())
        want_sha, want_bytes = meta["sha256"], int(meta["bytes"])
    except FileNotFoundError:
        return f"no sidecar {sidecar.name} (the save was cut short)"
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"unreadable sidecar {sidecar.name}"
    try:
        size = path.stat().st_size
        if size != want_bytes:
            return f"{size} bytes, expected {want_bytes} (truncated or overwritten)"
        sha, _ = file_sha256(path)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if sha != want_sha:
        return "sha256 mismatch (the file was damaged after it was saved)"
    return None
