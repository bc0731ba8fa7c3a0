"""The README's first command, timed: `python -m slurm_router +experiment=lora_ab` from a fresh base cache (the
base stage trains) and again with that cache (only the variants train), each in a run root of its own.

    python benchmarks/quickstart_time.py [--repeats 1]

Wall clock of the whole command as a user types it (interpreter start-up, imports, the report included). The
base cache and the run roots live in a temporary folder, so your ~/.cache/slurm_router is not touched.
Writes benchmarks/results/quickstart.md and .json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import REPO, check, header, write  # noqa: E402

COMMAND = ["+experiment=lora_ab"]
RESULTS = REPO / "benchmarks" / "results" / "quickstart"


def timed_run(cache: Path, root: Path) -> float:
    argv = [sys.executable, "-m", "slurm_router", *COMMAND, f"base.cache_dir={cache}", f"run_root={root}"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1, help="fresh + cached pairs (each fresh one with a new cache)")
    args = ap.parse_args()
    check(RESULTS.with_suffix(".md"))
    command = "python benchmarks/quickstart_time.py" + (f" --repeats {args.repeats}" if args.repeats != 1 else "")
    head = header(command)  # the commit the runs start from
    load_before = os.getloadavg()
    fresh, cached = [], []
    with tempfile.TemporaryDirectory(prefix="quickstart_time-") as tmp:
        for i in range(args.repeats):
            cache = Path(tmp) / f"cache-{i}"
            fresh.append(timed_run(cache, Path(tmp) / f"fresh-{i}"))
            cached.append(timed_run(cache, Path(tmp) / f"cached-{i}"))
            print(f"repeat {i}: fresh {fresh[-1]:.1f} s, cached {cached[-1]:.1f} s", flush=True)
    load_after = os.getloadavg()
    res = {
        "command": command,
        "header": head,
        "argv": ["python", "-m", "slurm_router", *COMMAND],
        "fresh_s": fresh,
        "cached_s": cached,
        "fresh_median_s": statistics.median(fresh),
        "cached_median_s": statistics.median(cached),
        "load_before": load_before,
        "load_after": load_after,
    }
    lines = [
        "# The first command's wall time (`python -m slurm_router +experiment=lora_ab`)",
        "",
        *res["header"],
        "",
        f"Load average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_before)} before, "
        f"{'/'.join(f'{x:.2f}' for x in load_after)} after (other work on the machine slows both runs). "
        f"Median of {args.repeats}; fresh = an empty base cache (the base stage trains, then the two "
        "variants), cached = the same command again with that cache (the variants only).",
        "",
        "| run | wall s |",
        "|---|---:|",
        f"| fresh | {res['fresh_median_s']:.0f} |",
        f"| base cached | {res['cached_median_s']:.0f} |",
    ]
    write(RESULTS.with_suffix(".md"), "\n".join(lines), res)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
