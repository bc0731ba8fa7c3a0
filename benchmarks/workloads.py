"""Reproducible sample-length distributions for router tests, benchmarks and the cost-model simulator.

- lognormal_lengths: a seeded long tail (most samples short, a few very long), like chat/instruction data.
- stdlib_lengths: real text, the Python standard library's source split on blank-line pairs and cut into
  pieces of at most 512 bytes (bytes stand in for tokens): a spiky, real-world distribution that ships with
  every Python, so no download is needed.
"""

from __future__ import annotations

import functools
import math
import os
import random
import sysconfig

_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}  # as train/data.py


def lognormal_lengths(
    n: int, seed: int, mean_len: float = 96.0, sigma: float = 0.8, min_len: int = 8, max_len: int = 512
) -> list[int]:
    """Same parameterisation as data=synthetic (conf/data/synthetic.yaml): mean length, log-space sigma, clipped."""
    rng = random.Random(seed)
    mu = math.log(mean_len) - sigma * sigma / 2
    return [min(max_len, max(min_len, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


@functools.lru_cache(maxsize=4)
def stdlib_lengths(max_piece_bytes: int = 512) -> tuple[int, ...]:
    """Lengths (bytes) of stdlib source pieces, files in sorted order so every machine with the same Python
    gets the same list (~0.2 s to read)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP)
        paths.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    lengths: list[int] = []
    for path in sorted(paths):
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        for piece in data.split(b"\n\n\n"):
            piece = piece.strip()
            for start in range(0, len(piece), max_piece_bytes):
                chunk = piece[start : start + max_piece_bytes]
                if chunk.strip():
                    lengths.append(len(chunk))
    if not lengths:
        raise RuntimeError(f"no .py files found under {root}: use lognormal_lengths instead")
    return tuple(lengths)


def sample_batches(pool: tuple[int, ...] | list[int], batch_size: int, n_batches: int, seed: int) -> list[list[int]]:
    """n_batches global batches of lengths drawn (without replacement inside a batch) from pool."""
    rng = random.Random(seed)
    if batch_size <= len(pool):
        return [rng.sample(pool, batch_size) for _ in range(n_batches)]
    return [[rng.choice(pool) for _ in range(batch_size)] for _ in range(n_batches)]
