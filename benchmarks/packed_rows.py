"""Packed rows vs padded micro-batches: the same job, the same long-tailed samples, train.packing on and off,
interleaved repeats, tokens/s by the step rows' wall clock (benchmarks/jobrun.py).

    python benchmarks/packed_rows.py                 # GPU: GPT-2 small, bf16; CPU: the default gpt2_tiny
    python benchmarks/packed_rows.py --repeats 1 --steps 30 --out DIR

The corpus is synthetic with a long tail (lognormal, mean 96 tokens, sigma 1.0, 8 to 1024): the padded job
sorts each device's share by length into micro-batches, the packed one lays it end to end in one row.
Writes benchmarks/results/packed_rows-<device>.md and .json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jobrun import run_job  # noqa: E402
from provenance import RESULTS, check, header, write  # noqa: E402

WARMUP = 5
LONG_TAIL = [
    "data=synthetic",
    "data.length_dist=lognormal",
    "data.mean_len=96",
    "data.sigma=1.0",
    "data.min_len=8",
    "data.max_len=1024",
    "data.n_samples=4096",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=Path, help="write the result files into this folder, not benchmarks/results/")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = (args.out or RESULTS) / f"packed_rows-{device}.md"
    check(out)
    model = ["model=gpt2_small", "model.n_positions=1024"] if device == "cuda" else ["model.n_positions=1024"]
    common = [
        "base.enabled=false",
        *model,
        *LONG_TAIL,
        f"train.steps={args.steps + WARMUP}",
        f"train.global_batch_size={args.batch}",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.eval_batch_size=4",
    ]
    tmp = Path(tempfile.mkdtemp(prefix="packed-rows-"))
    runs: dict[str, list[dict]] = {"packed": [], "padded": []}
    for _ in range(args.repeats):
        for mode, flag in (("packed", "true"), ("padded", "false")):
            runs[mode].append(
                run_job([*common, f"train.packing={flag}"], tmp, WARMUP, threads=None if device == "cuda" else 2)
            )
            print(mode, runs[mode][-1], flush=True)
    med = {m: statistics.median(r["tokens_per_s"] for r in rs) for m, rs in runs.items()}
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    command = f"python benchmarks/packed_rows.py --repeats {args.repeats} --steps {args.steps} --batch {args.batch}"
    lines = [
        f"# Packed rows vs padded micro-batches ({gpu or device})",
        "",
        *header(command),
        "",
        f"{'GPT-2 small, bf16 autocast' if device == 'cuda' else 'gpt2_tiny, fp32, 2 threads'}, LoRA (the "
        f"model's defaults), batch {args.batch}, long-tailed synthetic lengths ({' '.join(LONG_TAIL[1:])}), "
        f"{args.steps} timed steps after {WARMUP}; {args.repeats} interleaved runs, median (min-max).",
        "",
        "| micro-batches | tokens/s | useful tokens | micro-batches per step | peak memory MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode, rs in runs.items():
        speeds = [r["tokens_per_s"] for r in rs]
        peak = max((r["peak_mem_bytes"] or 0) for r in rs) / 2**20
        lines.append(
            f"| {mode} | {med[mode]:,.0f} ({min(speeds):,.0f}-{max(speeds):,.0f}) | "
            f"{100 * rs[0]['useful_fraction']:.1f}% | {rs[0]['micro_batches_per_step']:.0f} | {peak:,.0f} |"
        )
    lines += [
        "",
        f"Packed / padded: {med['packed'] / med['padded']:.2f}x tokens/s. Load average (1, 5, 15 min) at "
        f"the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs.",
    ]
    write(out, "\n".join(lines), {"device": gpu or device, "runs": runs, "ratio": med["packed"] / med["padded"]})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
