"""How far the loss curves of 1 device and 2 devices drift apart over a long run: the central invariant says they
are equal up to float reduction order, and reduction-order differences compound over steps.

    python benchmarks/long_run_drift.py [--steps 300] [--out DIR]

Runs the real command twice on this machine's CPU worker slots (gloo): the same task on 1 device with round_robin
and on 2 devices with balanced routing, then compares every step's training loss and the held-out losses.
tests/test_invariant.py checks 6-step runs to a relative 2e-5; this measures what holds over `--steps`.
Writes benchmarks/results/long_run_drift.md and .json (or into --out DIR).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import check, header, write  # noqa: E402

RESULTS = Path(__file__).parent / "results"
COMMON = [
    "base.enabled=false",
    "train.global_batch_size=12",
    "train.lr=1e-2",
    "train.eval_batch_size=4",
    "data.max_documents=200",
    "data.max_len=128",
    "launcher.cpu_slots=2",
]
SETUPS = {"1 device, round_robin": ["resources.devices_per_task=1", "router=round_robin"],
          "2 devices, balanced": ["resources.devices_per_task=2", "router=balanced"]}  # fmt: skip
CHECKPOINTS = (6, 60, 150)  # steps at which the drift so far is reported, besides the whole run


def run(root: Path, steps: int, args: list[str]) -> dict:
    eval_every = max(1, steps // 5)
    cmd = [sys.executable, "-m", "slurm_router", *COMMON, *args, f"train.steps={steps}"]
    cmd += [f"train.eval_every={eval_every}", f"run_root={root}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"long_run_drift: the run failed:\n{proc.stderr[-3000:]}")
    run_dir = Path(next(line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("run_dir: ")))
    steps_loss: dict[int, float] = {}
    evals: dict[int, float] = {}
    for line in (run_dir / "tasks" / "main" / "events-rank0.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("event") == "step" and row.get("loss") is not None:
            steps_loss[row["step"]] = row["loss"]
        elif row.get("event") == "eval" and row.get("val_loss") is not None:
            evals[row["step"]] = row["val_loss"]
    return {"steps": steps_loss, "evals": evals}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for the results (default benchmarks/results)")
    a = ap.parse_args()
    md = a.out / "long_run_drift.md"
    check(md)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run(Path(tmp) / str(i), a.steps, args) for i, (name, args) in enumerate(SETUPS.items())}
    one, two = runs.values()
    common = sorted(set(one["steps"]) & set(two["steps"]))
    diffs = {s: rel(one["steps"][s], two["steps"][s]) for s in common}
    spans = [c for c in CHECKPOINTS if c < a.steps] + [a.steps]
    span_rows = [(n, max(d for s, d in diffs.items() if s < n)) for n in spans]
    eval_rows = [(s, one["evals"][s], two["evals"][s]) for s in sorted(set(one["evals"]) & set(two["evals"]))]
    command = "python benchmarks/long_run_drift.py" + ("" if a.steps == 300 else f" --steps {a.steps}")
    lines = [
        "# Long-run drift: 1 device against 2 devices, the same task",
        "",
        *header(command),
        "",
        f"{a.steps} steps of the default model (global batch 12, max_len 128, lr 1e-2, no warm-up base stage) on CPU "
        "worker slots (gloo): one run on 1 device with round_robin, one on 2 devices with balanced routing. The "
        "global batches are the same; only which device sums which samples, and so the float reduction order, differs.",
        "",
        "| steps | largest relative difference of a step's training loss |",
        "|---:|---:|",
        *[f"| first {n} | {d:.2e} |" for n, d in span_rows],
        "",
        "| held-out loss at step | 1 device | 2 devices | relative difference |",
        "|---:|---:|---:|---:|",
        *[f"| {s} | {x:.6f} | {y:.6f} | {rel(x, y):.2e} |" for s, x, y in eval_rows],
    ]
    write(md, "\n".join(lines), {"steps": a.steps, "spans": span_rows, "evals": eval_rows, "per_step": diffs})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
