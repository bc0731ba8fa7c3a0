"""What following a 100-task run asks of the Slurm controller: the squeue and sacct calls of `status --wait` and
`status --follow` from submission to the last task's end, on the real Slurm test cluster.

    sudo scripts/slurm_test_cluster.sh && python benchmarks/slurm_polling.py [--tasks 100] [--poll-s 2]

The run is one array job of short sleeps (1-4 s each, at most 16 at once on the test cluster), recorded in a run
dir as launcher=sbatch records its jobs, so the real command follows real state changes without the training.
Stand-ins on the PATH count every Slurm command the command runs, then run the real one.
Writes benchmarks/results/slurm_polling.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import check, header, write  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "slurm_polling.md"
COMMANDS = ("squeue", "sacct", "scontrol", "scancel", "sbatch")


def counting_bin(where: Path, log: Path) -> Path:
    """A bin dir whose Slurm commands append their name to `log`, then run the real one."""
    bin_dir = where / "bin"
    bin_dir.mkdir()
    for name in COMMANDS:
        script = bin_dir / name
        script.write_text(f'#!/bin/bash\necho {name} >> "{log}"\nexec "{shutil.which(name)}" "$@"\n')
        script.chmod(0o755)
    return bin_dir


def submit(tasks: int) -> str:
    sleep = "sleep $((1 + SLURM_ARRAY_TASK_ID % 4))"
    out = subprocess.run(
        ["sbatch", "--parsable", f"--array=0-{tasks - 1}", "-c", "1", "--job-name=polling-bench"]
        + ["--output=/dev/null", "--wrap", sleep],  # no slurm-*.out left in the directory it runs from
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().split(";")[0]


def run_dir_for(root: Path, job_id: str, tasks: int) -> Path:
    """The run dir launcher=sbatch would have written for one stage of `tasks` array tasks."""
    run_dir = root / "run"
    run_dir.mkdir()
    names = [f"v{i}" for i in range(tasks)]
    manifest = {
        "run_id": "polling-bench",
        "experiment": "polling-bench",
        "run_dir": str(run_dir),
        "launcher": "sbatch",
        "state": "submitted",
        "stages": [{"name": "variants", "tasks": names}],
        "tasks": {n: {"stage": "variants", "state": "submitted"} for n in names},
        "jobs": [
            {
                "stage": "variants",
                "job_id": job_id,
                "array": True,
                "tasks": [{"variant": n, "array_index": i} for i, n in enumerate(names)],
            }
        ],
        "job_ids": [job_id],
    }
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return run_dir


def follow(mode: str, tasks: int, poll_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        log = root / "calls.log"
        bin_dir = counting_bin(root, log)
        job_id = submit(tasks)
        run_dir = run_dir_for(root, job_id, tasks)
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "slurm_router.status", str(run_dir), f"--{mode}", "--poll-s", str(poll_s)],
            env=env,
            capture_output=True,
            text=True,
        )
        wall_s = time.monotonic() - start
        if proc.returncode != 0:
            raise SystemExit(f"status --{mode} exited {proc.returncode}: {proc.stderr[-2000:]}")
        calls = log.read_text().split() if log.exists() else []
        polls = sum(line.startswith("[") for line in proc.stderr.splitlines()) if mode == "wait" else None
        return {
            "mode": f"--{mode}",
            "tasks": tasks,
            "poll_s": poll_s,
            "wall_s": round(wall_s, 1),
            "polls": polls,
            **{name: calls.count(name) for name in COMMANDS},
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--poll-s", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    check(args.out)
    # the last row asks for 0.5 s: the floor (SLURM_ROUTER_POLL_MIN_S, 2 s by default) holds it at 2 s
    rows = [
        follow(mode, args.tasks, poll_s)
        for mode, poll_s in (("wait", args.poll_s), ("follow", args.poll_s), ("wait", 0.5))
    ]
    lines = [
        "# Polling a 100-task Slurm run: calls to the controller",
        "",
        *header(f"python benchmarks/slurm_polling.py --tasks {args.tasks} --poll-s {args.poll_s:g}"),
        "",
        f"One array job of {args.tasks} sleeps (1-4 s, at most 16 at once on the single-node test cluster, Slurm "
        "22.05), followed from submission to its last task's end by the real `python -m slurm_router.status RUN_DIR "
        "--wait` and `--follow`; every Slurm command counted by a stand-in on the PATH. `polls`: the progress lines "
        "--wait printed (one per poll; --follow prints log lines instead). Each poll asks one squeue for all the "
        "tasks, and sacct only when a task has left squeue or ended; `poll_s` is what the command was asked for (the "
        "floor, SLURM_ROUTER_POLL_MIN_S, default 2 s, holds a shorter one at 2 s).",
        "",
        "| mode | tasks | poll_s | wall (s) | polls | squeue calls | sacct calls | scontrol | scancel | sbatch |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['mode']} | {r['tasks']} | {r['poll_s']:g} | {r['wall_s']} | {r['polls'] if r['polls'] else '-'} "
            f"| {r['squeue']} | {r['sacct']} | {r['scontrol']} | {r['scancel']} | {r['sbatch']} |"
            for r in rows
        ),
    ]
    write(args.out, "\n".join(lines), {"rows": rows})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
