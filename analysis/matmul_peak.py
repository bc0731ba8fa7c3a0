"""The FLOP/s a device's matmuls reach, measured (issue 51, 1): a large `torch.mm` in the run's dtype on the same
device and the same number of threads, best of a few repeats. Model FLOP utilisation divides a job's useful FLOP/s
by it, so every throughput figure says how close it came to what this machine can do, on CPU as on GPU (a data
sheet's peak is used for a GPU the report does not run on: analysis/metrics.py).

Measured once per (host, device, dtype, threads) and kept in the user cache
(`$XDG_CACHE_HOME/slurm_router/matmul_peak.json`, else `~/.cache/...`): a report, a benchmark and the next run on
the same machine read the figure instead of measuring again. The FLOPs a training step needs are in
`train_flops_per_token`; docs/throughput.md has the formula.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from slurm_router.fileio import atomic_write_text

CACHE_FILE = "matmul_peak.json"


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "slurm_router" / CACHE_FILE


def measure_flops(device: str = "cpu", dtype: str = "float32", threads: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` square matmuls (2 n^3 FLOPs each), n sized to take ~0.1 s or more: 2048 on a
    CPU, 8192 on a GPU. threads: torch's intra-op threads while measuring (a CPU worker's own count)."""
    import torch

    n = 2048 if device == "cpu" else 8192
    kind = getattr(torch, dtype)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = (torch.randn(n, n, device=device).to(kind) for _ in range(2))
        best = float("inf")
        for _ in range(repeats + 1):  # the first warms the kernels up
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.mm(a, b)
            if device != "cpu":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best
    finally:
        torch.set_num_threads(before)


def _key(host: str, device: str, dtype: str, threads: int | None) -> str:
    return f"{host}|{device}|{dtype}|{threads or 'default'}"


def peak_flops(
    device: str = "cpu", dtype: str = "float32", threads: int | None = None, measure: bool = True
) -> float | None:
    """This machine's measured matmul FLOP/s for (device, dtype, threads), from the cache or measured now and kept
    (measure=False: None when not cached yet)."""
    path, key = cache_path(), _key(platform.node(), device, dtype, threads)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return float(known[key]["flops"])
    if not measure:
        return None
    flops = measure_flops(device, dtype, threads)
    known[key] = {"flops": flops, "measured": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(known, indent=1, sort_keys=True))
    except OSError:  # a read-only home: the figure is still right, just not kept
        pass
    return flops


def train_flops_per_token(
    n_params: int, n_trainable: int, n_layer: int | None = None, d_model: int | None = None, context: float = 0.0
) -> float:
    """FLOPs one trained token costs: 2N forward + 2N backward through the activations + 2N' for the N' trainable
    weights' gradients (6N for full training, about 4N for LoRA), plus causal attention's score and value matmuls,
    4 d_model x context forward per layer and twice that backward (12 n_layer d_model context), `context` the mean
    number of positions a token attends to (half a sample's length in a causal model; 0: left out)."""
    attention = 12 * (n_layer or 0) * (d_model or 0) * max(0.0, context)
    return 4 * n_params + 2 * n_trainable + attention
