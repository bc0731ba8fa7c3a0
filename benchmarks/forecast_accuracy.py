"""The forecast against what happened (issue 50, "A forecast"): three runs through the real command, each in a fresh
run root, one calibration cache for the three (a new user's: empty at the first run), and per run the forecast it
printed and saved (RUN_DIR/forecast.json) beside the report's measured wall time and device-hours.

    python benchmarks/forecast_accuracy.py            # ~10 min on 2 cores; writes benchmarks/results/forecast_accuracy.*
    python benchmarks/forecast_accuracy.py --dry --out /tmp/fa   # tiny sizes, a minute or two: the script works

The runs: the README's main command (smaller: base.steps, train.steps), a 4-variant fused run
(resources.fuse_variants=auto, the base cached by the first run) and a seeds=auto prune=true run. Wall time: the
run's start to its last task's end (the report's own figure; the forecast without its report_s) and the command's
wall clock beside it; device-hours: the report's. A seeds=auto or prune=true forecast is a range (the first round
only and every loser pruned at its first look .. every reserve and every step): the actual is held against it.
Target: within 30% (a ratio from 0.7 to 1.3; a range: from 0.7 x its low end to 1.3 x its high end).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import REPO, check, header, write  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "forecast_accuracy.md"
SIZES = {
    "full": ("base.steps=40", "train.steps=20", "train.eval_every=5"),
    "dry": ("base.steps=6", "train.steps=4", "train.eval_every=2", "train.eval_batches=2"),
}
RUNS = {
    "main command": ("+experiment=lora_ab",),
    "4-variant fused": (
        "+experiment=lora_ab",
        "+variants.r4.model.lora.r=4",
        "+variants.r16.model.lora.r=16",
        "resources.fuse_variants=auto",
    ),
    "seeds=auto": (
        "+experiment=lora_ab",
        "seeds=auto",
        "prune=true",
        "resources.fuse_variants=auto",
        "auto_seeds.max=4",
    ),
}
TARGET = 0.3


def run(name: str, argv: tuple[str, ...], root: Path, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "slurm_router", *argv, f"base.cache_dir={cache}", f"run_root={root / name}"]
    env = {k: v for k, v in os.environ.items() if k != "SLURM_ROUTER_TEST_NO_FORECAST"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600, env=env)
    command_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    run_dir = Path(proc.stdout.strip().splitlines()[-1].removeprefix("run_dir: "))
    fc = json.loads((run_dir / "forecast.json").read_text())
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    low = fc.get("low") if fc.get("reserves") or fc.get("prune") else None
    report_s = float(fc.get("report_s") or 0.0)
    row = {
        "run": name,
        "argv": ["python", "-m", "slurm_router", *argv],
        "forecast_line": next((ln for ln in proc.stdout.splitlines() if ln.startswith("forecast: ")), None),
        "source": fc.get("source"),
        "forecast_wall_s": fc["wall_s"] - report_s,
        "actual_wall_s": summary["header"]["wall_s"],
        "forecast_device_hours": fc["device_hours"],
        "actual_device_hours": summary["header"]["device_hours"],
        "forecast_command_s": fc["wall_s"],
        "command_s": command_s,
        "calibration_s": fc.get("calibration_s"),
        "low_wall_s": None if low is None else low["wall_s"] - report_s,
        "low_device_hours": None if low is None else low["device_hours"],
    }
    for what in ("wall_s", "device_hours"):
        f, a, lo = row[f"forecast_{what}"], row[f"actual_{what}"], row[f"low_{what}"]
        row[f"{what}_ratio"] = a / f
        row[f"{what}_within"] = (lo if lo is not None else f) * (1 - TARGET) <= a <= f * (1 + TARGET)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="tiny sizes: that the script works, not a measurement")
    ap.add_argument("--out", type=Path, default=None, help="write here instead of benchmarks/results/")
    args = ap.parse_args()
    md = (args.out / RESULTS.name) if args.out else RESULTS
    check(md)
    command = "python benchmarks/forecast_accuracy.py" + (" --dry" if args.dry else "")
    head = header(command)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="forecast_accuracy-") as tmp:
        for name, argv in RUNS.items():
            rows.append(run(name, (*argv, *SIZES["dry" if args.dry else "full"]), Path(tmp), Path(tmp) / "cache"))
            r = rows[-1]
            print(
                f"{name}: wall {r['actual_wall_s']:.0f} s of {r['forecast_wall_s']:.0f} forecast "
                f"({r['wall_s_ratio']:.2f}), {r['actual_device_hours']:.4f} device-hours of "
                f"{r['forecast_device_hours']:.4f} ({r['device_hours_ratio']:.2f})",
                flush=True,
            )
    load_after = os.getloadavg()
    table = [
        "| run | wall forecast | wall actual | ratio | device-hours forecast | actual | ratio | within 30% |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        rng = lambda lo, hi, fmt: f"{fmt.format(lo)} .. {fmt.format(hi)}" if lo is not None else fmt.format(hi)  # noqa: E731
        table.append(
            f"| {r['run']} | {rng(r['low_wall_s'], r['forecast_wall_s'], '{:.0f} s')} | {r['actual_wall_s']:.0f} s | "
            f"{r['wall_s_ratio']:.2f} | {rng(r['low_device_hours'], r['forecast_device_hours'], '{:.4f}')} | "
            f"{r['actual_device_hours']:.4f} | {r['device_hours_ratio']:.2f} | "
            f"{'yes' if r['wall_s_within'] and r['device_hours_within'] else 'no'} |"
        )
    lines = [
        "# The forecast against what happened",
        "",
        *head,
        "",
        f"Load average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_before)} before, "
        f"{'/'.join(f'{x:.2f}' for x in load_after)} after. One calibration cache for the three runs, empty at the "
        "first; ratio: actual / forecast (a range's ratio: against its high end). Wall time: the run's start to its "
        "last task's end; the command's wall clock (start-up of the command and the report included) is in the JSON.",
        "",
        *table,
    ]
    write(md, "\n".join(lines), {"command": command, "rows": rows, "target": TARGET, "dry": args.dry})
    print(f"wrote {md} and {md.with_suffix('.json')}")


if __name__ == "__main__":
    main()
