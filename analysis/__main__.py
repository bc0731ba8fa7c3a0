"""Regenerate a run's report from its events and manifest; with several runs, also compare them.

python -m slurm_router.analysis runs/lora_ab/2026-11-23_07-30-00
python -m slurm_router.analysis RUN_A RUN_B [--out DIR]     # comparison.* and each run's report (DIR/<run>/),
                                                            # all in DIR (default: a new comparison-<time>/ here);
                                                            # the runs' own report/ folders are left alone
python -m slurm_router.analysis RUN_DIR --to mlflow         # replay the run's events into a tracker
                                                            # (tensorboard | mlflow | wandb; trackers.py)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from slurm_router.analysis.console import print_table
from slurm_router.analysis.report import ReportError, report_run
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
        help="where to write: the report of a single run (default: its report/), or the comparison of several "
        "and their reports (default: a new folder comparison-<time>/ in the current directory)",
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
    out = args.out if single else (args.out or _new_folder())
    runs = []
    taken: set[str] = set()
    for run_dir in args.run_dirs:
        report_dir = out if single else out / _unique(run_dir.name, taken)
        if note := _unfinished(run_dir):
            print(note)
        try:
            summary, tasks = report_run(run_dir, report_dir, args.peak_tflops)
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
        print(f"report: {report_dir or RunLayout(run_dir).report}")
        runs.append((run_dir, summary, tasks))
    if not single:
        from slurm_router.analysis.compare import write_comparison
        from slurm_router.analysis.render import fmt

        table = write_comparison(runs, out)
        columns = ["run", "variant", "trained_in", "val_loss", "tokens_per_s", "task_tokens_per_s", "speedup"]
        shown = table[[*columns, "balance_ratio"]].copy()
        for col, spec, suffix in (
            ("val_loss", ".4f", ""),
            ("tokens_per_s", ",.0f", ""),
            ("task_tokens_per_s", ",.0f", ""),
            ("speedup", ".2f", "x"),
            ("balance_ratio", ".3f", ""),
        ):
            shown[col] = [fmt(None if x != x else x, spec, suffix) for x in shown[col]]
        shown.loc[table["devices"] == 1, "balance_ratio"] = "n/a (1 device)"
        print(shown.to_string(index=False))
        print(f"comparison: {out / 'comparison.md'}")
    return 0


def _unfinished(run_dir: Path) -> str | None:
    """One line when the run has not trained what its report would show: a dry_run=true preview, or a run still
    going (its local launcher alive, or submitted to Slurm with tasks that have no result yet). The report is
    still written, from what there is."""
    from slurm_router.errors import UserError
    from slurm_router.rundir.lock import owner_alive
    from slurm_router.rundir.manifest import Manifest

    try:
        data = Manifest.load(run_dir).data
    except UserError:
        return None  # report_run says what is wrong with it
    state, layout = data.get("state"), RunLayout(run_dir)
    if state == "previewed":  # launch/preview.py
        return f"note: {run_dir} is a dry_run=true preview: nothing was trained, so its report has no results"
    left = [name for name in data["tasks"] if not layout.task(name).result.is_file()]
    if not left:
        return None
    so_far = f"{len(left)} of {len(data['tasks'])} task(s) have no result yet: this report shows what was logged so far"
    if state == "running" and owner_alive(data.get("owner")):
        return f"note: {run_dir} is still running; {so_far}"
    if state == "submitted":
        return f"note: {run_dir} was submitted to Slurm and {so_far} (status {run_dir} says which still run)"
    return None


def _new_folder() -> Path:
    """comparison-<time>/ in the current directory, never an existing folder."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    path, n = Path(f"comparison-{stamp}"), 1
    while path.exists():
        path, n = Path(f"comparison-{stamp}-{n}"), n + 1
    return path


def _unique(name: str, taken: set[str]) -> str:
    out, n = name, 1
    while out in taken:
        out, n = f"{name}-{n}", n + 1
    taken.add(out)
    return out


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
