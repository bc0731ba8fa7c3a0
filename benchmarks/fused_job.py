"""Fused variants through the job's real command (issue 28): `resources.fuse_variants=K` against the same K variants
as separate tasks of the local launcher on the same cores, side by side in one run: total tokens/s and peak memory.

    python benchmarks/fused_job.py                     # K = 2, 4, 8 default model; K = 4 GPT-2-small shape
    python benchmarks/fused_job.py --ks 4 --steps 12 --small-k 0 --out /tmp/fused_job.md

Each run is `python -m slurm_router -m GRID ...` (a sweep: the variants differ in LoRA rank and lr, each its own
training seed order): separate = resources.fuse_variants=1 (the local queue runs launcher.cpu_slots tasks at a time,
one worker each, the cores shared between them); fused = resources.fuse_variants=K (one task, one worker, every
core), in both layouts (train.fused_layout=per_variant, row). Tokens/s: every variant's real tokens of the steps
after `--warmup`, over the wall time from the earliest end of a warm-up step to the latest end of a last step (the
step rows' clock: the separate tasks' window holds the later tasks' start-up, as the queue pays it). Memory: each
task's worker peak RSS (its step rows' mem_peak_bytes), the separate tasks' summed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import REPO, check, header, write  # noqa: E402

GRIDS = {
    2: ["model.lora.r=8,16"],
    4: ["model.lora.r=8,16", "train.lr=5e-3,2e-3"],
    8: ["model.lora.r=4,8,16,32", "train.lr=5e-3,2e-3"],
}
SHAPES = {"default": [], "gpt2_small": ["model=gpt2_small"]}
# On a CPU the GPT-2-small case keeps the byte-level vocabulary (model.vocab_size=257: GPT-2 small's 12 blocks of 768,
# an 85M model): GPT-2's 50257-row embedding and output layer would not let 4 separate tasks fit this machine's
# 24 GiB, and it is what the figures of ff8b68f trained (the worker then ignored model.vocab_size). A GPU runs 50257.
CPU_VOCAB = {"gpt2_small": ["model.vocab_size=257"]}
COMMON = [
    "base.enabled=false",
    "train.global_batch_size=16",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.eval_batch_size=4",
    "data.max_documents=200",
]


def run(shape: str, k: int, steps: int, fuse: int | str, layout: str, tmp: Path, gpu: bool = False) -> Path:
    """On a GPU the separate tasks share it as processes (resources.tasks_per_gpu=K, the local launcher's co-location).
    fuse="auto": the command chooses K (resources.fuse_variants=auto: the tasks spread over the slots it runs at
    once; one GPU is one slot)."""
    tmp.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    share = f"resources.tasks_per_gpu={1 if fuse == 'auto' else k}" if gpu else f"launcher.cpu_slots={cores}"
    vocab = [] if gpu else CPU_VOCAB.get(shape, [])
    args = [*COMMON, *SHAPES[shape], *vocab, f"train.steps={steps}", share, f"run_root={tmp}"]
    if fuse != 1:
        args += [f"resources.fuse_variants={fuse}"] + ([f"train.fused_layout={layout}"] if layout else [])
    out = subprocess.run(
        [sys.executable, "-m", "slurm_router", "-m", *GRIDS[k], *args], capture_output=True, text=True, cwd=tmp
    )
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    return Path(out.stdout.strip().splitlines()[-1].split("run_dir: ", 1)[1])


def measure(run_dir: Path, warmup: int) -> dict:
    """Total tokens/s over the union window and the summed worker peaks, over every variant task of the run."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    tokens, starts, ends, peaks = 0, [], [], {}
    for name, task in manifest["tasks"].items():
        rows = [json.loads(line) for line in (run_dir / "tasks" / name / "events-rank0.jsonl").read_text().splitlines()]
        steps = sorted((r for r in rows if r["event"] == "step"), key=lambda r: r["step"])
        tokens += sum(r["n_tokens"] for r in steps[warmup:])
        starts.append(steps[warmup - 1]["time"])
        ends.append(steps[-1]["time"])
        worker = task.get("fused_into") or name  # a fused group's members share their leader's worker
        peaks[worker] = max([peaks.get(worker, 0)] + [r["mem_peak_bytes"] or 0 for r in steps])
    return {
        "tokens_per_s": tokens / (max(ends) - min(starts)),
        "rss_mib": sum(peaks.values()) / 2**20,
        "one_task_mib": max(peaks.values()) / 2**20,
        "tasks": len(peaks),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="2,4,8", help="numbers of variants, default model (2, 4 or 8)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--small-k", type=int, default=4, help="variants of the GPT-2-small shape (0: skip it)")
    p.add_argument("--small-steps", type=int, default=4)
    p.add_argument("--gpu", action="store_true", help="on a GPU machine: the separate tasks share one GPU")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/fused-job-cpu.md"))
    args = p.parse_args()
    check(Path(args.out))
    cases = [("default", int(k), args.steps, args.warmup) for k in args.ks.split(",") if k]
    if args.small_k:
        cases.append(("gpt2_small", args.small_k, args.small_steps, 1))
    rows = []
    for shape, k, steps, warmup in cases:
        with tempfile.TemporaryDirectory() as tmp:
            got = {
                name: measure(run(shape, k, steps, fuse, layout, Path(tmp) / name, args.gpu), warmup)
                for name, fuse, layout in (
                    ("separate", 1, ""),
                    ("per_variant", k, "per_variant"),
                    ("row", k, "row"),
                    # one GPU is one slot: auto fuses every variant (as far as memory allows) in the GPU's row
                    # layout, the row column again; the lease's minutes go to the other three
                    *([] if args.gpu else [("auto", "auto", "")]),
                )
            }
        rows.append({"model": shape, "variants": k, "steps": steps, "warmup": warmup, **got})
        print(json.dumps(rows[-1]), flush=True)
    cores = os.cpu_count() or 1
    command = "python benchmarks/fused_job.py " + " ".join(sys.argv[1:])
    lines = [
        "# Fused variants through the job's real command against separate tasks (CPU)",
        "",
        *header(command.strip()),
        "",
        f"`python -m slurm_router -m GRID` with resources.fuse_variants=K (one task, one worker) against "
        f"resources.fuse_variants=1 (K tasks: {'sharing one GPU as processes, resources.tasks_per_gpu=K' if args.gpu else f'launcher.cpu_slots={cores} at a time, the {cores} cores shared'}); batch 16 per "
        "variant, stdlib corpus, packed rows, variants differing in LoRA rank and lr. Tokens/s: every variant's real "
        "tokens after the warm-up steps over the union wall window of those steps (step rows' clock); memory: each "
        "worker's peak RSS, the separate tasks' summed. Fused layouts (train.fused_layout): per variant (one row per "
        "variant through the shared model) and one row (every variant's samples in one row). Auto: "
        "resources.fuse_variants=auto, the K the command chooses (the tasks spread over the slots it runs at once; "
        "the groups it made in brackets), in its default layout."
        + ("" if args.gpu else " gpt2_small: GPT-2 small's 12 blocks of 768 with the byte-level vocabulary (257)."),
        "",
        "| model | variants | separate tokens/s | fused, one row | fused, per variant | separate RSS MiB | "
        "fused, one row | fused, per variant | fused, auto (groups) | auto RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        sep, row, per = r["separate"], r["row"], r["per_variant"]
        auto = r.get("auto") or {"tokens_per_s": float("nan"), "rss_mib": float("nan"), "tasks": "not run"}
        t, m = sep["tokens_per_s"], sep["rss_mib"]
        lines.append(
            f"| {r['model']} | {r['variants']} | {t:,.0f} | {row['tokens_per_s']:,.0f} ({row['tokens_per_s'] / t:.2f}x) | "
            f"{per['tokens_per_s']:,.0f} ({per['tokens_per_s'] / t:.2f}x) | {m:,.0f} | "
            f"{row['rss_mib']:,.0f} ({row['rss_mib'] / m:.2f}x) | {per['rss_mib']:,.0f} ({per['rss_mib'] / m:.2f}x) | "
            f"{auto['tokens_per_s']:,.0f} ({auto['tokens_per_s'] / t:.2f}x; {auto['tasks']}) | "
            f"{auto['rss_mib']:,.0f} ({auto['rss_mib'] / m:.2f}x) |"
        )
    lines += [
        "",
        "Fused peak memory against one separate task's (the issue's GPU target: at most 1.3x one variant):",
        "",
    ]
    for r in rows:
        one = r["separate"]["one_task_mib"]
        lines.append(
            f"- {r['model']}, {r['variants']} variants: per variant {r['per_variant']['rss_mib'] / one:.2f}x, "
            f"one row {r['row']['rss_mib'] / one:.2f}x"
        )
    write(Path(args.out), "\n".join(lines), {"rows": rows})


if __name__ == "__main__":
    main()
