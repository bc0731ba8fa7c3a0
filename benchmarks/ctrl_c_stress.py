"""Ctrl-C stress: SIGINT to the launcher at each point of tests/test_requeue_local.py (before the first step,
mid-step, during a checkpoint), N times in a row, each checked in full (exit 130, interrupted manifest, a clean
job exit 75, a signal checkpoint or none, resume= bitwise equal to an uninterrupted run).

    python benchmarks/ctrl_c_stress.py --repeats 20 [--points mid_step,during_checkpoint]

Writes benchmarks/results/ctrl_c_stress.md (pass counts per point, the first line of every failure), after
every run (a stopped run leaves the counts so far). The races this found, and their fixes, are in the git history
(`git log -S "Ctrl-C races" -- docs/ARCHITECTURE.md`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from provenance import check, header, write  # noqa: E402
from test_requeue_local import CTRL_C_POINTS, Reference, ctrl_c_at  # noqa: E402


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--points", default=",".join(CTRL_C_POINTS), help="comma-separated: " + ", ".join(CTRL_C_POINTS))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ctrl_c_stress.md"))
    args = p.parse_args(argv)
    check(Path(args.out))
    points = [x for x in args.points.split(",") if x]
    command = f"python benchmarks/ctrl_c_stress.py --repeats {args.repeats}" + (
        f" --points {','.join(points)}" if points != list(CTRL_C_POINTS) else ""
    )
    head = header(command)
    load = os.getloadavg()
    results: dict[str, list[str | None]] = {pt: [] for pt in points}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="ctrl_c_stress_") as tmp:
        tmp = Path(tmp)
        (tmp / "ref").mkdir()
        ref = Reference(tmp / "ref")
        for i in range(args.repeats):
            for pt in points:
                run_tmp = tmp / f"{pt}-{i}"
                run_tmp.mkdir()
                try:
                    ctrl_c_at(pt, run_tmp, ref.losses)
                    results[pt].append(None)
                except BaseException as e:  # noqa: BLE001  (a failed check is a result)
                    if isinstance(e, KeyboardInterrupt):
                        raise
                    results[pt].append(_first_line(e))
                    traceback.print_exc()
                print(f"{pt} #{i + 1}: {'ok' if results[pt][-1] is None else results[pt][-1]}", flush=True)
                _write(args.out, head, load, results, args.repeats, time.time() - t0)
        if ref.proc.poll() is None:
            ref.proc.kill()
    return 0 if all(r is None for rs in results.values() for r in rs) else 1


def _write(out: str, head: list[str], load: tuple, results: dict, repeats: int, elapsed: float) -> None:
    done = sum(len(rs) for rs in results.values()) == repeats * len(results)
    la = os.getloadavg()
    lines = [
        "# Ctrl-C stress (benchmarks/ctrl_c_stress.py)",
        "",
        *head,
        "",
        f"{'Finished' if done else 'Still running (the counts so far)'} after {elapsed / 60:.1f} min; "
        f"{repeats} repeats asked per point; load average (1 min) {load[0]:.2f} at the start, {la[0]:.2f} now. "
        "Each run: SIGINT to `python -m slurm_router` at the point, "
        "then the full check of tests/test_requeue_local.py::ctrl_c_at (exit 130, interrupted manifest, "
        "the task's exit code 75, signal checkpoint or none, resume= bitwise equal).",
        "",
        "| point | passed | runs | failures |",
        "|---|---|---|---|",
    ]
    for pt, rs in results.items():
        fails = sorted({r for r in rs if r is not None})
        lines.append(f"| {pt} | {sum(r is None for r in rs)} | {len(rs)} | {'; '.join(fails) or '-'} |")
    write(Path(out), "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
