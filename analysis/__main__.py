"""Regenerate a run's report from its events and manifest.

    python -m slurm_router.analysis runs/lora_ab/2026-11-23_07-30-00
"""
from __future__ import annotations

import sys
from pathlib import Path

from slurm_router.analysis.report import ReportError, print_table, write_report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0 if argv else 2
    for run_dir in argv:
        try:
            summary = write_report(Path(run_dir))
        except ReportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print_table(summary)
        print(f"report: {Path(run_dir) / 'report'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
