"""What a sweep costs before anything trains: compose + grid + validate + plan + run dir + submit (an sbatch
dry run: the stage's array script rendered, not submitted), for grids of 4, 100 and 400 variants; with sbatch on
PATH also a real submission of the 100 (held by --begin=now+1hour, cancelled at once: nothing runs).

    python benchmarks/sweep_plan.py [--repeats 5]

Each grid is `-m model.lora.r=range(...) train.lr=choice(...)`, data=synthetic (a small corpus: its build is timed
apart), launcher=sbatch launcher.dry_run=true. In process, after one warm-up (the imports are timed apart, as the
command's start-up). Writes benchmarks/results/sweep_plan.md (medians over the repeats, seconds of wall clock).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import check, header  # noqa: E402
from provenance import write as write_results  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "sweep_plan.md"
LRS = ("1e-4", "2e-4", "3e-4", "5e-4", "1e-3", "2e-3", "3e-3", "5e-3", "1e-2", "2e-2")
COMMON = ["data=synthetic", "data.n_samples=64", "launcher=sbatch", "launcher.dry_run=true"]
HELD = ["launcher.dry_run=false", "launcher.additional_parameters.begin=now+1hour"]  # queued, never started


def grid_args(n_r: int, n_lr: int) -> list[str]:
    return [f"model.lora.r=range(4,{4 + 4 * n_r},4)", f"train.lr=choice({','.join(LRS[:n_lr])})"]


def phases(args: list[str], run_root: str, held: bool = False) -> dict[str, float]:
    """The steps of __main__.run, each timed (the launcher's check, the model check and the corpus included).
    held: submitted for real, held back by --begin, then cancelled."""
    from slurm_router.cli.checks import check_models, tokenizer
    from slurm_router.config.compose import compose
    from slurm_router.config.variants import validate
    from slurm_router.launch.base import launch
    from slurm_router.launch.plan import make_plan
    from slurm_router.rundir.lock import own_run, release_all
    from slurm_router.rundir.manifest import create_run_dir, new_run_dir
    from slurm_router.scheduler.registry import launcher_class
    from slurm_router.train.data import build_corpus

    t = {"start": time.perf_counter()}
    cfg = compose([*args, *COMMON, *(HELD if held else []), f"run_root={run_root}"], multirun=True)
    t["compose + grid"] = time.perf_counter()
    variants = validate(cfg)
    run_id, run_dir = new_run_dir(cfg)
    check_models(cfg, variants)
    launcher = launcher_class(cfg.launcher.kind)
    launcher.check(cfg)
    t["validate"] = time.perf_counter()
    build_corpus(cfg.data, tokenizer(cfg))
    t["corpus (data=synthetic)"] = time.perf_counter()
    stages = make_plan(cfg, variants, run_id, str(run_dir))
    t["plan"] = time.perf_counter()
    manifest = create_run_dir(cfg, run_id, run_dir, stages, cfg.launcher.kind)
    own_run(manifest)
    t["run dir (task.json x N, manifest)"] = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = launch(launcher(cfg, manifest), stages)
    t["submit (sbatch, real)" if held else "submit (sbatch dry run)"] = time.perf_counter()
    release_all()
    if held:
        jobs = [j["job_id"] for j in manifest.refresh().data["jobs"]] + [manifest.data.get("report_job_id")]
        subprocess.run(["scancel", *filter(None, jobs)], check=True)
        assert len(manifest.data["jobs"]) == 1 and len(manifest.data["jobs"][0]["tasks"]) == len(variants)
    assert code == 0, out.getvalue()
    script = (run_dir / "submit.sbatch").read_text()
    n_tasks = sum(len(s.tasks) for s in stages)
    assert len(variants) == n_tasks and re.search(rf"^#SBATCH --array=0-{n_tasks - 1}\b", script, re.M), script
    names = list(t)
    return {names[i]: t[names[i]] - t[names[i - 1]] for i in range(1, len(names))}


def command_s(args: list[str], run_root: str) -> float:
    """The real command, interpreter start-up and imports included."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "slurm_router", "-m", *args, *COMMON, f"run_root={run_root}"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    opts = ap.parse_args()
    check(RESULTS)
    t0 = time.perf_counter()
    import slurm_router.__main__  # noqa: F401
    import slurm_router.backends.slurm.sbatch_launcher  # noqa: F401
    import slurm_router.rundir.manifest  # noqa: F401
    import slurm_router.train.data  # noqa: F401

    imports_s = time.perf_counter() - t0
    grids = {4: (2, 2), 100: (10, 10), 400: (40, 10)}
    rows, wall = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        phases(grid_args(2, 2), tmp)  # warm-up: Hydra's first compose
        for n, shape in grids.items():
            runs = [phases(grid_args(*shape), tmp) for _ in range(opts.repeats)]
            rows[n] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows[n]["total"] = statistics.median(sum(r.values()) for r in runs)
            rows[n]["total less the corpus"] = statistics.median(
                sum(v for k, v in r.items() if not k.startswith("corpus")) for r in runs
            )
            print(f"{n} variants: {rows[n]['total']:.3f} s", flush=True)
        wall = {n: statistics.median(command_s(grid_args(*grids[n]), tmp) for _ in range(3)) for n in (4, 100)}
        if shutil.which("sbatch"):
            runs = [phases(grid_args(10, 10), tmp, held=True) for _ in range(opts.repeats)]
            rows["100 submitted"] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows["100 submitted"]["total"] = statistics.median(sum(r.values()) for r in runs)
            rows["100 submitted"]["total less the corpus"] = statistics.median(
                sum(v for k, v in r.items() if not k.startswith("corpus")) for r in runs
            )
    write(rows, imports_s, wall, opts.repeats)


def write(rows: dict, imports_s: float, wall: dict, repeats: int) -> None:
    keys = list(dict.fromkeys(k for row in rows.values() for k in row))
    keys = [k for k in keys if not k.startswith("total")] + ["total", "total less the corpus"]
    load = os.getloadavg()[0]
    command = "python benchmarks/sweep_plan.py" + (f" --repeats {repeats}" if repeats != 5 else "")
    lines = [
        "# Sweep plan + submit cost (benchmarks/sweep_plan.py)",
        "",
        *header(command),
        "",
        f"Load average (1 min) {load:.1f} at the end; median of {repeats} in-process runs after a warm-up.",
        "",
        "`python -m slurm_router -m model.lora.r=range(4,...,4) train.lr=choice(...) data=synthetic "
        "data.n_samples=64 launcher=sbatch launcher.dry_run=true`: the grid's variants become ONE array job "
        "(checked: `#SBATCH --array=0-(N-1)` in the one rendered submit.sbatch). Seconds of wall clock:",
        "",
        "| step | "
        + " | ".join(f"{n} variants" if isinstance(n, int) else f"{n} (real sbatch, held)" for n in rows)
        + " |",
        "|---|" + "---:|" * len(rows),
        *(f"| {k} | " + " | ".join(f"{rows[n][k]:.3f}" if k in rows[n] else "-" for n in rows) + " |" for k in keys),
        "",
        f"Imports (once per command): {imports_s:.2f} s. The whole command as a user runs it (interpreter start-up, "
        "imports, all of the above; median of 3): "
        + ", ".join(f"{n} variants {s:.2f} s" for n, s in wall.items())
        + ".",
        "",
        "The dry run renders the stage's script; the real submission (last column, on the single-node Slurm test "
        "cluster) adds the sbatch call of the one array job and the report job's, both held by "
        "--begin=now+1hour and cancelled at once. sbatch takes about as long for a 100-task array as for one "
        "task (benchmarks/results/slurm_submit.md). Per variant the total is "
        + ", ".join(f"{1000 * rows[n]['total'] / n:.1f} ms at {n}" for n in rows if isinstance(n, int))
        + ": each variant's config is merged and checked once (config.variant_configs merges onto an unpickled "
        "copy of the config without its variants, so 100 variants stay linear, not quadratic) and written once "
        "as its task.json (one fsync each).",
        "",
    ]
    write_results(RESULTS, "\n".join(lines))
    print(RESULTS.read_text())


if __name__ == "__main__":
    main()
