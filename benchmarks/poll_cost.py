"""What one telemetry read costs, per call, on this machine's device: why the router never polls the device
per decision (docs/throughput.md, "Measured on a GPU") and reads the state workers report between steps instead.

    python benchmarks/poll_cost.py            # GPU if present (torch.cuda and NVML), else the CPU's psutil reads

Writes benchmarks/results/poll_cost-<device>.md and .json: the median per-call wall time of each read over
REPEATS calls (after WARMUP), and the spread (10th-90th percentile).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import RESULTS, check, header, write  # noqa: E402

REPEATS, WARMUP = 2000, 50


def per_call_us(read: Callable[[], object]) -> dict:
    for _ in range(WARMUP):
        read()
    samples = []
    for _ in range(REPEATS):
        t0 = time.perf_counter_ns()
        read()
        samples.append(time.perf_counter_ns() - t0)
    q = statistics.quantiles(samples, n=10)
    return {"median_us": statistics.median(samples) / 1e3, "p10_us": q[0] / 1e3, "p90_us": q[-1] / 1e3}


def reads(device: str) -> dict[str, Callable[[], object]]:
    if device == "cuda":
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        torch.zeros(1, device="cuda")  # a context and an allocation, as in a training worker
        return {
            "torch.cuda.memory_allocated": torch.cuda.memory_allocated,
            "torch.cuda.max_memory_allocated": torch.cuda.max_memory_allocated,
            "torch.cuda.mem_get_info": torch.cuda.mem_get_info,
            "pynvml.nvmlDeviceGetMemoryInfo": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle),
            "pynvml.nvmlDeviceGetUtilizationRates": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle),
        }
    import psutil

    proc = psutil.Process()
    return {
        "psutil.Process().memory_info": proc.memory_info,
        "psutil.virtual_memory": psutil.virtual_memory,
        "psutil.Process().cpu_percent": lambda: proc.cpu_percent(None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the result files into this folder, not benchmarks/results/")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = (args.out or RESULTS) / f"poll_cost-{device}.md"
    check(out)
    rows = {name: per_call_us(read) for name, read in reads(device).items()}
    lines = [
        f"# Telemetry read cost ({device})",
        "",
        *header("python benchmarks/poll_cost.py"),
        "",
        f"Median wall time per call over {REPEATS} calls after {WARMUP} warm-up calls (10th-90th percentile).",
        "",
        "| read | us per call | p10-p90 us |",
        "|---|---:|---:|",
    ]
    lines += [f"| `{n}` | {r['median_us']:.2f} | {r['p10_us']:.2f}-{r['p90_us']:.2f} |" for n, r in rows.items()]
    write(out, "\n".join(lines), {"device": device, "rows": rows})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
