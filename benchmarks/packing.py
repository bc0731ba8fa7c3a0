"""Variant packing: 4 GPT-2-small LoRA variants on ONE GPU, packed (resources.tasks_per_gpu=4) against one
after another (tasks_per_gpu=1), in steady state: each task's first --warmup steps (and its process start-up)
are left out. One after another: the timed steps' tokens / their summed wall time (what one task sustains
alone). Packed: the tokens of every task's steps that end while all four are past warm-up and still running,
over that shared window; the window's share of the packed stage is printed beside it.

    python benchmarks/packing.py            # needs one NVIDIA GPU; writes benchmarks/results/packing.md
    python benchmarks/packing.py --shapes 8x512,4x256 --steps 60 --out DIR    # more shapes; into DIR instead

On a machine without a GPU it says so and writes nothing (packing is about idle GPU capacity).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import RESULTS, check, header, write  # noqa: E402


def steady(tasks: list[list[dict]], tasks_per_gpu: int, warmup: int) -> dict:
    """Steady-state aggregate tokens/s from each task's step rows (a step ends at its row's "time")."""
    timed = [rows[warmup:] for rows in tasks]
    starts = [rows[warmup - 1]["time"] if warmup else rows[0]["time"] - rows[0]["t_step_s"] for rows in tasks]
    if tasks_per_gpu == 1:
        tokens = sum(r["n_tokens"] for rows in timed for r in rows)
        return {"tokens_per_s": tokens / sum(rows[-1]["time"] - s for rows, s in zip(timed, starts)), "overlap": 1.0}
    t0, t1 = max(starts), min(rows[-1]["time"] for rows in timed)
    if t1 <= t0:
        raise RuntimeError("the packed tasks never ran past warm-up together: raise --steps")
    tokens = sum(r["n_tokens"] for rows in timed for r in rows if t0 < r["time"] <= t1)
    stage = max(rows[-1]["time"] for rows in timed) - min(starts)
    return {"tokens_per_s": tokens / (t1 - t0), "overlap": (t1 - t0) / stage}


def run(tasks_per_gpu: int, tmp: Path, batch: int, seq: int, steps: int, warmup: int) -> dict:
    variants = [f"+variants.v{i}.train.lr={1e-4 * (i + 1)}" for i in range(4)]
    args = [
        sys.executable,
        "-m",
        "slurm_router",
        "base.enabled=false",
        "model=gpt2_small",
        "data=synthetic",
        "data.length_dist=fixed",
        f"data.mean_len={seq}",
        f"data.max_len={seq}",
        "data.n_samples=4096",
        f"train.global_batch_size={batch}",
        f"train.steps={steps}",
        "train.eval_batches=1",
        "train.eval_batch_size=4",
        f"resources.tasks_per_gpu={tasks_per_gpu}",
        f"run_root={tmp}",
        *variants,
    ]
    out = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"}, cwd=tmp)
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])
    run_dir = Path(out.stdout.strip().splitlines()[-1].split("run_dir: ", 1)[1])
    tasks = []
    for f in sorted(run_dir.glob("tasks/v*/events-rank0.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        tasks.append(sorted((r for r in rows if r["event"] == "step"), key=lambda r: r["time"]))
    ooms = sum(r.get("oom_retries", 0) for rows in tasks for r in rows)
    return {"tasks_per_gpu": tasks_per_gpu, **steady(tasks, tasks_per_gpu, warmup), "oom_retries": ooms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x512", help="global batch x sequence length, comma-separated")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10, help="each task's first steps, left out of tokens/s")
    ap.add_argument("--out", type=Path, help="write the result files into this folder, not benchmarks/results/")
    args = ap.parse_args()
    folder = args.out or RESULTS
    check(folder / "packing.md")
    import torch

    if not torch.cuda.is_available():
        print("packing benchmark: no GPU here; run it on a machine with one NVIDIA GPU")
        return
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"packing-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        batch, seq = (int(v) for v in shape.split("x"))
        serial = run(1, tmp, batch, seq, args.steps, args.warmup)
        rows.append((batch, seq, serial, run(4, tmp, batch, seq, args.steps, args.warmup)))
    command = f"python benchmarks/packing.py --shapes {args.shapes} --steps {args.steps} --warmup {args.warmup}"
    lines = [
        f"# Variant packing ({torch.cuda.get_device_name()})",
        "",
        *header(command),
        "",
        f"4 GPT-2-small LoRA r16 variants, {args.steps} steps each, one GPU: `resources.tasks_per_gpu=4` "
        f"(packed) against 1 (one after another). Steady-state aggregate tokens/s: each task's first "
        f"{args.warmup} steps and its start-up left out (the script's docstring says how); overlap = the share "
        "of the packed stage during which all four tasks were past warm-up and running.",
        "",
        "| batch | one after another tokens/s | packed x4 tokens/s | ratio | overlap | OOM retries (packed) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for batch, seq, s, p in rows:
        lines.append(
            f"| {batch} x {seq} | {s['tokens_per_s']:,.0f} | {p['tokens_per_s']:,.0f} | "
            f"{p['tokens_per_s'] / s['tokens_per_s']:.2f} | {p['overlap']:.0%} | {p['oom_retries']} |"
        )
    data = {"gpu": torch.cuda.get_device_name(), "warmup_steps": args.warmup, "rows": rows}
    write(folder / "packing.md", "\n".join(lines), data)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
