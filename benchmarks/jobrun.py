"""The job through its real command, timed the way every benchmark here times it: real tokens of the steps
after `warmup` / wall time from the end of step warmup-1 to the end of the last step (the step rows' clock).

    from jobrun import run_job
    r = run_job(["base.enabled=false", "train.steps=40"], tmp, warmup=5)   # {"tokens_per_s": ..., ...}
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run_job(overrides: list[str], tmp: Path, warmup: int, threads: int | None = None, env: dict | None = None) -> dict:
    """Run `python -m slurm_router OVERRIDES run_root=tmp` (one CPU slot); tokens/s over the timed window, the
    useful-token fraction, micro-batches per step (median) and the largest memory peak a step row reported."""
    from slurm_router.worker.cpu import THREADS_ENV

    full_env = {**os.environ, **(env or {})}
    if threads:
        full_env[THREADS_ENV] = str(threads)
    args = [sys.executable, "-m", "slurm_router", *overrides, f"run_root={tmp}", "launcher.cpu_slots=1"]
    out = subprocess.run(args, capture_output=True, text=True, cwd=tmp, env=full_env)
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    run_dir = Path(out.stdout.strip().splitlines()[-1].split("run_dir: ", 1)[1])
    rows = [json.loads(line) for line in (run_dir / "tasks/main/events-rank0.jsonl").read_text().splitlines()]
    st = sorted((r for r in rows if r["event"] == "step"), key=lambda r: r["step"])
    timed = st[warmup:]
    real = sum(r["n_tokens"] for r in timed)
    pad = sum(r["n_pad_tokens"] for r in timed)
    peaks = [r["mem_peak_bytes"] for r in timed if r.get("mem_peak_bytes")]
    return {
        "tokens_per_s": real / (timed[-1]["time"] - st[warmup - 1]["time"]),
        "useful_fraction": real / (real + pad),
        "micro_batches_per_step": statistics.median(sum(r["n_micro"]) for r in timed),
        "peak_mem_bytes": max(peaks) if peaks else None,
        "run_dir": str(run_dir),
    }
