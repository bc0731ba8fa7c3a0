"""prune=true on real tasks: how often and how early a planted loser is pruned, and how often an equal variant is,
by the real protocol (real workers, the local queue, the run's looks taken as tasks reach their evaluations and
recorded once in decisions.jsonl), not by simulated tables (verdict_calibration.py, prune_protocol.py).

    python benchmarks/prune_real.py [--repeats 5] [--seeds 3] [--steps 8] [--out benchmarks/results/prune_real]

Each repeat is one run of three variants of the tiny config-built model on the stdlib corpus (base.enabled=false,
data=stdlib, train.eval_every=2, train.eval_batches=4, this machine's default launcher.cpu_slots): `a` and `b`, the
same config (an A/A pair), and `loser`, the same with train.lr=1e-6 (it barely moves from the base). Repeats differ
by their training seeds (and the config seed: the eval batches). A repeat takes about 1.5 min on 2 idle cores.
Writes OUT.md and OUT.json (the per-task outcomes too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import REPO, check, header, write  # noqa: E402

from slurm_router.verdict import GRACE  # noqa: E402
from slurm_router.verdict.schedule import Schedule  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "prune_real"
VARIANTS = "+variants={a: {train: {lr: 5e-3}}, b: {train: {lr: 5e-3}}, loser: {train: {lr: 1e-6}}}"


def launch(root: Path, repeat: int, n_seeds: int, steps: int, prune: bool = True) -> tuple[Path, float, str]:
    """One run of a, b and loser (n_seeds replicates each, seeds repeat * n_seeds + i, config seed `repeat`) under
    `root`: (its run directory, its wall time, its stderr). prune_replay.py records runs with prune=False."""
    seeds = [repeat * n_seeds + i for i in range(n_seeds)]
    argv = [
        sys.executable,
        "-m",
        "slurm_router",
        "+experiment=lora_ab",
        "base.enabled=false",
        "data=stdlib",
        f"train.steps={steps}",
        "train.warmup_steps=1",
        "train.eval_every=2",
        "train.eval_batches=4",
        f"seed={repeat}",
        f"seeds=[{','.join(map(str, seeds))}]",
        f"prune={'true' if prune else 'false'}",
        "~variants",
        VARIANTS,
        f"run_root={root}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return Path(proc.stdout.strip().splitlines()[-1].removeprefix("run_dir: ")), seconds, proc.stderr


def one_run(root: Path, repeat: int, n_seeds: int, steps: int) -> dict:
    run_dir, seconds, stderr = launch(root, repeat, n_seeds, steps)
    tasks = {}
    for path in sorted((run_dir / "tasks").glob("*/result.json")):
        r = json.loads(path.read_text())
        pruned = r.get("exit_state") == "pruned"
        tasks[path.parent.name] = {
            "variant": path.parent.name.rsplit("-s", 1)[0],
            "pruned_at": r.get("step") if pruned else None,
            "compared_step": r.get("compared_step") if pruned else None,
            "best": r.get("best") if pruned else None,
        }
    looks = (
        [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
        if (run_dir / "decisions.jsonl").is_file()
        else []
    )
    return {
        "repeat": repeat,
        "seconds": seconds,
        "tasks": tasks,
        "looks": [{"look": x["look"], "step": x["step"], "pruned": x["pruned"]} for x in looks],
        "layout_note": "can never be compared" in stderr,
    }


def rates(runs: list[dict], variants: tuple[str, ...]) -> dict:
    """Runs where any replicate of `variants` was pruned, replicates pruned, and the steps they stopped at."""
    hit = [any(t["pruned_at"] is not None for t in r["tasks"].values() if t["variant"] in variants) for r in runs]
    reps = [t for r in runs for t in r["tasks"].values() if t["variant"] in variants]
    steps = [t["pruned_at"] for t in reps if t["pruned_at"] is not None]
    return {
        "runs": len(runs),
        "runs_pruned": sum(hit),
        "replicates": len(reps),
        "replicates_pruned": len(steps),
        "steps": steps,
        "median_step": statistics.median(steps) if steps else None,
        "earliest_step": min(steps) if steps else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs (each: a, b and loser, --seeds replicates each)")
    ap.add_argument("--seeds", type=int, default=3, help="training seeds per variant (prune=true needs 2+)")
    ap.add_argument("--steps", type=int, default=8, help="train.steps (evaluations every 2 steps before the last)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results path without suffix (.md and .json)")
    args = ap.parse_args()
    check(args.out.with_suffix(".md"))
    command = "python benchmarks/prune_real.py" + "".join(
        f" --{k} {v}"
        for k, v, d in (("repeats", args.repeats, 5), ("seeds", args.seeds, 3), ("steps", args.steps, 8))
        if v != d
    )
    head = header(command)
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="prune_real-") as tmp:
        for i in range(args.repeats):
            runs.append(one_run(Path(tmp), i, args.seeds, args.steps))
            pruned = {n: t["pruned_at"] for n, t in runs[-1]["tasks"].items() if t["pruned_at"] is not None}
            print(f"repeat {i}: {runs[-1]['seconds']:.0f} s, pruned {pruned or 'none'}", flush=True)
    load_after = os.getloadavg()
    loser, equal = rates(runs, ("loser",)), rates(runs, ("a", "b"))
    looks = Schedule.of([(args.steps, 2)]).n_looks  # the looks the run may take: from GRACE of training on
    res = {
        "command": command,
        "header": head,
        "variants": VARIANTS,
        "steps": args.steps,
        "seeds": args.seeds,
        "looks": looks,
        "loser": loser,
        "equal": equal,
        "layout_notes": sum(r["layout_note"] for r in runs),
        "runs": runs,
        "load_before": load_before,
        "load_after": load_after,
    }

    looks_taken = ", ".join(str(len(r["looks"])) for r in runs)
    fixed = sum(len(r["tasks"]) for r in runs) * args.steps
    trained = sum(t["pruned_at"] or args.steps for r in runs for t in r["tasks"].values())

    def share(n: int, d: int) -> str:
        return f"{n}/{d} ({100 * n / d:.0f}%)" if d else "0/0"

    lines = [
        "# prune=true on real tasks: a planted loser and an A/A pair",
        "",
        *head,
        "",
        f"Each of {args.repeats} runs: variants `a` and `b` (the same config: an A/A pair) and `loser` (train.lr=1e-6), "
        f"{args.seeds} training seeds each, the tiny config-built model on data=stdlib, {args.steps} steps, an "
        f"evaluation every 2 steps ({looks} in-training look{'s' if looks != 1 else ''}: from GRACE={GRACE} of "
        f"training on, so the prune level is 5% / {looks}), this machine's "
        f"default launcher.cpu_slots. Load average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_before)} "
        f"before, {'/'.join(f'{x:.2f}' for x in load_after)} after.",
        "",
        "| variant | runs where a replicate was pruned | replicates pruned | median step pruned | earliest |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in (("loser (lr 1e-6)", loser), ("a or b (equal)", equal)):
        lines.append(
            f"| {name} | {share(r['runs_pruned'], r['runs'])} | {share(r['replicates_pruned'], r['replicates'])} | "
            f"{r['median_step'] if r['median_step'] is not None else '-'} | "
            f"{r['earliest_step'] if r['earliest_step'] is not None else '-'} |"
        )
    lines += [
        "",
        f"Runs that printed the layout note (no comparison possible): {res['layout_notes']} of {args.repeats}. "
        f"Looks a run took (decisions.jsonl): {looks_taken}. Training steps the tasks ran: {trained} of "
        f"{fixed} the fixed design runs ({100 * trained / fixed:.0f}%). "
        f"Median wall time of a run: {statistics.median(r['seconds'] for r in runs):.0f} s.",
    ]
    write(args.out.with_suffix(".md"), "\n".join(lines), res)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
