"""Regenerate a run's report from its events and manifest; with several runs, also compare them.

    python -m slurm_router.analysis runs/lora_ab/2026-11-23_07-30-00
    python -m slurm_router.analysis RUN_A RUN_B [--out DIR]     # each run's report, plus comparison.* in
                                                                # RUN_A/report (or DIR)
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from slurm_router.analysis.report import ReportError, print_table, report_run
from slurm_router.checkpoint import WriteError
from slurm_router.layout import RunLayout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm_router.analysis", description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run directories (each holds a manifest.json)")
    parser.add_argument("--out", type=Path, help="where to write: the report of a single run, or the comparison "
                                                 "of several (default: the first run's report/)")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak (bf16 dense) TFLOP/s for MFU, when "
                                                          "the events do not name the GPU model")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    single = len(args.run_dirs) == 1
    runs = []
    for run_dir in args.run_dirs:
        try:
            summary, tasks = report_run(run_dir, args.out if single else None, args.peak_tflops)
        except (ReportError, WriteError) as e:         # no manifest; the report's folder refuses the write
            print(f"error: {e}", file=sys.stderr)
            return 2
        except (KeyError, TypeError, ValueError, IndexError) as e:
            if os.environ.get("SLURM_ROUTER_DEBUG"):
                raise
            print(f"error: {run_dir}: the events do not fit the schema ({type(e).__name__}: {e}); "
                  "rerun with SLURM_ROUTER_DEBUG=1 for the traceback", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
