"""Regenerate a run's report from its events and manifest; with several runs, also compare them.

python -m slurm_router.analysis runs/lora_ab/2026-11-23_07-30-00
python -m slurm_router.analysis RUN_A RUN_B [--out DIR]     # each run's report, plus comparison.* in
                                                            # RUN_A/report (or DIR)
python -m slurm_router.analysis RUN_DIR --to mlflow         # replay the run's events into a tracker
                                                            # (tensorboard | mlflow | wandb; trackers.py)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from slurm_router.analysis.report import ReportError, print_table, report_run
from slurm_router.fileio import WriteError
from slurm_router.rundir.layout import RunLayout
from slurm_router.tracking.trackers import KINDS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm_router.analysis", description=__doc__.split("\n")[0])
    parser.add_argument(
        "run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories (each holds a manifest.json)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="where to write: the report of a single run, or the comparison "
        "of several (default: the first run's report/)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="the device's peak (bf16 dense) TFLOP/s for MFU, when the events do not name the GPU model",
    )
    parser.add_argument(
        "--to",
        choices=KINDS,
        help="replay each task's events into this experiment tracker "
        "(the run's tracker.* settings; W&B offline unless WANDB_MODE)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.to:
        return _replay(args.run_dirs, args.to)
    single = len(args.run_dirs) == 1
    runs = []
    for run_dir in args.run_dirs:
        try:
            summary, tasks = report_run(run_dir, args.out if single else None, args.peak_tflops)
        except (ReportError, WriteError) as e:  # no manifest; the report's folder refuses the write
            print(f"error: {e}", file=sys.stderr)
            return 2
        except (KeyError, TypeError, ValueError, IndexError) as e:
            if os.environ.get("SLURM_ROUTER_DEBUG"):
                raise
            print(
                f"error: {run_dir}: the events do not fit the schema ({type(e).__name__}: {e}); "
                "rerun with SLURM_ROUTER_DEBUG=1 for the traceback",
                file=sys.stderr,
            )
            return 2
        print_table(summary)
        print(f"report: {args.out if single and args.out else RunLayout(run_dir).report}")
        runs.append((run_dir, summary, tasks))
    if not single:
        from slurm_router.analysis.compare import write_comparison

        out = args.out or RunLayout(args.run_dirs[0]).report
        table = write_comparison(runs, out)
        print(table[["run", "variant", "val_loss", "tokens_per_s", "speedup", "balance_ratio"]].to_string(index=False))
        print(f"comparison: {out / 'comparison.md'}")
    return 0


def _replay(run_dirs: list[Path], kind: str) -> int:
    from slurm_router.errors import UserError
    from slurm_router.tracking.replay import replay

    if len(run_dirs) != 1:
        print(f"error: --to {kind} replays one run: give one RUN_DIR", file=sys.stderr)
        return 2
    try:
        lines = replay(run_dirs[0], kind)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
