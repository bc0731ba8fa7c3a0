"""Variant packing: 4 GPT-2-small LoRA variants on ONE GPU, packed (resources.tasks_per_gpu=4) against one
after another (tasks_per_gpu=1). Aggregate tokens/s = all variants' trained tokens / wall time of the stage.

    python benchmarks/packing.py            # needs one NVIDIA GPU; writes benchmarks/results/packing.md
    python benchmarks/packing.py --shapes 8x512,4x256 --steps 60 --out DIR    # more shapes; a copy into DIR

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
from provenance import REPO, header  # noqa: E402


def run(tasks_per_gpu: int, tmp: Path, batch: int, seq: int, steps: int) -> dict:
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
    spans, tokens, ooms = [], 0, 0
    for f in run_dir.glob("tasks/v*/events-rank0.jsonl"):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        steps_rows = [r for r in rows if r["event"] == "step"]
        spans.append((steps_rows[0]["time"] - steps_rows[0]["t_step_s"], steps_rows[-1]["time"]))
        tokens += sum(r["n_tokens"] for r in steps_rows)
        ooms += sum(r.get("oom_retries", 0) for r in steps_rows)
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    return {
        "tasks_per_gpu": tasks_per_gpu,
        "aggregate_tokens_per_s": tokens / wall,
        "wall_s": wall,
        "oom_retries": ooms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x512", help="global batch x sequence length, comma-separated")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", type=Path, help="also write the result file into this folder")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("packing benchmark: no GPU here; run it on a machine with one NVIDIA GPU")
        return
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"packing-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        batch, seq = (int(v) for v in shape.split("x"))
        serial, packed = run(1, tmp, batch, seq, args.steps), run(4, tmp, batch, seq, args.steps)
        rows.append((batch, seq, serial, packed))
    command = f"python benchmarks/packing.py --shapes {args.shapes} --steps {args.steps}"
    lines = [
        f"# Variant packing ({torch.cuda.get_device_name()})",
        "",
        *header(command),
        "",
        f"4 GPT-2-small LoRA r16 variants, {args.steps} steps each, one GPU: `resources.tasks_per_gpu=4` "
        "(packed) against 1 (one after another). Aggregate tokens/s = every variant's trained tokens / wall "
        "time from the first variant's first step to the last variant's last step.",
        "",
        "| batch | one after another tokens/s | packed x4 tokens/s | ratio | OOM retries (packed) |",
        "|---|---:|---:|---:|---:|",
    ]
    for batch, seq, s, p in rows:
        lines.append(
            f"| {batch} x {seq} | {s['aggregate_tokens_per_s']:,.0f} | {p['aggregate_tokens_per_s']:,.0f} | "
            f"{p['aggregate_tokens_per_s'] / s['aggregate_tokens_per_s']:.2f} | {p['oom_retries']} |"
        )
    for folder in [REPO / "benchmarks" / "results", *([args.out] if args.out else [])]:
        (folder / "packing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
