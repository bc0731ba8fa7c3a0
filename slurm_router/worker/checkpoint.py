"""Training checkpoints: keep the last K, verify on load (their sha256 sidecars: slurm_router.fileio), fall back
to the newest whole one."""

from __future__ import annotations

import os
import time
from pathlib import Path

from slurm_router.fileio import save_verified, verify_file
from slurm_router.rundir.layout import CHECKPOINT_GLOB, SIDECAR_GLOB, checkpoint_file, checkpoint_step


class CheckpointError(Exception):
    """Checkpoints exist but none can be loaded: one line saying which and what to do."""


checkpoint_path = checkpoint_file  # checkpoints/step-NNNNNNNN.pt (the name is layout's)


def save_checkpoint(ckpt_dir: str | os.PathLike, step: int, state: dict, keep: int) -> dict:
    """Atomically write state as checkpoint `step`, then its sidecar, then drop all but the newest `keep`."""
    path = checkpoint_path(ckpt_dir, step)
    meta = save_verified(path, state, format=1, step=step)
    prune_checkpoints(ckpt_dir, keep)
    return {"path": str(path), **meta}


def prune_checkpoints(ckpt_dir: str | os.PathLike, keep: int) -> None:
    """Keep the newest `keep` checkpoints (by step); remove older ones and temp files of interrupted saves."""
    ckpt_dir = Path(ckpt_dir)
    for i, (step, sidecar) in enumerate(_sidecars(ckpt_dir)):
        if i >= keep:
            checkpoint_path(ckpt_dir, step).unlink(missing_ok=True)
            sidecar.unlink(missing_ok=True)
    for name in (CHECKPOINT_GLOB, SIDECAR_GLOB):
        for tmp in ckpt_dir.glob(f".{name}.*.tmp"):  # atomic_write_bytes' temp files
            if time.time() - tmp.stat().st_mtime > 60:  # not a save in progress
                tmp.unlink(missing_ok=True)


def _steps(ckpt_dir: Path, pattern: str) -> list[tuple[int, Path]]:
    """(step, file) of every file matching `pattern` whose name holds a step, newest first."""
    out = []
    for p in ckpt_dir.glob(pattern):
        try:
            out.append((checkpoint_step(p), p))
        except ValueError:
            continue
    return sorted(out, reverse=True)


def _sidecars(ckpt_dir: Path) -> list[tuple[int, Path]]:
    return _steps(ckpt_dir, SIDECAR_GLOB)


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """None if the checkpoint is whole (its sidecar's size and sha256 match), else why not."""
    return verify_file(path)


def latest_valid_checkpoint(ckpt_dir: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """(newest whole checkpoint, warnings about newer damaged ones). (None, []) when there is none at all;
    CheckpointError when there are some and every one is damaged (resuming from step 0 would silently
    throw work away: the user decides)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None, []
    # a data file without a sidecar counts as a (damaged) candidate
    steps = {s for s, _ in _sidecars(ckpt_dir) + _steps(ckpt_dir, CHECKPOINT_GLOB)}
    warnings: list[str] = []
    for step in sorted(steps, reverse=True):
        path = checkpoint_path(ckpt_dir, step)
        problem = verify_checkpoint(path)
        if problem is None:
            return path, warnings
        warnings.append(f"checkpoint {path} is not usable: {problem}; trying an older one")
    if warnings:
        raise CheckpointError(
            f"no valid checkpoint in {ckpt_dir} ({len(warnings)} damaged, newest: "
            f"{warnings[0].split(': ', 1)[1].split(';')[0]}): delete that folder to restart "
            "the task from step 0"
        )
    return None, []


def load_checkpoint(path: str | os.PathLike, map_location) -> dict:
    """torch.load with weights_only=True: a checkpoint holds tensors and plain Python values, never code."""
    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # verified before, so this is damage after the check: say which file
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded ({type(e).__name__}: {str(e)[:200]}); "
            "delete it to fall back to the previous one"
        ) from None
